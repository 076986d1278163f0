"""Shared pieces of the server tests: a live uvicorn server on a free port, raw-socket SSE clients, polling.

(No tests in here; the name keeps it next to the server tests.)
"""

from __future__ import annotations

import json
import socket
import struct
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx

from cobatch.llm import LLM
from cobatch.server.app import create_app
from cobatch.server.context import ServerOptions
from cobatch.server.http_thread import ServerThread


@contextmanager
def live_server(llm: LLM, options: ServerOptions | None = None) -> Iterator[ServerThread]:
    app = create_app(llm, options)
    with ServerThread(app) as server:
        server.context = app.state.server
        yield server


def wait_for(condition: Callable[[], object], timeout: float = 20.0, what: str = "condition") -> object:
    """Poll until condition() is truthy; fail after timeout (no sleeps standing in for synchronisation)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


def together(*calls: Callable[[], object]) -> list:
    """Each call's result, the calls run at once from threads: independent requests a server decodes in one batch
    take about the time of the longest (a call's exception is raised here)."""
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
        return [f.result() for f in futures]


def slots(url: str) -> dict:
    return httpx.get(url + "/slots", timeout=30).json()


def all_slots_idle(url: str) -> bool:
    view = slots(url)
    return view["queued"] == 0 and all(s["state"] == "idle" for s in view["slots"])


def metric(url: str, name: str, labels: dict[str, str] | None = None, headers: dict[str, str] | None = None) -> float:
    """One sample's value from /metrics (0 when the labelled series does not exist yet)."""
    want = "" if not labels else "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
    response = httpx.get(url + "/metrics", headers=headers, timeout=30)
    response.raise_for_status()
    for line in response.text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        if key == name + want or (not labels and key == name):
            return float(value)
    return 0.0


class RawStream:
    """A streaming request over a bare socket, so the test can hang up at any moment (RST, no FIN
    handshake: the harshest disconnect a client can do). A POST of `body`, or a GET without one."""

    def __init__(self, url: str, path: str, body: dict | None, headers: dict[str, str] | None = None):
        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=60)
        payload = b"" if body is None else json.dumps(body).encode()
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        head = (f"GET {path} HTTP/1.1\r\nHost: {host}\r\n" if body is None else
                f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\n")
        self.sock.sendall((head + extra + "Accept: text/event-stream\r\n\r\n").encode() + payload)
        self._buf = b""

    def read_events(self, n: int) -> list[dict]:
        """Read until n `data:` JSON events (not counting [DONE]) have arrived."""
        events: list[dict] = []
        while len(events) < n:
            while b"\n\n" not in self._buf:
                chunk = self.sock.recv(65536)
                if not chunk:
                    return events
                self._buf += chunk
            frame, self._buf = self._buf.split(b"\n\n", 1)
            for line in frame.split(b"\n"):
                # chunked transfer encoding puts size lines between frames; only data lines matter
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    events.append(json.loads(line[6:]))
        return events

    def hard_close(self) -> None:
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()
