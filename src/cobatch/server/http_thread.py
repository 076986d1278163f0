"""Run the app under uvicorn in a background thread on a free port (tests, in-process benchmarks)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI


class ServerThread:
    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 make_server: Callable[[uvicorn.Config], uvicorn.Server] = uvicorn.Server):
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                                timeout_graceful_shutdown=5)
        self.server = make_server(config)
        self.thread = threading.Thread(target=self.server.run, name="cobatch-http", daemon=True)
        self.host = host

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
