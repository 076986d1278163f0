"""The server's life: loading -> ready -> draining, as a load balancer and a supervisor see it.

- While the model loads, the port is already bound: /health answers 503 {"status": "loading"} and every
  other route 503 with an error body (llama.cpp's server does the same), so a load balancer waits.
- On SIGTERM / SIGINT the server drains: new requests get 503, requests in flight finish (up to
  --graceful-shutdown-s), then it exits with status 0 -- not 143, which a supervisor reads as a crash.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Literal

import uvicorn
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from cobatch.server.errors import ApiError, error_response

log = logging.getLogger("cobatch.server")

Phase = Literal["loading", "ready", "draining"]
RETRY_AFTER_S = "5"


class Lifecycle:
    """The phase and the number of HTTP requests in flight (shared by the middleware and the drain)."""

    def __init__(self, phase: Phase = "ready"):
        self.phase: Phase = phase
        self.in_flight = 0
        self._lock = threading.Lock()

    def enter(self) -> None:
        with self._lock:
            self.in_flight += 1

    def leave(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def unavailable(self, path: str) -> JSONResponse:
        """The 503 a request gets while loading or draining (/health: just the status)."""
        headers = {"Retry-After": RETRY_AFTER_S}
        if path == "/health":
            return JSONResponse({"status": self.phase}, status_code=503, headers=headers)
        what = "the model is still loading" if self.phase == "loading" else "the server is shutting down"
        return error_response(ApiError(503, f"{what}; retry later", code="service_unavailable", headers=headers),
                              path)


class LifecycleMiddleware:
    """Counts requests in flight; while the server is not ready, answers 503 instead of the app."""

    def __init__(self, app: ASGIApp, lifecycle: Lifecycle):
        self.app, self.lifecycle = app, lifecycle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.lifecycle.phase != "ready":
            return await self.lifecycle.unavailable(scope["path"])(scope, receive, send)
        self.lifecycle.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.lifecycle.leave()


class LoadingApp:
    """The ASGI app uvicorn serves from the start: 503 while `load()` runs on a thread, then the app
    `build(result)` returns (its lifespan entered then). A failed load stops the server; `error` says why."""

    def __init__(self, load: Callable[[], object], build: Callable[[object], ASGIApp], lifecycle: Lifecycle,
                 on_failure: Callable[[], None]):
        self.load, self.build, self.lifecycle, self.on_failure = load, build, lifecycle, on_failure
        self.app: ASGIApp | None = None
        self.error: BaseException | None = None
        self._lifespan = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return await self._run_lifespan(receive, send)
        if self.app is None:
            if scope["type"] == "http":
                return await self.lifecycle.unavailable(scope["path"])(scope, receive, send)
            return None            # a websocket: closed unanswered
        await self.app(scope, receive, send)

    async def _run_lifespan(self, receive: Receive, send: Send) -> None:
        await receive()                                   # lifespan.startup
        task = asyncio.create_task(self._load_then_serve())
        await send({"type": "lifespan.startup.complete"})
        await receive()                                   # lifespan.shutdown
        if not task.done():
            task.cancel()          # the loading thread is a daemon: it dies with the process
        elif self._lifespan is not None:
            await self._lifespan.__aexit__(None, None, None)
        await send({"type": "lifespan.shutdown.complete"})

    async def _load_then_serve(self) -> None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def run() -> None:
            try:
                result = self.load()
            except BaseException as exc:          # reported by serve(), after uvicorn stops
                loop.call_soon_threadsafe(done.set_exception, exc)
            else:
                loop.call_soon_threadsafe(done.set_result, result)

        threading.Thread(target=run, name="cobatch-load", daemon=True).start()
        try:
            app = self.build(await done)
            lifespan = app.router.lifespan_context(app)
            await lifespan.__aenter__()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self.error = exc
            self.on_failure()
            return
        self._lifespan, self.app = lifespan, app
        if self.lifecycle.phase == "loading":
            self.lifecycle.phase = "ready"


class DrainingServer(uvicorn.Server):
    """uvicorn, with a drain before it stops: the first SIGTERM / SIGINT turns new requests away (503) and
    waits up to `grace_s` for those in flight; a second signal stops at once. The signal is not re-raised
    after the shutdown (uvicorn's own handler records it for that), so the process exits 0."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle, grace_s: float):
        super().__init__(config)
        self.lifecycle, self.grace_s = lifecycle, grace_s

    def handle_exit(self, sig: int, frame) -> None:
        if self.lifecycle.phase == "draining" or self.should_exit:
            log.warning("second %s: stopping now", signal.Signals(sig).name)
            self.should_exit = self.force_exit = True
            return
        self.begin_drain(signal.Signals(sig).name if sig else "shutdown")

    def begin_drain(self, why: str = "shutdown") -> None:
        was_loading = self.lifecycle.phase == "loading"
        self.lifecycle.phase = "draining"
        if was_loading:
            self.should_exit = True
            return
        log.info("%s: draining %d request(s) in flight (up to %gs)", why, self.lifecycle.in_flight, self.grace_s)
        threading.Thread(target=self._drain, name="cobatch-drain", daemon=True).start()

    def _drain(self) -> None:
        deadline = time.monotonic() + self.grace_s
        while self.lifecycle.in_flight > 0 and time.monotonic() < deadline:
            time.sleep(0.05)            # polling a counter; nothing to wait on
        if self.lifecycle.in_flight > 0:
            log.warning("--graceful-shutdown-s passed with %d request(s) still running: they are cut off",
                        self.lifecycle.in_flight)
        self.should_exit = True
