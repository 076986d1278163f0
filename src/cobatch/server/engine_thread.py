"""The engine's own thread: the only code that touches the Engine while the server runs.

The HTTP side (an asyncio loop) talks to it through an inbox of commands (add, abort, call) and gets
each request's outputs on that request's asyncio queue, handed over once per engine step with
`loop.call_soon_threadsafe`. A step's outputs are handed over while the next step runs on the device
(Engine.step's on_launched), not before it is launched: the two threads share the GIL, and the HTTP side
waking up to format N streams' tokens would otherwise hold up the next step's host work while the GPU idles.

Slots: `num_slots` requests (= the engine's max_num_seqs, `--parallel`) are in the engine at once;
more wait in a queue here, up to `max_queue` (first come, first served; by each request's priority, then
arrival, where the engine schedules by priority); beyond that submit() refuses (the HTTP layer answers
429). A request goes to the free slot whose previous prompt shares the longest prefix with it, then
the least recently used one (the ds4 policy). The engine's prefix cache is global over KV blocks, so any
slot reuses any cached prefix; the affinity only keeps /slots readable (a conversation tends to come
back to the same slot).

Aborts (client gone, stop string seen) are taken from the inbox before every step: the request's KV
blocks and slot are free before the next step runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from cobatch.engine.engine import Engine, StepOutput
from cobatch.engine.sampler import SamplingParams
from cobatch.errors import UserError

log = logging.getLogger("cobatch.server")


class QueueFull(Exception):
    """Every slot is busy and the waiting queue is full."""


class ShuttingDown(Exception):
    """The server is stopping and takes no new requests."""


CALL_TIMEOUT_S = 60.0          # EngineWorker.run: an action on the engine thread (slot files, adapters)

@dataclass(slots=True)
class EngineFailure:
    """Delivered instead of a StepOutput when the engine could not run the request."""
    message: str
    user_error: bool = False      # the request itself was bad (400), not the server (500)


@dataclass(slots=True, eq=False)
class RequestHandle:
    """One request as both sides see it. The outputs queue belongs to the HTTP side's loop."""
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    submitted: float = field(default_factory=time.monotonic)
    slot: int | None = None
    finished: bool = False        # set on the HTTP side once the final output arrived


@dataclass(slots=True)
class Slot:
    id: int
    request: RequestHandle | None = None
    last_prompt: tuple[int, ...] = ()
    last_used: int = 0             # admission counter value when it last took a request
    requests_served: int = 0
    last_prompt_tokens: int = 0
    last_cached_tokens: int = 0
    last_generated_tokens: int = 0
    generated: int = 0
    cached_tokens: int = 0
    first_token_at: float = 0.0    # time.monotonic() of its request's first token (its decode rate starts there)
    tokens: list[int] = field(default_factory=list)   # its last request's prompt and output (what a save keeps)


def common_prefix_len(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the common prefix, by binary search over slice comparisons (done in C)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class EngineWorker:
    def __init__(self, engine: Engine, *, max_queue: int = 64, num_slots: int | None = None):
        self.engine = engine
        self.num_slots = min(num_slots or engine.scheduler.max_num_seqs, engine.scheduler.max_num_seqs)
        self.max_queue = max_queue
        self.slots = [Slot(i) for i in range(self.num_slots)]
        self.accepting = True
        self.steps = 0
        self.step_seconds = 0.0                              # wall time spent in engine.step
        self.tokens_generated = 0                            # every request's tokens, as the steps produce them
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._queued: deque[RequestHandle] = deque()        # engine thread only
        self._active: dict[str, RequestHandle] = {}          # engine thread only
        self._lock = threading.Lock()
        self._in_system = 0                                  # submitted and not yet finished
        self._admissions = itertools.count(1)
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._pending: list[tuple[RequestHandle, StepOutput]] = []   # the last step's outputs, not yet sent

    # --- HTTP side --------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="cobatch-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def queue_depth(self) -> int:
        return len(self._queued)

    @property
    def num_active(self) -> int:
        return len(self._active)

    def queued(self) -> list[RequestHandle]:
        """The requests waiting for a slot (a copy; exact on the engine thread)."""
        return list(self._queued)

    def adapters_in_use(self) -> tuple[list[str], list[str]]:
        """The LoRA adapters of the requests holding a slot, and of those waiting for one (sorted names). Read from
        any thread: each container is copied whole first (one C-level iteration under the GIL)."""
        running = {h.params.adapter for h in list(self._active.values())}
        waiting = {h.params.adapter for h in list(self._queued)}
        return sorted(running - {None}), sorted(waiting - {None})

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> RequestHandle:
        """Queue a request; call from the asyncio loop that will read its outputs."""
        if not self.accepting or not self.alive:
            raise ShuttingDown("the server is shutting down")
        with self._lock:
            if self._in_system >= self.num_slots + self.max_queue:
                raise QueueFull(f"all {self.num_slots} slots are busy and {self.max_queue} requests are queued")
            self._in_system += 1
        handle = RequestHandle(f"req-{next(self._ids)}", prompt_ids, params, asyncio.get_running_loop())
        self._inbox.put(("add", handle))
        return handle

    def abort(self, handle: RequestHandle) -> None:
        if not handle.finished:
            self._inbox.put(("abort", handle.id))

    async def run(self, fn: Callable[[], object], timeout: float = CALL_TIMEOUT_S) -> object:
        """Await fn run on the engine thread between two steps (from the HTTP side's loop)."""
        return await asyncio.wait_for(asyncio.wrap_future(self.call(fn)), timeout)

    def call(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run fn on the engine thread between two steps (a consistent view of the engine)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if not self.alive:
            future.set_result(fn())
            return future
        self._inbox.put(("call", fn, future))
        return future

    def stop(self, timeout: float = 10.0) -> None:
        """Abort whatever is left and end the thread."""
        self.accepting = False
        if self.alive:
            self._inbox.put(("stop",))
            self._thread.join(timeout)

    # --- engine thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            can_admit = bool(self._queued) and any(s.request is None for s in self.slots)
            idle = not (self.engine.has_work() or can_admit)
            if idle:
                self._flush()                 # no next step to overlap with
            self._take_commands(block=idle)
            if self._stopping:
                self._abort_all()
                while self.engine.has_work():
                    self._step()
                self._flush()
                self._spill_prefix_cache()
                return
            self._admit()
            if self.engine.has_work():
                self._step()

    def _spill_prefix_cache(self) -> None:
        """With a disk spill (--kv-disk-cache), write what is still cached in the pool, for the next process."""
        try:
            n = self.engine.blocks.spill_all()
        except Exception:                     # noqa: BLE001 - a cache; stopping must go on
            log.warning("could not write the prefix cache to disk\n%s", traceback.format_exc())
            return
        if n:
            log.info("prefix cache: %d blocks on disk for the next start", n)

    def _take_commands(self, block: bool) -> None:
        try:
            command = self._inbox.get() if block else self._inbox.get_nowait()
            while True:
                self._handle(command)
                command = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _handle(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            self._enqueue(command[1])
        elif kind == "abort":
            self._abort(command[1])
        elif kind == "call":
            _, fn, future = command
            if not future.set_running_or_notify_cancel():
                return                        # its caller gave up waiting (a timeout, a client gone)
            try:
                future.set_result(fn())
            except Exception as exc:          # noqa: BLE001 - handed to the caller
                future.set_exception(exc)
        elif kind == "stop":
            self._stopping = True

    def _enqueue(self, handle: RequestHandle) -> None:
        """At the back of the queue, or under the priority policy behind every request at least as urgent."""
        if not self.engine.scheduler.by_priority:
            self._queued.append(handle)
            return
        urgency = handle.params.priority
        at = next((i for i, h in enumerate(self._queued) if h.params.priority > urgency), len(self._queued))
        self._queued.insert(at, handle)

    def _abort(self, request_id: str) -> None:
        for handle in self._queued:
            if handle.id == request_id:
                self._queued.remove(handle)
                self._release(handle)
                self._send([(handle, StepOutput(request_id, None, True, "abort"))])
                return
        handle = self._active.get(request_id)
        if handle is not None:
            self.engine.abort(request_id)      # frees its KV blocks now
            self._release(handle)              # and its slot, before the next step admits anyone
            self._send([(handle, StepOutput(request_id, None, True, "abort"))])

    def _abort_all(self) -> None:
        for request_id in [h.id for h in self._queued] + list(self._active):
            self._abort(request_id)

    def _admit(self) -> None:
        while self._queued:
            free = [s for s in self.slots if s.request is None]
            if not free:
                return
            handle = self._queued.popleft()
            slot = self._pick_slot(free, handle.prompt_ids)
            try:
                self.engine.add_request(handle.prompt_ids, handle.params, request_id=handle.id)
            except Exception as exc:          # noqa: BLE001 - validated before submit; report, don't die
                self._release(handle)
                self._send([(handle, EngineFailure(str(exc), user_error=isinstance(exc, (UserError, ValueError))))])
                continue
            slot.request, slot.last_used = handle, next(self._admissions)
            slot.generated, slot.cached_tokens = 0, 0
            slot.last_prompt = tuple(handle.prompt_ids)
            slot.tokens = list(handle.prompt_ids)
            handle.slot = slot.id
            self._active[handle.id] = handle

    @staticmethod
    def _pick_slot(free: list[Slot], prompt_ids: list[int]) -> Slot:
        prompt = tuple(prompt_ids)
        return max(free, key=lambda s: (common_prefix_len(s.last_prompt, prompt), -s.last_used))

    def _step(self) -> None:
        started = time.monotonic()
        try:
            outputs = self.engine.step(on_launched=self._flush)
        except Exception:                     # noqa: BLE001 - fail the requests, keep serving
            log.error("engine step failed; failing %d requests\n%s", len(self._active), traceback.format_exc())
            failed = list(self._active.values())
            for handle in failed:
                self.engine.abort(handle.id)
                self._release(handle)
            self._send([(h, EngineFailure("internal error in the engine step")) for h in failed])
            return
        self.steps += 1
        self.step_seconds += time.monotonic() - started
        self._flush()                         # in case this step launched nothing
        deliveries = []
        for out in outputs:
            handle = self._active.get(out.request_id)
            if handle is None:
                continue
            slot = self.slots[handle.slot]
            if out.new_token is not None:
                if slot.generated == 0:
                    slot.first_token_at = time.monotonic()
                slot.generated += 1
                self.tokens_generated += 1
                slot.tokens.append(out.new_token)
                slot.cached_tokens = out.num_cached_tokens
            if out.finished:
                self._release(handle)
            deliveries.append((handle, out))
        self._pending = deliveries

    def _release(self, handle: RequestHandle) -> None:
        """The request leaves the system: free its slot and its place in the admission count."""
        if self._active.pop(handle.id, None) is not None and handle.slot is not None:
            slot = self.slots[handle.slot]
            slot.request = None
            slot.requests_served += 1
            slot.last_prompt_tokens, slot.last_cached_tokens = len(handle.prompt_ids), slot.cached_tokens
            slot.last_generated_tokens = slot.generated
        with self._lock:
            self._in_system -= 1

    def _flush(self) -> None:
        if self._pending:
            pending, self._pending = self._pending, []
            self._hand_over(pending)

    def _send(self, deliveries: list[tuple[RequestHandle, StepOutput | EngineFailure]]) -> None:
        self._flush()                         # a request's outputs arrive in order
        self._hand_over(deliveries)

    @staticmethod
    def _hand_over(deliveries: list[tuple[RequestHandle, StepOutput | EngineFailure]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for handle, item in deliveries:
            by_loop.setdefault(handle.loop, []).append((handle, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:              # that loop is closed: its clients are gone
                pass

    # --- views (run on the engine thread through call()) ----------------------------------------
    def slots_view(self) -> dict:
        engine = self.engine
        slots = []
        for slot in self.slots:
            view: dict = {"id": slot.id, "state": "idle", "requests_served": slot.requests_served,
                          "last_used": slot.last_used}
            handle = slot.request
            seq = engine.seqs.get(handle.id) if handle else None
            if handle is not None and seq is not None:
                view.update(
                    state="waiting" if seq.status.value == "waiting" else
                    ("decoding" if seq.num_output > 0 else "prefilling"),
                    request_id=handle.id,
                    prompt_tokens=seq.prompt_len,
                    cached_prefix_tokens=seq.num_cached_prompt,
                    computed_tokens=seq.num_computed,
                    generated_tokens=seq.num_output,
                    kv_blocks=len(seq.block_table),
                    running_for_s=round(time.monotonic() - handle.submitted, 3),
                )
                if slot.generated:
                    view["decoding_for_s"] = round(time.monotonic() - slot.first_token_at, 3)
            else:
                view.update(last_prompt_tokens=slot.last_prompt_tokens,
                            last_cached_prefix_tokens=slot.last_cached_tokens,
                            last_generated_tokens=slot.last_generated_tokens)
            slots.append(view)
        blocks = engine.blocks
        return {
            "slots": slots,
            "queued": len(self._queued),
            "max_queue": self.max_queue,
            "prefix_cache": {
                "scope": "global: every slot reuses any cached prefix (KV blocks are shared by hash)",
                "block_size": blocks.block_size,
                "cached_free_blocks": len(blocks.cached),
            },
            "kv_blocks": {"total": len(blocks.blocks), "used": blocks.num_used, "free": blocks.num_free},
            "max_context": engine.max_context,
        }


def _deliver(items: list[tuple[RequestHandle, StepOutput | EngineFailure]]) -> None:
    """On the HTTP loop: hand each output to its request."""
    for handle, item in items:
        handle.outputs.put_nowait(item)
        if isinstance(item, EngineFailure) or item.finished:
            handle.finished = True
