"""The engine thread hands a step's outputs to the HTTP side while the next step runs on the device, and
never holds them back otherwise: nothing is lost when the engine goes idle, and an abort arrives after
the tokens that came before it. Plus the serving benchmark's steady-window arithmetic."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

from cobatch.engine.engine import StepOutput
from cobatch.engine.sampler import SamplingParams
from cobatch.server.engine_thread import EngineWorker

ROOT = Path(__file__).resolve().parents[1]


class FakeEngine:
    """One token per running request per step; records when on_launched ran relative to the steps."""

    def __init__(self):
        self.scheduler = SimpleNamespace(max_num_seqs=4, by_priority=False)
        self.left: dict[str, int] = {}
        self.aborted: list[str] = []
        self.events: list[str] = []
        self.worker: EngineWorker | None = None
        self.abort_during_step: tuple[int, str] | None = None    # (step number, request id)
        self.steps = 0

    def add_request(self, prompt_ids, params, request_id=None):
        self.left[request_id] = params.max_tokens
        return request_id

    def abort(self, request_id):
        if self.left.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_work(self):
        return bool(self.left or self.aborted)

    def step(self, on_launched=None):
        outs = [StepOutput(r, None, True, "abort") for r in self.aborted]
        self.aborted.clear()
        if not self.left:
            return outs
        self.steps += 1
        if on_launched is not None:
            self.events.append(f"launched {self.steps}")
            on_launched()
        if self.abort_during_step and self.abort_during_step[0] == self.steps:
            self.worker._inbox.put(("abort", self.abort_during_step[1]))     # the client leaves mid-step
        for rid in list(self.left):
            self.left[rid] -= 1
            done = self.left[rid] == 0
            if done:
                del self.left[rid]
            outs.append(StepOutput(rid, 100 + self.steps, done, "length" if done else None))
        return outs


async def _collect(worker: EngineWorker, max_tokens: int) -> list[tuple]:
    handle = worker.submit([1, 2, 3], SamplingParams(max_tokens=max_tokens))
    got = []
    while True:
        out = await asyncio.wait_for(handle.outputs.get(), 10)
        got.append((out.new_token, out.finished, out.finish_reason))
        if out.finished:
            return got


def _run(engine: FakeEngine, max_tokens: int) -> list[tuple]:
    worker = EngineWorker(engine)
    engine.worker = worker
    worker.start()
    try:
        return asyncio.run(_collect(worker, max_tokens))
    finally:
        worker.stop()


def test_every_output_arrives_in_order_and_the_last_step_is_not_held_back():
    engine = FakeEngine()
    got = _run(engine, 3)
    assert got == [(101, False, None), (102, False, None), (103, True, "length")]
    # Step 1's token went out once step 2 was launched, and so on; step 3's when the engine went idle.
    assert engine.events == ["launched 1", "launched 2", "launched 3"]


def test_an_abort_arrives_after_the_token_held_for_the_next_launch():
    engine = FakeEngine()
    request_id = "req-0"                      # the worker's first id
    engine.abort_during_step = (2, request_id)
    got = _run(engine, 10)
    assert got == [(101, False, None), (102, False, None), (None, True, "abort")]


def test_a_reader_behind_by_several_steps_gets_their_tokens_in_one_chunk():
    """A stream whose outputs queued up while its reader was busy (the HTTP side behind the engine) sends them in
    one chunk, so a loaded server writes fewer frames; a reader that keeps up still gets a chunk a token."""
    from cobatch.loader.gguf import GGUFFile
    from cobatch.model_files import smollm2_path
    from cobatch.server.generation import Chunk, Finish, Generation, GenerationRequest
    from cobatch.server.metrics import ServerMetrics
    from cobatch.server.output_events import ContentDelta
    from cobatch.server.engine_thread import RequestHandle
    from cobatch.tokenizer import Tokenizer

    tok = Tokenizer.from_metadata(GGUFFile(smollm2_path()).metadata)
    ids = tok.encode("one two three four", add_special=False)
    assert len(ids) == 4
    params = SamplingParams(max_tokens=4)
    gen = Generation(SimpleNamespace(abort=lambda handle: None), ServerMetrics(SimpleNamespace()), tok,
                     GenerationRequest("completions", [1, 2], params))

    def output(i: int) -> StepOutput:
        return StepOutput("r", ids[i], i == 3, "length" if i == 3 else None)

    async def read() -> list:
        gen.handle = RequestHandle("r", [1, 2], params, asyncio.get_running_loop())
        stream, got = gen.events(), []
        gen.handle.outputs.put_nowait(output(0))
        got.append(await anext(stream))
        for i in (1, 2, 3):                      # three steps' outputs before the reader comes back
            gen.handle.outputs.put_nowait(output(i))
        got += [item async for item in stream]
        return got

    first, rest, finish = asyncio.run(read())
    assert isinstance(first, Chunk) and first.events == [ContentDelta("one")]
    assert isinstance(rest, Chunk) and rest.events == [ContentDelta(" two three four")]
    assert isinstance(finish, Finish) and finish.usage.completion_tokens == 4


def _bench_serve():
    spec = importlib.util.spec_from_file_location("bench_serve", ROOT / "bench" / "serve.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module          # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_steady_window_spans_all_streams_decoding():
    serve = _bench_serve()
    a = serve.Trace(token_times=[1.0, 2.0, 3.0, 4.0, 5.0])
    b = serve.Trace(token_times=[2.5, 3.5, 4.5, 5.5, 6.5])
    assert serve.steady_window([a, b]) == (2.5, 5.0)       # b's first token .. a's last token
    assert serve.tokens_between([a, b], 2.5, 5.0) == 3 + 2     # a: 3, 4, 5; b: 3.5, 4.5
    assert serve.steady_window([a, serve.Trace(token_times=[5.5, 6.0])]) is None     # no overlap
    assert serve.steady_window([a, serve.Trace()]) is None
