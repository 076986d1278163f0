"""ASGI responses that notice a client going away while a generation runs.

Both watch the connection for `http.disconnect` next to the work, whatever ASGI spec version the HTTP
server speaks (Starlette's StreamingResponse only does so below spec 2.4, and a plain JSONResponse not at
all), so a client that hangs up mid-prefill, mid-decode or while waiting for a non-streamed answer gets
its request aborted at once and its slot and KV freed within one engine step.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from cobatch.server.errors import ApiError, error_response

log = logging.getLogger("cobatch.server")

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]


def sse_data(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


def sse_event(event: str, payload: dict) -> str:
    return f"event: {event}\n{sse_data(payload)}"


async def _until_disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(work: Callable[[], Awaitable[None]], receive: Receive) -> None:
    """Run `work` until it ends or the client disconnects, whichever comes first."""
    async with anyio.create_task_group() as tg:
        async def run_then_stop(fn: Callable[[], Awaitable[None]]) -> None:
            await fn()
            tg.cancel_scope.cancel()

        tg.start_soon(run_then_stop, work)
        tg.start_soon(run_then_stop, lambda: _until_disconnected(receive))


class EventStreamResponse(Response):
    """Server-sent events from an async iterator of ready frames. `on_close` runs however it ends."""

    def __init__(self, frames: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(status_code=200)      # a Response, so FastAPI passes it through untouched
        self.frames, self.on_close = frames, on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            async def pump() -> None:
                async for frame in self.frames:
                    await send({"type": "http.response.body", "body": frame.encode(), "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})

            await _unless_disconnected(pump, receive)
        finally:
            with anyio.CancelScope(shield=True):
                await self.frames.aclose()
            self.on_close()


class GeneratedJSONResponse(Response):
    """A JSON answer computed after the response object is returned (the whole generation), abandoned
    if the client disconnects first."""

    def __init__(self, produce: Callable[[], Awaitable[dict]], on_close: Callable[[], None], path: str):
        super().__init__(status_code=200)
        self.produce, self.on_close, self.path = produce, on_close, path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        response: Response | None = None
        try:
            async def work() -> None:
                nonlocal response
                try:
                    response = JSONResponse(await self.produce())
                except ApiError as err:
                    response = error_response(err, self.path)
                except Exception as exc:         # a bug: still answer in the protocol's error shape
                    log.exception("generation failed on %s", self.path)
                    response = error_response(ApiError(500, f"internal server error: {type(exc).__name__}"),
                                              self.path)

            await _unless_disconnected(work, receive)
        finally:
            self.on_close()
        if response is not None:
            await response(scope, receive, send)
