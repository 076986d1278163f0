"""GET /v1/events: the batching as server-sent events, a snapshot every 250 ms (what /dashboard draws).

Each snapshot holds the slots (/slots' view, with each decoding request's tok/s), the queue and its 429s, the KV
blocks and prefix-cache hits, and rates from the engine's counters: step time, aggregate tok/s and rows per step
over the last second, and the batched fraction with the lone-decode steps by cause (the ds4 batch diagnostics of
/metrics) over the last minute. The counters are read on the engine thread between two steps (a consistent
view); each stream keeps the samples of its last minute, and nothing else: a stream that ends leaves nothing
behind.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import APIRouter, Request

from cobatch.server.context import ServerContext, get_context
from cobatch.server.engine_thread import EngineWorker
from cobatch.server.responses import EventStreamResponse, sse_data

router = APIRouter()

INTERVAL_S = 0.25
RECENT_S = 1.0           # the step time, tok/s and rows per step plotted: a second's worth, so slow steps still show
WINDOW_S = 60.0
LONE_CAUSES = ("peer_prefill", "peer_finish", "no_peer")


@dataclass(slots=True, frozen=True)
class Counters:
    """The engine's cumulative counters at one moment."""
    at: float
    steps: int
    step_seconds: float
    rows: int
    tokens: int
    decode_steps: int
    batched_steps: int
    lone: tuple[int, ...]      # by LONE_CAUSES


def _engine_view(worker: EngineWorker) -> tuple[dict, Counters]:
    """On the engine thread: the slots and the counters, from the same moment between two steps."""
    stats = worker.engine.stats
    counters = Counters(time.monotonic(), stats.steps, worker.step_seconds, stats.rows, worker.tokens_generated,
                        stats.decode_steps, stats.batched_steps,
                        (stats.lone_peer_prefill, stats.lone_peer_finish, stats.lone_no_peer))
    return worker.slots_view(), counters


def _ratio(num: float, den: float, digits: int = 3) -> float | None:
    return round(num / den, digits) if den else None


def _slot(view: dict) -> dict:
    slot = {k: view[k] for k in ("id", "state", "requests_served") if k in view}
    if view["state"] == "idle":
        return slot
    slot.update({k: view[k] for k in ("request_id", "prompt_tokens", "cached_prefix_tokens", "computed_tokens",
                                      "generated_tokens", "running_for_s")})
    slot["prefill_progress"] = round(min(view["computed_tokens"], view["prompt_tokens"]) / view["prompt_tokens"], 3)
    decoding_for = view.get("decoding_for_s")
    # the request's decode rate: tokens after its first over the time since the first (None before a second)
    slot["tok_s"] = _ratio(view["generated_tokens"] - 1, decoding_for, 1) if view["generated_tokens"] > 1 else None
    return slot


class Feed:
    """One stream's samples over the last minute, and the snapshot each new sample makes."""

    def __init__(self, server: ServerContext):
        self.server = server
        self.samples: deque[Counters] = deque()

    async def snapshot(self) -> dict:
        worker = self.server.worker
        # no timeout: a long step only delays the snapshot, and a client that leaves cancels the wait
        view, now = await asyncio.wrap_future(worker.call(lambda: _engine_view(worker)))
        self.samples.append(now)
        while now.at - self.samples[0].at > WINDOW_S:
            self.samples.popleft()
        oldest = self.samples[0]
        recent = next(s for s in self.samples if now.at - s.at <= RECENT_S + INTERVAL_S / 2)
        steps = now.steps - recent.steps
        elapsed = now.at - recent.at
        decode_steps = now.decode_steps - oldest.decode_steps
        registry = self.server.metrics.registry

        def metric(name: str, **labels: str) -> int:
            return int(registry.get_sample_value(name, labels) or 0)

        prompt_tokens = metric("cobatch_prompt_tokens_total")
        hit_tokens = metric("cobatch_prefix_cache_hit_tokens_total")
        blocks = view["kv_blocks"]
        return {
            "time": round(time.time(), 3),
            "interval_s": INTERVAL_S,
            "model": self.server.model_name,
            "viewers": self.server.event_streams,
            "slots": [_slot(s) for s in view["slots"]],
            "queue": {"depth": view["queued"], "max": view["max_queue"],
                      "rejected_429": metric("cobatch_http_errors_total", status="429")},
            "recent": {   # over the last second (what the charts plot)
                "seconds": round(elapsed, 2),
                "steps": steps,
                "step_ms": _ratio(1000 * (now.step_seconds - recent.step_seconds), steps, 2),
                "tok_s": _ratio(now.tokens - recent.tokens, elapsed, 1),
                "rows_per_step": _ratio(now.rows - recent.rows, steps, 2),
            },
            "last_minute": {
                "seconds": round(now.at - oldest.at, 2),
                "steps": now.steps - oldest.steps,
                "rows_per_step": _ratio(now.rows - oldest.rows, now.steps - oldest.steps, 2),
                "decode_steps": decode_steps,
                "batched_steps": now.batched_steps - oldest.batched_steps,
                "batched_fraction": _ratio(now.batched_steps - oldest.batched_steps, decode_steps),
                "lone_decode": {cause: n - o for cause, n, o in zip(LONE_CAUSES, now.lone, oldest.lone)},
            },
            "totals": {
                "steps": now.steps, "rows": now.rows, "decode_steps": now.decode_steps,
                "batched_steps": now.batched_steps,
                "batched_fraction": _ratio(now.batched_steps, now.decode_steps),
                "lone_decode": dict(zip(LONE_CAUSES, now.lone)), "generated_tokens": now.tokens,
            },
            "kv_blocks": {"total": blocks["total"], "used": blocks["used"], "free": blocks["free"],
                          "cached": view["prefix_cache"]["cached_free_blocks"],
                          "block_size": view["prefix_cache"]["block_size"]},
            "prefix_cache": {"hit_tokens": hit_tokens, "prompt_tokens": prompt_tokens,
                             "hit_fraction": _ratio(hit_tokens, prompt_tokens)},
        }


async def _snapshots(feed: Feed) -> AsyncIterator[str]:
    next_at = time.monotonic()
    while feed.server.lifecycle.phase == "ready":     # a draining server waits for open requests: end this one
        yield sse_data(await feed.snapshot())
        next_at = max(next_at + INTERVAL_S, time.monotonic())   # a slow snapshot delays, never bunches, the next
        await asyncio.sleep(next_at - time.monotonic())


@router.get("/v1/events", include_in_schema=False)     # an endless stream: nothing a client generator could test
async def events(request: Request):
    server = get_context(request)
    server.event_streams += 1

    def closed() -> None:
        server.event_streams -= 1

    return EventStreamResponse(_snapshots(Feed(server)), closed)
