"""The engine on the CPU path with real weights: batching never changes a sequence's tokens."""

import pytest

from cobatch.engine.sampler import SamplingParams
from model_fixtures import load_llm

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived",
    "1, 2, 3, 4,",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def smol():
    return load_llm("smollm2")


def _ids(llm, text):
    return llm.encode_prompt(text)


def test_batched_greedy_equals_each_alone(smol):
    prompts = [_ids(smol, p) for p in PROMPTS]
    alone = [smol.engine.generate([p], GREEDY)[0] for p in prompts]
    together = smol.engine.generate(prompts, GREEDY)
    assert together == alone
    assert all(len(t) == GREEDY.max_tokens for t in alone)


def test_mirostat_state_moves_with_every_sampled_token(smol):
    """Mirostat's mu starts at 2 tau and after each token becomes mu - eta (surprise - tau), the surprise being
    the token's -log2 p in the truncated distribution it was drawn from (>= 0): so with tau 3 and eta 1 every
    step's mu is at most the one before plus 3, and a reproducible run keeps the same states."""
    def states(seed: int) -> list[float]:
        params = SamplingParams(temperature=1.0, mirostat=2, mirostat_tau=3.0, mirostat_eta=1.0, max_tokens=8,
                                seed=seed)
        rid = smol.engine.add_request(_ids(smol, "Once upon a time"), params)
        mus = []
        while smol.engine.has_work():
            smol.engine.step()
            if rid in smol.engine.seqs:
                mus.append(smol.engine.seqs[rid].mirostat_mu)
        return mus
    mus = states(1)
    assert len(mus) >= 5 and all(m is not None for m in mus)
    assert all(b <= a + 3.0 + 1e-4 for a, b in zip([6.0] + mus, mus))
    assert len(set(mus)) > 1 and states(1) == mus


def test_staggered_arrivals_and_chunked_prefill_match():
    llm = load_llm("smollm2", max_num_seqs=3, prefill_chunk=5)
    prompts = [_ids(llm, p) for p in PROMPTS]
    alone = [llm.engine.generate([p], GREEDY)[0] for p in prompts]
    eng = llm.engine
    out = {}
    rid = {eng.add_request(prompts[0], GREEDY): 0}
    steps = 0
    while eng.has_work() or len(rid) < len(prompts):
        if steps in (2, 4, 7) and len(rid) < len(prompts):     # late arrivals join running decodes
            rid[eng.add_request(prompts[len(rid)], GREEDY)] = len(rid)
        for o in eng.step():
            if o.new_token is not None:
                out.setdefault(rid[o.request_id], []).append(o.new_token)
        steps += 1
    assert [out[i] for i in range(len(prompts))] == alone
    assert eng.stats.batched_steps > 0


def _run_alone(eng, prompt: list[int], params: SamplingParams) -> tuple[list[int], int | None]:
    """(the tokens of one request run to its end, the prompt tokens it found in the prefix cache)."""
    rid = eng.add_request(prompt, params)
    toks, cached = [], None
    while eng.has_work():
        for o in eng.step():
            if o.request_id == rid and o.new_token is not None:
                toks.append(o.new_token)
                cached = o.num_cached_tokens
    return toks, cached


def test_prefix_cache_reuses_blocks_and_keeps_output(smol):
    eng = smol.engine
    prompt = _ids(smol, "You are a helpful assistant. " * 8 + "Tell me a joke.")
    first = eng.generate([prompt], GREEDY)[0]
    toks, cached = _run_alone(eng, prompt, GREEDY)
    assert toks == first
    bs = eng.pool.block_size
    assert cached == (len(prompt) - 1) // bs * bs and cached > 0


def test_cache_salt_shares_prefix_blocks_only_within_a_salt(smol):
    """vLLM's cache_salt: a request finds only blocks computed for requests of the same salt (the same output
    either way), and never the unsalted ones."""
    eng = smol.engine
    prompt = _ids(smol, "You are a careful translator. " * 8 + "Translate 'cheese' into French.")

    def run(salt):
        return _run_alone(eng, prompt, SamplingParams(temperature=0.0, max_tokens=4, cache_salt=salt))

    plain, cached = run(None)
    assert cached == 0 and run(None)[1] > 0                 # the unsalted request's blocks are found again
    assert run("tenant-a") == (plain, 0)                     # ... but not by a salted one
    again, cached = run("tenant-a")                          # which finds its own salt's blocks
    assert again == plain and cached > 0
    assert run("tenant-b")[1] == 0
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt="").validate()


def test_abort_frees_blocks(smol):
    eng = smol.engine
    free_before = eng.blocks.num_free
    rid = eng.add_request(_ids(smol, "Count to one hundred:"), SamplingParams(temperature=0.0, max_tokens=50))
    eng.step()
    eng.step()
    assert eng.blocks.num_free < free_before
    eng.abort(rid)
    outs = eng.step()
    assert any(o.request_id == rid and o.finish_reason == "abort" and o.finished for o in outs)
    assert not eng.has_work()
    assert eng.blocks.num_free == free_before


def test_preemption_under_kv_pressure_keeps_tokens():
    from cobatch.llm import LLM, EngineOptions
    from cobatch.model_files import smollm2_path
    base = load_llm("smollm2")
    prompts = [_ids(base, p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=20)
    # the same batch in a pool that holds it all (batched greedy is each alone: test_batched_greedy_equals_each_alone)
    preempted = base.engine.stats.preemptions
    alone = base.engine.generate(prompts, params)
    assert base.engine.stats.preemptions == preempted
    # A pool of 8 blocks x 16 tokens cannot hold four sequences of ~35 tokens at once.
    block_bytes = 2 * 30 * 16 * 3 * 64 * 4      # K and V, 30 layers, 16 tokens, 3 KV heads of 64 float32 values
    tight = LLM.load(smollm2_path(), EngineOptions(device="cpu", ctx=128, max_num_seqs=4,
                                                   kv_cache_gb=8.5 * block_bytes / 2**30, quiet=True))
    assert tight.engine.pool.num_blocks == 8
    assert tight.engine.generate(prompts, params) == alone
    assert tight.engine.stats.preemptions > 0

    # Prompt logprobs under the same pressure: each prompt token reported once, as when run alone.
    def prompt_logprobs(llm, batch, max_tokens=20):
        scoring = SamplingParams(temperature=0.0, max_tokens=max_tokens, prompt_logprobs=0)
        ids = {llm.engine.add_request(p, scoring): i for i, p in enumerate(batch)}
        got = {i: [] for i in ids.values()}
        while llm.engine.has_work():
            for out in llm.engine.step():
                got[ids[out.request_id]] += [(t, round(lp, 4)) for t, lp, _, _ in out.prompt_logprobs or ()]
        return [got[i] for i in range(len(batch))]
    before = tight.engine.stats.preemptions
    together = prompt_logprobs(tight, prompts)
    assert tight.engine.stats.preemptions > before
    # alone, the prompt's logprobs need no decoding after it (the batch decodes, for the pressure); the same
    # tokens, and logprobs to the CPU matmul's rounding (the batch's rows go through other matmul shapes than one
    # prompt's alone, and a BLAS may order a row's sums by the shape: 1e-4 apart on some CPUs)
    alone = [prompt_logprobs(base, [p], max_tokens=1)[0] for p in prompts]
    assert [[t for t, _ in lps] for lps in together] == [[t for t, _ in lps] for lps in alone]
    for got, want in zip(together, alone):
        assert max(abs(g - w) for (_, g), (_, w) in zip(got, want)) <= 2e-4, (got, want)
    assert [[t for t, _ in lps] for lps in together] == [p[1:] for p in prompts]


def test_context_limit_rejects_long_prompt(smol):
    from cobatch.engine.engine import ContextLengthExceeded
    with pytest.raises(ContextLengthExceeded):
        smol.engine.add_request(list(range(5000)), GREEDY)


@pytest.mark.parametrize("bad", [-1, 49152, 10**9])
def test_out_of_vocabulary_prompt_is_rejected(smol, bad):
    from cobatch.errors import UserError
    with pytest.raises(UserError, match="outside the vocabulary"):
        smol.engine.add_request([1, 2, bad], GREEDY)
    assert not smol.engine.has_work()


def test_min_tokens_and_stop_token_ids(smol):
    ids = smol.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    free = smol.engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=40))[0]
    assert free[-1] in smol.tokenizer.stop_ids and len(free) < 20          # a short answer, then end of turn
    longer = smol.engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=40, min_tokens=25))[0]
    assert len(longer) >= 25 and not set(longer[:25]) & smol.tokenizer.stop_ids
    assert longer[:len(free) - 1] == free[:-1]                              # the same answer, carried on
    cut = smol.engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=(free[2],)))[0]
    assert cut == free[:3]
