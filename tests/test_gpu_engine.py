"""The GPU path (Triton kernels, CUDA graphs) against the CPU path on the same weights. Needs CUDA.

Run on the device with a real model cut to its first layers:
    COBATCH_CUT_MODEL=.models/smollm2-6l.gguf python -m pytest -q tests/test_gpu_engine.py
"""

import os
from pathlib import Path

import pytest
import torch

from cobatch.engine.sampler import SamplingParams
from cobatch.kernels import matmul_plans
from cobatch.llm import LLM, EngineOptions
from model_checks import assert_same_or_tie, step_hidden

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device)")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village by the sea,",
           "1, 2, 3, 4,", "Hello! How are", "The quick brown fox"]
STEPS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)


def _cut_model() -> Path:
    path = os.environ.get("COBATCH_CUT_MODEL")
    if path:
        return Path(path)
    from cobatch.testing.gguf_writer import cut_layers
    from cobatch.model_files import smollm2_path
    out = Path(os.environ.get("TMPDIR", "/tmp")) / "smollm2-6l.gguf"
    return out if out.exists() else cut_layers(smollm2_path(), out, 6)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from cobatch.testing.gguf_writer import write_random_model
    tiny = write_random_model(tmp_path_factory.mktemp("m") / "tiny-q8_0.gguf", "tiny", "q8_0",
                              tokenizer_from=_cut_model(), seed=3)
    out = {}
    for name, path in (("tiny", tiny), ("cut", _cut_model())):
        cpu = LLM.load(path, EngineOptions(device="cpu", ctx=256, max_num_seqs=8, quiet=True))
        # A small KV pool each: by default a load takes 85 % of the free memory, and this file loads several.
        gpu = LLM.load(path, EngineOptions(device="cuda", dtype="f16", ctx=256, max_num_seqs=40, quiet=True,
                                           kv_cache_gb=1))
        out[name] = (cpu, gpu)
    return out


# f16 GPU logits differ from f32 CPU logits by ~2e-3 relative (see the teacher-forced test). Two greedy
# runs may therefore part ways only where the reference's top two candidates are that close: a tie.
TIE_TOL = {"tiny": 0.01, "cut": 0.2}


@pytest.mark.parametrize("name", ["tiny", "cut"])
def test_gpu_greedy_matches_cpu_for_32_steps(models, name):
    from model_checks import prompt_logits
    cpu, gpu = models[name]
    prompts = [cpu.encode_prompt(p) for p in PROMPTS[:4]]
    want = [cpu.engine.generate([p], GREEDY)[0] for p in prompts]
    got = [gpu.engine.generate([p], GREEDY)[0] for p in prompts]
    ties = [assert_same_or_tie(lambda ids: prompt_logits(cpu.model, cpu.config, ids), p, w, g, TIE_TOL[name])
            for p, w, g in zip(prompts, want, got)]
    print(f"{name}: prompts identical for 32 steps: {sum(t is None for t in ties)}/{len(ties)}; ties (step, margin): "
          f"{[t for t in ties if t]}")
    assert sum(t is None for t in ties) >= len(ties) // 2


@pytest.mark.parametrize("name", ["tiny", "cut"])
def test_gpu_logits_close_to_cpu_teacher_forced(models, name):
    """Both paths read the same 40-token sequence in one prefill: f16 logits within 2 % of f32 ones, and
    the same top-1 wherever the CPU's top-2 margin exceeds 5x the observed error."""
    from model_checks import prompt_logits
    cpu, gpu = models[name]
    ids = cpu.encode_prompt(PROMPTS[2]) + cpu.engine.generate([cpu.encode_prompt(PROMPTS[2])], GREEDY)[0][:24]
    want = prompt_logits(cpu.model, cpu.config, ids)
    got = _gpu_logits(gpu, ids)
    rel = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
    err = (got - want).abs().max().item()
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 5 * err
    print(f"{name}: max rel err {rel:.2e}, max abs err {err:.2e}, clear-margin rows {int(clear.sum())}/{len(ids)}")
    assert rel < 2e-2
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


@pytest.mark.parametrize("name", ["tiny", "cut"])
def test_norms_writing_the_gemms_column_order_give_the_same_logits(models, name, monkeypatch):
    """With ORDERED_OPERANDS the RMSNorms before qkv and gate|up, with ORDERED_ACT gate|up's act epilogue before down
    and with attention's ORDERED_OUTPUT the prefill kernel before o, store their rows in the column order the ring
    GEMM streams, and the GEMM launches no x_operands: the same values in the same places, so the same logits to
    the bit on a 40-token prefill (the GEMM's range)."""
    from cobatch import ops
    from cobatch.kernels import attention, operand_order, packed_weight
    cpu, gpu = models[name]
    ids = cpu.encode_prompt(PROMPTS[2]) + cpu.engine.generate([cpu.encode_prompt(PROMPTS[2])], GREEDY)[0][:24]
    layer = gpu.model.layers[0]
    monkeypatch.setattr(packed_weight, "ORDERED_OPERANDS", False)
    monkeypatch.setattr(packed_weight, "ORDERED_ACT", False)
    monkeypatch.setattr(attention, "ORDERED_OUTPUT", False)
    assert ops.operand_order(layer.gate_up, len(ids), torch.float16) == operand_order.NATURAL
    natural = _gpu_logits(gpu, ids)
    monkeypatch.setattr(packed_weight, "ORDERED_OPERANDS", True)
    monkeypatch.setattr(packed_weight, "ORDERED_ACT", True)
    monkeypatch.setattr(attention, "ORDERED_OUTPUT", True)
    assert ops.attention_orders(gpu.config.head_dim)          # attention writes o's x in o's order
    assert ops.operand_order(layer.gate_up, len(ids), torch.float16) == operand_order.BY_32
    assert ops.operand_order(layer.gate_up, 1, torch.float16) == operand_order.NATURAL      # the GEMV's x
    assert layer.gate_up.act_orders(len(ids))            # and gate|up's epilogue writes down's x in its order
    assert ops.operand_order(layer.down, len(ids), torch.float16) == operand_order.BY_32
    assert torch.equal(_gpu_logits(gpu, ids), natural)


@pytest.mark.parametrize("name", ["tiny", "cut"])
def test_a_prefill_graph_gives_the_eager_forwards_hidden_states(models, name):
    """A 40-token prefill replayed from the (64 rows, 1 sequence) graph, and two sequences' chunks (40 and 7
    rows) from the (64, 4) one, give the hidden states of the eager forward to the bit: the GEMM's rows are the
    same at any count in its range, attention's rows the same in any grid, and the padding rows and sequences
    write and read no KV."""
    cpu, gpu = models[name]
    graphs = _step_graphs(gpu)
    assert graphs.bucket_for(40, 1) == (64, 1) and graphs.bucket_for(47, 2) == (64, 4)
    ids = ([t for p in PROMPTS for t in cpu.encode_prompt(p)] * 4)[:40]     # the prompts end to end: 40 real tokens
    other = (cpu.encode_prompt(PROMPTS[1]) + cpu.encode_prompt(PROMPTS[0]))[:7]
    assert len(ids) == 40 and len(other) == 7
    want = step_hidden(gpu, [ids])
    got = step_hidden(gpu, [ids], graphs)
    assert torch.isfinite(want).all() and torch.equal(got, want)
    want2 = step_hidden(gpu, [ids, other])
    assert torch.equal(step_hidden(gpu, [ids, other], graphs), want2) and torch.equal(want2[:40], want)


def test_prefill_steps_replay_graphs_and_generate_as_eager_steps(models, monkeypatch):
    """Greedy generation of six prompts arriving together (their prefills one step of six sequences, then
    decode steps): the prefill step replays a graph, and the tokens are the eager engine's or part at a tie."""
    cpu, gpu = models["cut"]
    runner = gpu.engine.runner
    graphs = _step_graphs(gpu)
    real, replays = graphs.run, []
    monkeypatch.setattr(graphs, "run", lambda *a: replays.append(len(a[0])) or real(*a))
    monkeypatch.setattr(runner, "step_graphs", graphs)
    prompts = [cpu.encode_prompt(p) for p in PROMPTS]
    graphed = gpu.engine.generate(prompts, GREEDY)
    assert replays and sum(replays) >= sum(len(p) for p in prompts)     # every prompt row in a graph's step
    monkeypatch.setattr(runner, "step_graphs", None)
    eager = gpu.engine.generate(prompts, GREEDY)
    for p, want, got in zip(prompts, eager, graphed):
        assert_same_or_tie(lambda ids: _gpu_logits(gpu, ids), p, want, got, 0.05)


_STEP_GRAPHS = {}


def _step_graphs(llm):
    """The prefill steps' graphs of a test model, captured once (COBATCH_STEP_GRAPHS=1 has LLM.load capture them;
    the fixture's models load without)."""
    from cobatch.engine.cuda_graphs import StepGraphs
    if id(llm) not in _STEP_GRAPHS:
        runner = llm.engine.runner
        _STEP_GRAPHS[id(llm)] = runner.step_graphs or StepGraphs(
            llm.model, llm.engine.pool, 512, 40, 256, quiet=True, mempool=runner.graphs.mempool)
    return _STEP_GRAPHS[id(llm)]


def _gpu_logits(llm, ids):
    """The eager forward's logits of one prefill of ids, every row."""
    hidden = step_hidden(llm, [ids])
    with torch.inference_mode():
        return llm.model.logits(hidden).float().cpu()


def _staggered(eng, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of each prompt, the sessions arriving two every other step (so that a step's prefill rows
    stay few: the GEMV, not the GEMM, serves them, as it serves a lone prompt)."""
    n = len(prompts)
    rid, out, step = {}, {}, 0
    while eng.has_work() or len(rid) < n:
        if step % 2 == 0:
            for _ in range(2):
                if len(rid) < n:
                    rid[eng.add_request(prompts[len(rid)], GREEDY)] = len(rid)
        for o in eng.step():
            if o.new_token is not None:
                out.setdefault(rid[o.request_id], []).append(o.new_token)
        step += 1
    return [out[i] for i in range(n)]


@pytest.mark.parametrize("n", [2, 3, 8, 33])
def test_gpu_batched_equals_alone(models, n):
    _, gpu = models["cut"]
    prompts = [gpu.encode_prompt(PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS))) for i in range(n)]
    alone = [gpu.engine.generate([p], GREEDY)[0] for p in prompts]
    eng = gpu.engine
    eng.stats.widest_step = 0
    got = _staggered(eng, prompts)
    # A step whose rows stay within the GEMV's range runs the same bitwise batch-invariant kernels as a lone
    # session; steps with more rows (decoders plus two prompts' prefills: 26 rows at the third step of 8 sessions)
    # switch to the GEMM path, where only ties may part ways.
    ties = [assert_same_or_tie(lambda ids: _gpu_logits(gpu, ids), p, a, g, 0.05)
            for p, a, g in zip(prompts, alone, got)]
    print(f"n={n}: identical {sum(t is None for t in ties)}/{n}; ties {[t for t in ties if t]}; "
          f"widest step {eng.stats.widest_step} rows")
    within_gemv = eng.stats.widest_step <= matmul_plans.GEMV_CROSSOVER
    if n <= 3:
        assert within_gemv          # these prompts keep every step narrow, so the exact check below runs
    if within_gemv:
        assert got == alone
    assert eng.stats.batched_steps > 0


def test_fp8_kv_cache_on_cuda(models):
    """--kv-cache-dtype fp8 with bf16 activations (decode graphs; the kernels write the cache in fp8 and widen it as
    they read): teacher-forced logits within the bounds the CPU path's fp8 cache keeps to an independent reference
    (tests/test_kv_cache_dtype.py); batched greedy equals alone up to ties (a step mixing decoders with a prompt
    runs their attention through the prefill kernel, whose other rounding an fp8 cache can turn into a tie-break);
    graphs = eager."""
    cpu, _ = models["cut"]
    gpu = LLM.load(cpu.path, EngineOptions(device="cuda", kv_cache_dtype="fp8", ctx=256, max_num_seqs=8, quiet=True,
                                           kv_cache_gb=1))
    assert gpu.engine.pool.dtype == torch.float8_e4m3fn and gpu.engine.runner.graphs is not None
    from model_checks import prompt_logits
    ids = cpu.encode_prompt(PROMPTS[2]) + cpu.engine.generate([cpu.encode_prompt(PROMPTS[2])], GREEDY)[0][:24]
    want, got = prompt_logits(cpu.model, cpu.config, ids), _gpu_logits(gpu, ids)
    rel = ((got - want).norm() / want.norm()).item()
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    print(f"fp8 KV on CUDA against the CPU path's f32 cache: rel {rel:.3f}, top-1 agreement {agree:.3f}")
    assert rel < 0.1 and agree >= 0.9
    prompts = [gpu.encode_prompt(p) for p in PROMPTS]
    alone = [gpu.engine.generate([p], GREEDY)[0] for p in prompts]
    # The reference is a prefill of the whole text, whose K/V (from the GEMM) round to other fp8 values than the
    # decode steps' (from the GEMV) now and then: a full fp8 step, 1/8, so ties are wider than bf16's 0.05.
    ties = [assert_same_or_tie(lambda ids: _gpu_logits(gpu, ids), p, a, g, 0.3)
            for p, a, g in zip(prompts, alone, _staggered(gpu.engine, prompts))]
    print(f"fp8 KV batched: identical {sum(t is None for t in ties)}/{len(ties)}; ties {[t for t in ties if t]}")
    assert sum(t is None for t in ties) >= len(ties) // 2
    graphs, gpu.engine.runner.graphs = gpu.engine.runner.graphs, None
    try:
        assert [gpu.engine.generate([p], GREEDY)[0] for p in prompts[:2]] == alone[:2]
    finally:
        gpu.engine.runner.graphs = graphs


def test_graph_and_eager_agree(models):
    """The captured decode graph computes what the eager forward computes."""
    _, gpu = models["cut"]
    prompt = gpu.encode_prompt(PROMPTS[0])
    with_graphs = gpu.engine.generate([prompt], GREEDY)[0]
    graphs, gpu.engine.runner.graphs = gpu.engine.runner.graphs, None
    try:
        eager = gpu.engine.generate([prompt], GREEDY)[0]
    finally:
        gpu.engine.runner.graphs = graphs
    assert with_graphs == eager


def test_overlapped_steps_on_cuda(models):
    """Overlapped steps (the default on CUDA) against steps that read their tokens first, on CUDA, through the decode
    graphs and eagerly: 4 sessions (under every kernel's batch-invariant row count, so the row that a stopped
    session still computes in the step in flight changes no one's bits), greedy and seeded sampling with
    logprobs, one stopping on its own token mid-run: the same outputs, and most steps planned ahead."""
    _, gpu = models["cut"]
    eng = gpu.engine
    assert eng.overlap                                # the default on CUDA
    prompts = [gpu.encode_prompt(p) for p in PROMPTS[:4]]
    greedy = gpu.engine.generate([prompts[2]], GREEDY)[0]
    params = [GREEDY, SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=STEPS, logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=STEPS, stop_token_ids=(greedy[6],)),
              SamplingParams(temperature=0.6, seed=9, max_tokens=STEPS // 2)]
    graphs = eng.runner.graphs
    for with_graphs in (True, False):
        eng.runner.graphs = graphs if with_graphs else None
        try:
            want, _ = _run_counting_ahead(eng, prompts, params, overlap=False)
            got, ahead = _run_counting_ahead(eng, prompts, params, overlap=True)
        finally:
            eng.runner.graphs = graphs
        print(f"overlap on CUDA ({'graphs' if with_graphs else 'eager'}): {ahead} steps planned ahead; "
              f"lengths {[len(g) for g in got]}")
        assert got == want
        assert want[2][-1][2] == "stop" and len(want[2]) <= 7
        assert ahead >= STEPS // 2


def test_penalties_and_mirostat_keep_overlapped_steps_on_cuda(models, monkeypatch):
    """With PENALTIES_AHEAD (the default), sequences with repetition, presence and frequency penalties or mirostat
    are planned ahead like the others (the sampler counts each one's last token, and takes mirostat's state, on the
    device): the same outputs as steps that read their tokens first, and most steps planned ahead, where one such
    sequence used to stop every step's overlap."""
    from cobatch.engine import engine as engine_module
    monkeypatch.setattr(engine_module, "PENALTIES_AHEAD", True)
    _, gpu = models["cut"]
    eng = gpu.engine
    prompts = [gpu.encode_prompt(p) for p in PROMPTS[:4]] + [gpu.encode_prompt(PROMPTS[0])]
    params = [GREEDY, SamplingParams(temperature=0.0, max_tokens=STEPS, repetition_penalty=1.4),
              SamplingParams(temperature=0.8, seed=5, max_tokens=STEPS, frequency_penalty=0.8, presence_penalty=0.5),
              SamplingParams(temperature=0.0, max_tokens=STEPS, frequency_penalty=1.5, logprobs=1),
              SamplingParams(temperature=1.0, seed=7, max_tokens=STEPS, mirostat=2, mirostat_tau=3.0)]
    want, _ = _run_counting_ahead(eng, prompts, params, overlap=False)
    got, ahead = _run_counting_ahead(eng, prompts, params, overlap=True)
    assert got == want
    assert ahead >= STEPS // 2
    assert len({tuple(t for t, _, _ in g) for g in want}) > 1


def _run_counting_ahead(eng, prompts: list, params: list, overlap: bool) -> tuple[list, int]:
    """Each prompt's (token, logprob, finish) outputs run to the end with or without overlapped steps, and how many
    steps were planned ahead."""
    own, launch, eng.overlap, ahead = eng.overlap, eng.runner.launch, overlap, []

    def counting(plan):
        ahead.append(plan.follows is not None)
        return launch(plan)

    eng.runner.launch = counting
    try:
        ids = {eng.add_request(p, sp): i for i, (p, sp) in enumerate(zip(prompts, params))}
        got = [[] for _ in prompts]
        while eng.has_work():
            for o in eng.step():
                lp = None if o.logprob is None else round(o.logprob, 4)
                got[ids[o.request_id]].append((o.new_token, lp, o.finish_reason))
    finally:
        eng.runner.launch, eng.overlap = launch, own
    return got, sum(ahead)


def test_speculative_steps_replay_the_decode_graph(models):
    """Prompt-lookup drafts on CUDA: a step of decoders and their drafts replays the decode graph (one row per
    token and draft), and greedy output is plain decoding's, up to ties (the attention's split plan follows
    the step's row count)."""
    from cobatch.engine.drafts import NgramSpec
    _, gpu = models["cut"]
    spec = LLM.load(_cut_model(), EngineOptions(device="cuda", dtype="f16", ctx=256, max_num_seqs=4, quiet=True,
                                                kv_cache_gb=1, speculative=NgramSpec(4)))
    assert spec.engine.runner.graphs.max_batch == 8           # 4 sessions, drafts up to 8 rows a step
    prompts = [gpu.encode_prompt("apple banana cherry dates elderberry fig grape. " * 3 + "apple banana"),
               gpu.encode_prompt("1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5,"), gpu.encode_prompt(PROMPTS[0])]
    want = [gpu.engine.generate([p], GREEDY)[0] for p in prompts]
    runner, replayed = spec.engine.runner, []
    graph_logits = runner._graph_logits

    def counting(plan):
        replayed.append((len(plan.items), sum(n for _, n in plan.items)))
        return graph_logits(plan)

    runner._graph_logits = counting
    got = spec.engine.generate(prompts, GREEDY)
    ties = [assert_same_or_tie(lambda ids: _gpu_logits(gpu, ids), p, w, g, 0.05) for p, w, g in zip(prompts, want, got)]
    print(f"speculative on CUDA: identical {sum(t is None for t in ties)}/{len(ties)}; ties {[t for t in ties if t]};"
          f" graph steps {len(replayed)}, with drafts {sum(rows > seqs for seqs, rows in replayed)}; kept "
          f"{spec.engine.stats.accepted_tokens} of {spec.engine.stats.draft_tokens} drafts")
    assert any(rows > seqs for seqs, rows in replayed)         # drafts rode in the graph
    assert spec.engine.stats.accepted_tokens > 10
    assert sum(t is None for t in ties) >= 2


def test_draft_model_on_cuda_drafts_what_the_target_keeps(models):
    """A draft model on CUDA (the cut model as its own draft, run eagerly): its drafts ride in the target's decode
    graph and are kept, and greedy output is plain decoding's, up to ties."""
    from cobatch.engine.drafts import DraftModelSpec
    _, gpu = models["cut"]
    spec = LLM.load(_cut_model(), EngineOptions(device="cuda", dtype="f16", ctx=256, max_num_seqs=4, quiet=True,
                                                kv_cache_gb=1, speculative=DraftModelSpec(str(_cut_model()), 3)))
    prompts = [gpu.encode_prompt(PROMPTS[0]), gpu.encode_prompt("1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5,")]
    want = [gpu.engine.generate([p], GREEDY)[0] for p in prompts]
    got = spec.engine.generate(prompts, GREEDY)
    ties = [assert_same_or_tie(lambda ids: _gpu_logits(gpu, ids), p, w, g, 0.05) for p, w, g in zip(prompts, want, got)]
    stats = spec.engine.stats
    print(f"draft model on CUDA: identical {sum(t is None for t in ties)}/{len(ties)}; kept {stats.accepted_tokens} "
          f"of {stats.draft_tokens} drafts")
    assert stats.accepted_tokens >= 0.8 * stats.draft_tokens > 0
    assert spec.engine.drafter.cached == {}


def test_gpu_constraints_and_prompt_logprobs(models):
    """The sampler-side features on the GPU path, beside unconstrained rows in the same steps: a JSON grammar
    (its masks go host -> device), min_tokens bans, and prompt logprobs (eager prefill), the last against the
    CPU path on the same weights."""
    import json
    pytest.importorskip("llguidance")
    from cobatch.engine.grammar import json_grammar
    cpu, gpu = models["cut"]
    def schema(kind):      # values of bounded length: a cut model's output must still finish in max_tokens
        return {"type": "object", "additionalProperties": False, "required": ["a"], "properties": {"a": kind}}
    prompt = gpu.encode_prompt("A JSON object:")
    params = [SamplingParams(temperature=0.0, max_tokens=24, grammar=json_grammar(schema({"type": "boolean"}))),
              SamplingParams(temperature=0.8, seed=1, max_tokens=24,
                             grammar=json_grammar(schema({"enum": ["x", "y"]}))),
              SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16), GREEDY]
    outs = gpu.engine.generate([prompt] * len(params), params)
    assert isinstance(json.loads(gpu.tokenizer.decode(outs[0]))["a"], bool)
    assert json.loads(gpu.tokenizer.decode(outs[1]))["a"] in ("x", "y")
    assert len(outs[2]) == 16 and not set(outs[2]) & gpu.tokenizer.stop_ids

    scoring = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    ids = cpu.encode_prompt(PROMPTS[2])

    def prompt_logprobs(llm):
        llm.engine.add_request(ids, scoring)
        got = []
        while llm.engine.has_work():
            for out in llm.engine.step():
                got += out.prompt_logprobs or []
        return got
    want, got = prompt_logprobs(cpu), prompt_logprobs(gpu)
    assert [t for t, *_ in got] == [t for t, *_ in want] == ids[1:]
    assert max(abs(a[1] - b[1]) for a, b in zip(want, got)) < 0.05        # f16 vs f32 logits


@pytest.mark.parametrize("quant", ["q8_0", "q4_k"])
def test_qwen3_gpu_logits_close_to_cpu(tmp_path, quant):
    """qwen3's per-head q / k norms run inside the rope kernel on CUDA (kernels/rope.py, QK_NORM), and its
    gate|up through the GEMV's act*mul epilogue: the prompt's logits against the CPU path's."""
    from cobatch.testing.gguf_writer import write_random_model
    from model_checks import gpu_and_cpu_logits
    path = write_random_model(tmp_path / f"qwen3-{quant}.gguf", "qwen3-tiny", quant, tokenizer_from=_cut_model(),
                              seed=5)
    ids = [int(i) for i in torch.randint(0, 49000, (40,), generator=torch.Generator().manual_seed(0))]
    got, want = gpu_and_cpu_logits(path, ids)
    assert ((got - want).norm() / want.norm()).item() < 1e-2


def test_qwen3_gpu_decode_matches_cpu(tmp_path):
    """qwen3's decode steps on CUDA run its per-head q / k norms, rope and the cache write inside decode attention
    (attention.DecodeRope, QK_NORM): greedy tokens as the CPU path's, up to ties."""
    from cobatch.testing.gguf_writer import write_random_model
    from model_checks import prompt_logits
    path = write_random_model(tmp_path / "qwen3-q8_0.gguf", "qwen3-tiny", "q8_0", tokenizer_from=_cut_model(), seed=6)
    cpu = LLM.load(path, EngineOptions(device="cpu", ctx=256, max_num_seqs=2, quiet=True))
    gpu = LLM.load(path, EngineOptions(device="cuda", dtype="f16", ctx=256, max_num_seqs=2, quiet=True, kv_cache_gb=1))
    prompts = [cpu.encode_prompt(p) for p in PROMPTS[:2]]
    want = [cpu.engine.generate([p], GREEDY)[0] for p in prompts]
    got = [gpu.engine.generate([p], GREEDY)[0] for p in prompts]
    ties = [assert_same_or_tie(lambda ids: prompt_logits(cpu.model, cpu.config, ids), p, w, g, TIE_TOL["tiny"])
            for p, w, g in zip(prompts, want, got)]
    assert sum(t is None for t in ties) >= 1
