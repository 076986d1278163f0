"""The web pages: GET / (a chat with the model) and GET /dashboard (the batching, live), with their scripts and
style under /webui/.

Plain files in the package (server/web/), no build step and nothing fetched from elsewhere: the pages work
offline. The pages call the API from the browser (/v1/chat/completions, /v1/models, /v1/events), which wants the
API key when the server has one; the files themselves hold nothing secret and are served without it, so a
browser can load them and then ask its user for the key. `--no-webui` leaves these routes out (404).
"""

from __future__ import annotations

import functools
from importlib import resources

from fastapi import APIRouter
from starlette.responses import Response

from cobatch.server.errors import ApiError

router = APIRouter()

ASSETS = {"style.css": "text/css", "common.js": "text/javascript", "markdown.js": "text/javascript",
          "chat.js": "text/javascript", "dashboard.js": "text/javascript"}
PUBLIC_PATHS = frozenset({"/", "/dashboard", *(f"/webui/{name}" for name in ASSETS)})
# Model output is rendered as HTML: only this origin's own scripts and styles may run, whatever a reply holds.
HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; "
                                      "base-uri 'none'; frame-ancestors 'none'",
           "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}


@functools.cache
def _read(name: str) -> bytes:
    return (resources.files("cobatch.server") / "web" / name).read_bytes()


def _file(name: str, media_type: str) -> Response:
    return Response(_read(name), media_type=media_type, headers=HEADERS)


@router.get("/", include_in_schema=False)
async def chat_page():
    return _file("chat.html", "text/html")


@router.get("/dashboard", include_in_schema=False)
async def dashboard_page():
    return _file("dashboard.html", "text/html")


@router.get("/webui/{name}", include_in_schema=False)
async def asset(name: str):
    if name not in ASSETS:
        raise ApiError(404, f"no web file {name!r}")
    return _file(name, ASSETS[name])
