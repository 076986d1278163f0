"""Prompt-lookup speculative decoding (engine/speculative.py): the drafts, and the engine's output with it on
against the same engine without it (SmolLM2, CPU path)."""

from __future__ import annotations

import pytest

from cobatch.cli import build_parser
from cobatch.engine.sampler import SamplingParams
from cobatch.engine.drafts import DraftModelSpec, NgramSpec, Prediction, TokenIndex, propose
from cobatch.engine.speculative import parse_speculative_config, speculative_flags
from cobatch.errors import UserError
from cobatch.llm import LLM, EngineOptions
from cobatch.model_files import qwen_coder_path, smollm2_path
from cobatch.testing.gguf_writer import cut_layers
from model_fixtures import load_llm

# Text the model goes on repeating: its continuation is in its own prompt, so drafts get accepted.
REPEAT = "apple banana cherry dates elderberry fig grape. " * 3 + "apple banana"
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def drafts(tokens, k=4, max_n=3, min_n=1, limit=99):
    return propose(tokens, TokenIndex(), NgramSpec(k, max_n, min_n), limit)


def test_propose_follows_the_latest_earlier_occurrence_of_the_longest_suffix():
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 5, 6, 7, 1, 5, 6]
    # suffix (5, 6) last occurred at 5..6 (then 7, 1, 5, 6); the 3-gram (1, 5, 6) never did before
    assert drafts(tokens) == [7, 1, 5, 6]
    assert drafts(tokens, k=2) == [7, 1]
    assert drafts(tokens, limit=1) == [7]
    assert drafts(tokens, limit=0) == []
    assert drafts([1, 2, 3, 4]) == []                       # no suffix occurs earlier
    assert drafts([3, 1, 2, 3], max_n=1) == [1, 2, 3]       # a 1-gram: the token 3 at 0
    assert drafts([3, 1, 2, 3], min_n=2) == []              # ... not looked up below 2
    assert drafts([7, 7]) == [7]                            # an occurrence right before the last token


def test_propose_ignores_matches_that_straddle_tokens():
    """The lookup is a byte search over 4-byte tokens: a byte match across two tokens is not an occurrence."""
    a, b = 0x01020304, 0x05060708
    straddle = (b & 0xFFFF) << 16 | (a >> 16)               # bytes that appear across a | b, little-endian
    tokens = [a, b, 99, straddle]
    assert drafts(tokens, max_n=1) == []
    assert drafts(tokens + [99, straddle], max_n=2) == [99, straddle]   # a real (99, straddle) at 2..3


def test_the_index_grows_with_the_tokens():
    index, spec = TokenIndex(), NgramSpec(3, 2, 1)
    tokens = [1, 2, 3]
    assert propose(tokens, index, spec, 9) == []
    tokens += [1, 2]
    assert propose(tokens, index, spec, 9) == [3, 1, 2]


@pytest.mark.parametrize("config, message", [
    ({"method": "eagle", "num_speculative_tokens": 3}, "not supported"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": "3"}, "integers"),
    ({"method": "ngram", "num_speculative_tokens": 3, "model": "x"}, "unknown"),
    ({"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 0}, "disable_by_batch_size"),
])
def test_bad_speculative_config_is_a_clear_error(config, message):
    with pytest.raises(ValueError, match=message):
        NgramSpec.from_config(config)


@pytest.mark.parametrize("raw, message", [
    ('{"model": "d.gguf"}', "num_speculative_tokens"),
    ('{"model": 5, "num_speculative_tokens": 2}', "model \\(a path\\)"),
    ('{"method": "draft_model", "model": "d.gguf", "num_speculative_tokens": 16}', "num_speculative_tokens"),
    ('{"method": "ngram", "model": "d.gguf", "num_speculative_tokens": 2}', "unknown"),
    ('{"model": "d.gguf", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}', "unknown"),
])
def test_bad_draft_model_config_is_a_clear_error(raw, message):
    with pytest.raises(UserError, match=message):
        parse_speculative_config(raw)


def test_draft_model_flags_of_vllm_and_llama_cpp():
    assert parse_speculative_config('{"model": "d.gguf", "num_speculative_tokens": 3}') == DraftModelSpec("d.gguf", 3)
    parser = build_parser()
    assert speculative_flags(parser.parse_args(["serve", "-md", "d.gguf", "--draft-max", "6"])) == \
        DraftModelSpec("d.gguf", 6)
    both = parser.parse_args(["serve", "-md", "d.gguf", "--speculative-config", '{"num_speculative_tokens": 2}'])
    with pytest.raises(UserError, match="not both"):
        speculative_flags(both)


def test_speculative_config_takes_vllms_ngram_keys():
    config = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 1,
              "disable_by_batch_size": 8}
    assert NgramSpec.from_config(config) == NgramSpec(5, 4, 1, 8)
    assert NgramSpec.from_config({"method": "[ngram]", "num_speculative_tokens": 2}) == NgramSpec(2, 3, 2, None)


_plain_outputs: dict[tuple, list[int]] = {}


def plain_output(prompt: list[int], params: SamplingParams) -> list[int]:
    """What the engine without speculation generates for one prompt alone, computed once per module: the same
    prompt and parameters come back in several tests (greedy decoding is deterministic)."""
    key = (tuple(prompt), repr(params))
    if key not in _plain_outputs:
        _plain_outputs[key] = load_llm("smollm2").engine.generate([prompt], params)[0]
    return list(_plain_outputs[key])


@pytest.fixture(scope="module")
def spec_llm():
    return LLM.load(smollm2_path(), EngineOptions(device="cpu", ctx=1024, quiet=True,
                                                  speculative=NgramSpec(4, 3, 1)))


def test_greedy_output_is_the_same_with_fewer_steps(spec_llm):
    plain = load_llm("smollm2")
    prompt = plain.encode_prompt(REPEAT)
    want = plain_output(prompt, GREEDY)
    eng = spec_llm.engine
    drafted, accepted = eng.stats.draft_tokens, eng.stats.accepted_tokens
    rid = eng.add_request(prompt, GREEDY)
    got, steps = [], 0
    while eng.has_work():
        steps += 1
        got += [o.new_token for o in eng.step() if o.request_id == rid and o.new_token is not None]
    assert got == want and len(got) == GREEDY.max_tokens
    kept = eng.stats.accepted_tokens - accepted
    assert eng.stats.draft_tokens - drafted >= kept > 10          # the repetition was drafted and kept
    assert steps <= 1 + GREEDY.max_tokens - kept                   # each kept draft saved a step


def test_mixed_batch_equals_plain_decoding(spec_llm):
    """Sequences that speculate next to ones that may not (penalties, a grammar-free sampled one with a seed),
    prompts in prefill beside them: every output is what the engine without speculation gives."""
    plain = load_llm("smollm2")
    prompts = [plain.encode_prompt(REPEAT), plain.encode_prompt("1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5,"),
               plain.encode_prompt(REPEAT), plain.encode_prompt("The capital of France is")]
    params = [GREEDY, SamplingParams(temperature=0.0, max_tokens=24),
              SamplingParams(temperature=0.0, max_tokens=30, repetition_penalty=1.3),
              SamplingParams(temperature=0.0, max_tokens=7)]
    want = plain.engine.generate(prompts, params)
    assert spec_llm.engine.generate(prompts, params) == want
    assert [len(w) for w in want][0] == GREEDY.max_tokens


def test_max_tokens_and_end_of_turn_cut_the_kept_drafts(spec_llm):
    plain = load_llm("smollm2")
    prompt = plain.encode_prompt(REPEAT)
    for n in (1, 2, 5, 9):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        assert spec_llm.engine.generate([prompt], params)[0] == plain.engine.generate([prompt], params)[0]
    # stop_token_ids: a token the repetition reaches ends the request there, drafts after it discarded
    full = plain_output(prompt, GREEDY)
    stop = full[6]
    params = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=(stop,))
    out = spec_llm.engine.generate([prompt], params)[0]
    assert out == full[:full.index(stop) + 1]


def test_the_prefix_cache_holds_only_kept_tokens(spec_llm):
    """After a speculating request, its prompt + output as a new prompt reuses the cached blocks, and what
    follows is what plain decoding gives for that prompt: rejected drafts left nothing in the cache."""
    plain = load_llm("smollm2")
    prompt = plain.encode_prompt(REPEAT)
    first = spec_llm.engine.generate([prompt], GREEDY)[0]
    longer = prompt + first
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    eng = spec_llm.engine
    rid = eng.add_request(longer, params)
    got, cached = [], 0
    while eng.has_work():
        for o in eng.step():
            if o.request_id == rid and o.new_token is not None:
                got.append(o.new_token)
                cached = max(cached, o.num_cached_tokens)
    assert cached >= 16 * ((len(prompt) + len(first)) // 16 - 1)
    assert got == plain.engine.generate([longer], params)[0]


def test_served_with_speculation_streams_the_same_text(spec_llm):
    """Through the HTTP server: a step that keeps several tokens of a request delivers each of them, streamed
    or not, and the text is plain decoding's; the metrics count the drafts."""
    import httpx
    import openai

    from test_server_support import live_server
    plain = load_llm("smollm2")
    want = plain.tokenizer.decode(plain_output(plain.encode_prompt(REPEAT), GREEDY))
    with live_server(spec_llm) as server:
        oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        body = dict(model="any", prompt=REPEAT, max_tokens=GREEDY.max_tokens, temperature=0,
                    extra_body={"ignore_eos": True})
        whole = oai.completions.create(**body).choices[0]
        chunks = [c.choices[0].text for c in oai.completions.create(stream=True, **body)]
        assert whole.text == "".join(chunks) == want and whole.finish_reason == "length"
        metrics = httpx.get(server.url + "/metrics").text
        accepted = [float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("cobatch_spec_accepted_tokens_total")]
        assert accepted and accepted[0] > 10


def test_seeded_sampling_draws_what_plain_decoding_draws(spec_llm):
    """Temperature sampling: row j of a speculating step draws with the (seed, step) noise plain decoding uses
    for that token, so a seeded request gives the same tokens either way."""
    plain = load_llm("smollm2")
    prompt = plain.encode_prompt(REPEAT)
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=11, max_tokens=40, ignore_eos=True)
    kept = spec_llm.engine.stats.accepted_tokens
    assert spec_llm.engine.generate([prompt], params)[0] == plain.engine.generate([prompt], params)[0]
    assert spec_llm.engine.stats.accepted_tokens > kept            # drafts were kept along the way


@pytest.mark.parametrize("shift", [0, 1])
def test_right_or_wrong_drafts_leave_the_output_as_plain(spec_llm, shift):
    """Drafts that are plain decoding's next tokens are all kept (shift 0); drafts that are all wrong (shift 1)
    are all rejected. Either way, the text is plain decoding's."""
    plain = load_llm("smollm2")
    prompt = plain.encode_prompt("The capital of France is")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = plain_output(prompt, params)
    eng, vocab = spec_llm.engine, spec_llm.config.vocab_size

    def draft(seq, budget):
        upcoming = want[seq.num_output:seq.num_output + min(4, budget, params.max_tokens - seq.num_output - 1)]
        return [(t + shift) % vocab for t in upcoming]

    drafted, kept = eng.stats.draft_tokens, eng.stats.accepted_tokens
    own, eng.scheduler.draft = eng.scheduler.draft, draft
    try:
        got = eng.generate([prompt], params)[0]
    finally:
        eng.scheduler.draft = own
    drafted, kept = eng.stats.draft_tokens - drafted, eng.stats.accepted_tokens - kept
    assert got == want
    assert drafted >= 12 and kept == (drafted if shift == 0 else 0)


def test_a_sequence_whose_drafts_fail_pauses_drafting():
    """Mostly rejected drafts: drafting pauses, except a probe every PROBE_EVERY tokens; kept drafts resume it."""
    from cobatch.engine.drafts import PROBE_EVERY, DraftRecord
    record = DraftRecord()
    assert record.worth_drafting(1)
    for _ in range(3):
        record.add(4, 0)
    assert not record.worth_drafting(1) and record.worth_drafting(PROBE_EVERY)
    for _ in range(4):
        record.add(4, 4)
    assert record.worth_drafting(1)


@pytest.mark.parametrize("decoders, rows, each, max_running", [(1, 16, 15, None), (4, 16, 3, None), (5, 16, 2, None),
                                                               (16, 16, 0, None), (8, None, 255, None),
                                                               (4, 16, 3, 4), (5, 16, 0, 4)])
def test_drafts_share_the_step_rows_equally(decoders, rows, each, max_running):
    """A step with drafts holds at most draft_rows rows (CUDA: the GEMV's flat range), shared equally among the
    decoders; without a cap, the token budget bounds the drafts. vLLM's disable_by_batch_size (max_running):
    no drafts while more sequences run."""
    from cobatch.engine.kv_cache import BlockManager
    from cobatch.engine.scheduler import Scheduler
    from cobatch.engine.sequence import Sequence

    sched = Scheduler(BlockManager(num_blocks=256, block_size=16), max_num_seqs=32, max_step_tokens=2048,
                      prefill_chunk=512, draft=lambda seq, limit: [7] * min(limit, 255), draft_rows=rows,
                      draft_max_running=max_running)
    seqs = [Sequence(f"r{i}", prompt_len=3, params=SamplingParams(max_tokens=500), seed=0, token_ids=[1, 2, 3])
            for i in range(decoders)]
    for seq in seqs:
        sched.add(seq)
    assert all(n == 3 and not seq.draft for seq, n in sched.plan().items)    # the prompts
    for seq in seqs:                    # what the engine does once a prompt's last row sampled a token
        seq.num_computed = 3
        seq.token_ids.append(4)
    plan = sched.plan()
    assert [len(seq.draft) for seq, _ in plan.items] == [each] * decoders
    assert all(n == 1 + len(seq.draft) for seq, n in plan.items)
    assert sum(n for _, n in plan.items) <= (rows or 2048)


def test_drafts_under_kv_pressure_leave_every_output_as_plain():
    """Speculating sequences in a pool too small for all of them: drafts take blocks, sequences get preempted
    and recomputed, and every output is still plain decoding's."""
    plain = load_llm("smollm2")
    prompts = [plain.encode_prompt(REPEAT + " cherry" * i) for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    # plain decoding of the same batch in a pool that holds it all (batched greedy is each alone: test_engine)
    preempted = plain.engine.stats.preemptions
    alone = plain.engine.generate(prompts, params)
    assert plain.engine.stats.preemptions == preempted
    # 8 blocks x 16 tokens; four sequences of ~75 tokens need 20.
    block_bytes = 2 * 30 * 16 * 3 * 64 * 4
    tight = LLM.load(smollm2_path(), EngineOptions(device="cpu", ctx=128, max_num_seqs=4, quiet=True,
                                                   kv_cache_gb=8.5 * block_bytes / 2**30,
                                                   speculative=NgramSpec(4, 3, 1)))
    assert tight.engine.pool.num_blocks == 8
    assert tight.engine.generate(prompts, params) == alone
    assert tight.engine.stats.preemptions > 0 and tight.engine.stats.accepted_tokens > 10
    assert tight.engine.blocks.num_free == 8 and not tight.engine.has_work()     # every block given back


# --- predicted outputs (OpenAI's `prediction`) ----------------------------------------------------------------

def test_prediction_drafts_its_next_tokens_while_the_output_follows_it():
    spec = NgramSpec(3, 3, 1)
    pred = Prediction([10, 11, 12, 13, 14, 15])
    prompt = [1, 2]
    assert pred.propose(prompt, 2, spec, 9) == [10, 11, 12]               # nothing out yet: its start
    assert pred.propose(prompt + [10, 11], 2, spec, 9) == [12, 13, 14]
    assert pred.propose(prompt + [10, 11], 2, spec, 1) == [12]            # the step's room
    assert pred.propose(prompt + [10, 11, 12, 13, 14, 15], 2, spec, 9) == []   # all of it out


def test_prediction_finds_its_place_again_after_an_edit():
    """The output departs from the prediction (an edit), then goes on with text the prediction holds further
    on: drafts follow the output's last tokens there, and the search moves forward through the prediction."""
    spec = NgramSpec(2, 2, 1)
    #                   0   1   2   3   4   5   6   7   8
    pred = Prediction([10, 11, 12, 13, 14, 10, 11, 15, 16])
    out = [10, 11, 99]                         # 99: an edit; no n-gram of ..., 11, 99 in the prediction
    assert pred.propose([1] + out, 1, spec, 9) == []
    out += [13]                                # back in: 13 occurs once, at 3
    assert pred.propose([1] + out, 1, spec, 9) == [14, 10]
    out += [14, 10, 11]                        # (10, 11) at 0 and at 5: the one after the last drafts' place
    assert pred.propose([1] + out, 1, spec, 9) == [15, 16]


def test_prediction_ignores_byte_matches_that_straddle_tokens():
    a, b = 0x01020304, 0x05060708
    straddle = (b & 0xFFFF) << 16 | (a >> 16)
    pred = Prediction([a, b, 7])
    assert pred.propose([0, 5, straddle], 1, NgramSpec(2, 1, 1), 9) == []


def test_a_prediction_speeds_up_plain_decoding_without_changing_it():
    """A request with a prediction drafts from it though the engine does not speculate otherwise: with plain
    decoding's own output as the prediction, the output is the same in far fewer steps and every draft is kept;
    with that output edited in its middle, the output is still plain decoding's, and the drafts after the edit
    are found again (OpenAI's accepted / rejected prediction tokens)."""
    llm = load_llm("smollm2")
    prompt = llm.encode_chat([{"role": "user", "content": "Write a haiku about the sea."}])
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    want = llm.engine.generate([prompt], params)[0]
    edited = want[:10] + [llm.config.vocab_size - 1 - t for t in want[10:13]] + want[13:]
    for prediction, all_kept in ((want, True), (edited, False)):
        eng = llm.engine
        rid = eng.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True,
                                                     prediction=tuple(prediction)))
        got, steps, last = [], 0, None
        while eng.has_work():
            steps += 1
            for o in eng.step():
                if o.request_id == rid and o.new_token is not None:
                    got.append(o.new_token)
                    last = o
        assert got == want
        accepted, rejected = last.prediction_accepted, last.prediction_rejected
        assert accepted > 15 and steps <= 1 + len(want) - accepted       # each kept draft saved a step
        assert (rejected == 0) if all_kept else (rejected > 0)


def test_decode_graphs_hold_a_step_with_prediction_drafts():
    """Any request may bring a prediction, so on CUDA the decode graphs hold a step of drafts (8 rows) even with
    one slot and no --speculative-config: such steps replay a graph rather than running eagerly."""
    import torch

    from cobatch.llm import _graph_rows
    cuda = torch.device("cuda")
    assert _graph_rows(EngineOptions(max_num_seqs=1), None, cuda) == 8
    assert _graph_rows(EngineOptions(max_num_seqs=32), None, cuda) == 32
    assert _graph_rows(EngineOptions(max_num_seqs=1, max_step_tokens=4), None, cuda) == 4
    assert _graph_rows(EngineOptions(max_num_seqs=1), 2, cuda) == 2            # the model's own limit (MoE)


# --- a draft model (engine/draft_model.py) ---------------------------------------------------------------

@pytest.fixture(scope="module")
def cut_draft(tmp_path_factory):
    """SmolLM2 cut to its first 6 of 30 layers: a draft of the same vocabulary, nearly always wrong."""
    return cut_layers(smollm2_path(), tmp_path_factory.mktemp("draft") / "smollm2-6l.gguf", 6)


def test_draft_model_output_is_plain_decodings(cut_draft):
    """A mixed batch (greedy, penalties, seeded sampling, prefill beside decoders) through a cut draft model whose
    drafts are rejected: every output is what the engine without speculation gives."""
    plain = load_llm("smollm2")
    llm = LLM.load(smollm2_path(), EngineOptions(device="cpu", ctx=512, quiet=True,
                                                 speculative=DraftModelSpec(str(cut_draft), 3)))
    prompts = [plain.encode_prompt(REPEAT), plain.encode_chat([{"role": "user", "content": "Name three colors."}]),
               plain.encode_prompt("The capital of France is"), plain.encode_prompt("1, 2, 3, 4, 5,")]
    params = [GREEDY, SamplingParams(temperature=0.0, max_tokens=20),
              SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.3),
              SamplingParams(temperature=0.8, seed=5, max_tokens=16)]
    assert llm.engine.generate(prompts, params) == plain.engine.generate(prompts, params)
    assert llm.engine.stats.draft_tokens > 0
    assert llm.engine.drafter.cached == {}                   # every sequence's draft blocks went back


def test_a_draft_model_equal_to_the_target_has_its_drafts_kept():
    """The target as its own draft: its greedy drafts are what the target samples, so (up to float rounding of a
    causal query against one row at a time) they are kept: the draft cache follows the kept and the replaced
    tokens right."""
    path = smollm2_path()
    llm = LLM.load(path, EngineOptions(device="cpu", ctx=512, quiet=True, speculative=DraftModelSpec(str(path), 4)))
    prompts = [llm.encode_chat([{"role": "user", "content": q}]) for q in ("What is the capital of France?",
                                                                           "Write a haiku about the sea.")]
    assert llm.engine.generate(prompts, GREEDY) == [plain_output(p, GREEDY) for p in prompts]
    stats = llm.engine.stats
    assert stats.draft_tokens > 40 and stats.accepted_tokens >= 0.9 * stats.draft_tokens


def test_a_draft_model_of_another_vocabulary_is_refused():
    with pytest.raises(UserError, match="must share the tokenizer"):
        LLM.load(smollm2_path(), EngineOptions(device="cpu", ctx=256, quiet=True,
                                               speculative=DraftModelSpec(str(qwen_coder_path()), 2)))
