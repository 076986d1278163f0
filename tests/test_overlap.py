"""Overlapped steps (engine.py): decode step n + 1 planned and launched before step n's tokens reach the host.
On by default on CUDA only; these tests turn it on for the CPU path, where the same code runs synchronously.

The same requests, stepped with and without overlap on the same engine, must give the same tokens and finish
reasons, and logprobs within float32 noise, whatever ends them (stop token, max_tokens, abort) and whichever rows
cannot be planned ahead (DRY, late arrivals); and every block must be free at the end. (Logprobs only within
noise: a session that a stop token ends still computes one row in the step in flight, and the CPU path's matmuls
are not batch-invariant in their last bits.)
"""

from __future__ import annotations

import pytest

from cobatch.engine.sampler import SamplingParams
from model_fixtures import load_llm


@pytest.fixture(scope="module")
def smol():
    return load_llm("smollm2")


def _ids(llm, text):
    return llm.encode_prompt(text)


def _run(llm, requests, overlap: bool, arrivals=None, abort_at=None):
    """Step the engine over `requests` [(prompt ids, params)]; arrivals {step: request index} join later;
    abort_at {step: request index}. Returns ({index: [(token, logprob, finish_reason)]}, steps planned ahead,
    decode steps counted by the scheduler's statistics)."""
    eng = llm.engine
    own, eng.overlap = eng.overlap, overlap
    arrivals = arrivals or {}
    abort_at = abort_at or {}
    launch, ahead = eng.runner.launch, []

    def counting(plan):
        ahead.append(plan.follows is not None)
        return launch(plan)

    eng.runner.launch = counting
    free_before, decode_steps = eng.blocks.num_free, eng.stats.decode_steps
    ids = {}
    try:
        for i, (prompt, params) in enumerate(requests):
            if i not in arrivals.values():
                ids[eng.add_request(prompt, params)] = i
        got = {i: [] for i in range(len(requests))}
        step = 0
        while eng.has_work() or len(ids) < len(requests):
            for i in [i for s, i in arrivals.items() if s == step]:
                ids[eng.add_request(*requests[i])] = i
            for s, i in abort_at.items():
                if s == step:
                    eng.abort(next(r for r, j in ids.items() if j == i))
            for out in eng.step():
                got[ids[out.request_id]].append((out.new_token, out.logprob, out.finish_reason))
            step += 1
            assert step < 500
    finally:
        eng.runner.launch = launch
        eng.overlap = own
    assert eng.blocks.num_free == free_before          # nothing leaked, in flight or not
    assert not eng.has_work()
    return got, sum(ahead), eng.stats.decode_steps - decode_steps


def _assert_same(got, want):
    assert {i: [(t, r) for t, _, r in outs] for i, outs in got.items()} == \
        {i: [(t, r) for t, _, r in outs] for i, outs in want.items()}
    for i in want:
        for (_, a, _), (_, b, _) in zip(got[i], want[i]):
            assert (a is None) == (b is None) and (a is None or abs(a - b) < 1e-3)


def test_overlap_gives_the_same_tokens(smol):
    """Greedy, seeded sampling with logprobs, min_tokens, a stop token met early, max_tokens: the same outputs,
    and most decode steps were planned ahead."""
    chat = smol.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    requests = [
        (_ids(smol, "The capital of France is"), SamplingParams(temperature=0.0, max_tokens=24)),
        (_ids(smol, "Once upon a time,"), SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=30,
                                                         logprobs=2)),
        (chat, SamplingParams(temperature=0.0, max_tokens=40)),                         # ends on end of turn
        (chat, SamplingParams(temperature=0.0, max_tokens=40, min_tokens=25)),
        (_ids(smol, "1, 2, 3, 4,"), SamplingParams(temperature=0.7, seed=3, max_tokens=5)),
    ]
    assert not smol.engine.overlap                  # off by default on the CPU
    want, sync_ahead, sync_steps = _run(smol, requests, overlap=False)
    got, ahead, steps = _run(smol, requests, overlap=True)
    _assert_same(got, want)
    assert sync_ahead == 0
    # The same decode steps counted (the /metrics counter), plus at most the one that a stop token made moot.
    assert sync_steps <= steps <= sync_steps + 1
    assert want[2][-1][2] == "stop" and len(want[2]) < 40      # a stop token really ended one mid-run
    assert ahead >= 20                                         # the overlap engaged on most decode steps


def test_overlap_with_arrivals_aborts_and_penalties(smol):
    """Rows that cannot be planned ahead (DRY reads the tokens on the host) and late arrivals make the engine fall
    back to plain steps and back; an abort lands while a step is in flight."""
    requests = [
        (_ids(smol, "def fibonacci(n):"), SamplingParams(temperature=0.0, max_tokens=30)),
        (_ids(smol, "Count to twenty: 1, 2,"), SamplingParams(temperature=0.0, max_tokens=30)),
        (_ids(smol, "The weather today"),
         SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.3, dry_multiplier=0.8)),
        (_ids(smol, "A list of fruits:"), SamplingParams(temperature=0.8, seed=11, max_tokens=16)),
    ]
    arrivals, abort_at = {5: 2, 20: 3}, {9: 1}
    want, _, _ = _run(smol, requests, overlap=False, arrivals=arrivals, abort_at=abort_at)
    got, ahead, _ = _run(smol, requests, overlap=True, arrivals=arrivals, abort_at=abort_at)
    _assert_same(got, want)
    assert want[1][-1] == (None, None, "abort") and len(want[1]) < 30
    assert ahead > 0


def test_steps_planned_ahead_read_the_device_tokens(smol):
    """A planned-ahead step's input is the token the step before it sampled on the device: with the host's
    copy of that token withheld (a wrong placeholder in the host's lists), the output is unchanged."""
    eng = smol.engine
    prompt = _ids(smol, "The capital of France is")
    params = SamplingParams(temperature=0.0, max_tokens=10)
    own, eng.overlap = eng.overlap, False
    want = eng.generate([prompt], params)[0]
    eng.overlap = True
    seen = []
    inputs = eng.runner._inputs

    def checking(plan):
        token_ids, positions, meta, rows = inputs(plan)
        if plan.follows is not None:
            # the host has not appended the token yet: its state is one token behind the rows' positions
            seq = plan.items[0][0]
            assert positions.tolist() == [len(seq.token_ids)]
            seen.append(int(token_ids[0]))
        return token_ids, positions, meta, rows

    eng.runner._inputs = checking
    try:
        got = eng.generate([prompt], params)[0]
    finally:
        eng.runner._inputs, eng.overlap = inputs, own
    assert got == want
    assert seen and seen == want[:len(seen)]
