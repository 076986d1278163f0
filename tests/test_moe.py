"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral): routing, the expert feed-forward, the engine.

No small real MoE GGUF ships on PyPI: random ones of each layout, written by our GGUF writer (llama.cpp's
tensor names and 3-D expert tensors), are read by our code and, where transformers has a GGUF loader for the
architecture, by Hugging Face transformers as the independent reference.
"""

import gc
import os

import pytest
import torch

from cobatch.config import ModelConfig
from cobatch.engine.sampler import SamplingParams
from cobatch.errors import UserError
from cobatch.testing.gguf_writer import write_random_model
from cobatch import llm as llm_module
from cobatch.llm import LLM, EngineOptions
from cobatch.loader.gguf import GGUFFile
from cobatch.model_files import smollm2_path
from cobatch.quant.weight import QuantWeight
from model_checks import (assert_prefill_graphs_close_to_eager, gpu_and_cpu_logits, load_model, open_gguf,
                          prompt_logits, transformers_logits)

REL_ERR_BOUND = 1e-4


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe")
    # On the GPU machine SmolLM2 is not installed: the cut model the GPU tests use lends its tokenizer.
    tokenizer = os.environ.get("COBATCH_CUT_MODEL") or smollm2_path()
    layouts = {"qwen3moe": ("qwen3moe-tiny", "q8_0"), "qwen2moe": ("qwen2moe-tiny", "q4_k"),
               "mixtral": ("mixtral-tiny", "q4_0")}
    return {name: write_random_model(tmp / f"{name}.gguf", shape, quant, tokenizer_from=tokenizer, seed=11 + i)
            for i, (name, (shape, quant)) in enumerate(layouts.items())}


def test_config_reads_the_expert_layout(moe_models):
    cfgs = {name: ModelConfig.from_metadata(GGUFFile(p).metadata, set(GGUFFile(p).tensors))
            for name, p in moe_models.items()}
    q3, q2, mx = cfgs["qwen3moe"], cfgs["qwen2moe"], cfgs["mixtral"]
    assert (q3.n_experts, q3.n_experts_used, q3.expert_ffn_dim, q3.shared_expert_ffn_dim) == (8, 2, 128, 0)
    assert q3.expert_weights_norm and q3.qk_norm and q3.rope_neox
    assert (q2.n_experts, q2.shared_expert_ffn_dim, q2.expert_weights_norm, q2.qkv_bias) == (8, 256, False, True)
    assert (mx.arch, mx.n_experts, mx.n_experts_used) == ("llama", 4, 2)
    assert mx.expert_weights_norm and not mx.rope_neox


@pytest.mark.parametrize("arch, hf_config", [
    ("qwen3moe", {"moe_intermediate_size": 128, "norm_topk_prob": True}),
    ("qwen2moe", {"moe_intermediate_size": 128, "shared_expert_intermediate_size": 256, "norm_topk_prob": False}),
])
def test_logits_match_transformers(moe_models, arch, hf_config):
    """transformers' GGUF config mapping does not carry the expert widths or the renormalization, so they
    are passed as config overrides with the values the GGUF metadata holds."""
    pytest.importorskip("transformers")
    path = moe_models[arch]
    _, cfg, ours = load_model(path)
    ids = [int(i) for i in torch.randint(0, 49000, (40,), generator=torch.Generator().manual_seed(0))]
    ref = transformers_logits(path, ids, **hf_config)
    got = prompt_logits(ours, cfg, ids)
    assert ((got - ref).norm() / ref.norm()).item() < REL_ERR_BOUND
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    del ours
    gc.collect()


def test_moe_layer_equals_per_token_formula(moe_models):
    """Mixtral (no transformers GGUF loader): the layer against the routing formula written per token, on
    weights dequantized straight from the file."""
    f, cfg, model = load_model(moe_models["mixtral"])
    moe = model.layers[1].moe
    n, d, ffn = cfg.n_experts, cfg.d_model, cfg.expert_ffn_dim
    router = f.quant_weight("blk.1.ffn_gate_inp.weight").dequantize()
    gate = f.quant_weight("blk.1.ffn_gate_exps.weight").dequantize().view(n, ffn, d)
    up = f.quant_weight("blk.1.ffn_up_exps.weight").dequantize().view(n, ffn, d)
    down = f.quant_weight("blk.1.ffn_down_exps.weight").dequantize().view(n, d, ffn)
    h = torch.randn(6, d, generator=torch.Generator().manual_seed(4))
    want = torch.zeros(6, d)
    for t in range(6):
        logits = router @ h[t]
        top = logits.topk(cfg.n_experts_used).indices
        weights = torch.softmax(logits[top], 0)     # Mixtral's form: softmax over the chosen logits
        for w, e in zip(weights, top.tolist()):
            want[t] += w * (down[e] @ (torch.nn.functional.silu(gate[e] @ h[t]) * (up[e] @ h[t])))
    got = moe(h)
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    # Rows are independent of the rows beside them: each row alone gives the same output.
    alone = torch.cat([moe(h[t:t + 1]) for t in range(6)])
    assert torch.allclose(alone, got, rtol=1e-5, atol=1e-6)


def test_batched_greedy_equals_each_alone(moe_models):
    llm = LLM.load(moe_models["qwen3moe"], EngineOptions(device="cpu", ctx=256, max_num_seqs=4, quiet=True))
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [llm.encode_prompt(p) for p in ("The capital of France is", "def f(x):", "1, 2, 3,")]
    alone = [llm.engine.generate([p], greedy)[0] for p in prompts]
    together = llm.engine.generate(prompts, greedy)
    assert together == alone and all(len(t) == 10 for t in alone)
    assert not llm.model.graph_safe


@pytest.mark.parametrize("key, value, message", [
    ("qwen3moe.expert_used_count", 9, "expert_used_count is 9"),
    ("qwen3moe.expert_count", None, "lacks qwen3moe.expert_count"),
])
def test_bad_expert_metadata_is_a_user_error(moe_models, key, value, message):
    f = GGUFFile(moe_models["qwen3moe"])
    md = dict(f.metadata)
    if value is None:
        del md[key]
    else:
        md[key] = value
    with pytest.raises(UserError, match=message):
        ModelConfig.from_metadata(md, set(f.tensors))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device)")
@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe", "mixtral"])
def test_gpu_logits_close_to_cpu(moe_models, arch):
    """The CUDA path (packed experts through the narrow GEMV, eager steps) against the CPU path."""
    ids = [int(i) for i in torch.randint(0, 49000, (24,), generator=torch.Generator().manual_seed(1))]
    got, want = gpu_and_cpu_logits(moe_models[arch], ids)
    assert ((got - want).norm() / want.norm()).item() < 1e-2
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device)")
def test_gpu_shared_experts_beside_the_routed_ones_give_the_same_bits(moe_models):
    """Qwen2-MoE's shared expert (and its sigmoid gate) on the side stream at 1-8 rows, eager and replayed from a
    CUDA graph, gives the bits of the shared expert run in line."""
    _, cfg, model = load_model(moe_models["qwen2moe"], "cuda", torch.bfloat16)
    moe = model.layers[0].moe
    assert moe.shared_gate_up is not None and moe.shared_beside
    gen = torch.Generator().manual_seed(11)
    for n in (1, 3, 8):
        h = torch.randn(n, cfg.d_model, generator=gen).bfloat16().cuda()
        beside = moe(h)
        moe.shared_beside = False
        in_line = moe(h)
        moe.shared_beside = True
        assert torch.equal(beside, in_line), n
    h = torch.randn(4, cfg.d_model, generator=gen).bfloat16().cuda()
    moe(h)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe(h)
    for _ in range(2):
        h.copy_(torch.randn(4, cfg.d_model, generator=gen).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, moe(h))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device)")
@pytest.mark.parametrize("arch", ["qwen3moe", "mixtral"])
def test_gpu_routed_layer_matches_expert_by_expert(moe_models, arch):
    """The device-routed experts (two stacked launches) against the same experts run one by one."""
    _, cfg, model = load_model(moe_models[arch], "cuda", torch.bfloat16)
    moe = model.layers[0].moe
    assert moe.routed
    h = torch.randn(9, cfg.d_model, generator=torch.Generator().manual_seed(6)).bfloat16().cuda()
    weights, ids = moe.route(h)
    got = moe._routed(h, weights, ids, None)
    want = moe._expert_by_expert(h, weights, ids)
    assert got.dtype == torch.bfloat16     # stored in the model's dtype by the combine
    assert ((got.float() - want).norm() / want.norm()).item() < 5e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device)")
@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe"])
def test_gpu_prefill_runs_the_routed_experts_slice_by_slice(moe_models, arch, monkeypatch):
    """With COBATCH_MOE_PREFILL=routed, a step of more rows than the routed path takes (a prefill chunk; 8 rows
    here) runs it slice by slice: each slice's rows bitwise what the routed path gives them alone, and the whole
    close to expert by expert (qwen2moe: its shared expert on top, and its Q5_0 down experts routed)."""
    from cobatch.kernels import packed_experts
    from cobatch.models import moe as moe_module
    _, cfg, model = load_model(moe_models[arch], "cuda", torch.bfloat16)
    layer = model.layers[0].moe
    h = torch.randn(21, cfg.d_model, generator=torch.Generator().manual_seed(8)).bfloat16().cuda()
    monkeypatch.setattr(packed_experts, "ROUTED_MAX_ROWS", 8)
    monkeypatch.setattr(moe_module, "ROUTED_PREFILL", True)
    got = layer(h)
    weights, ids = layer.route(h)
    if layer.shared_gate_up is None:
        for a in (0, 8, 16):
            alone = layer._routed(h[a:a + 8], weights[a:a + 8], ids[a:a + 8], None)
            assert torch.equal(got[a:a + 8], alone), a
    monkeypatch.setattr(moe_module, "ROUTED_PREFILL", False)
    want = layer(h)
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device)")
@pytest.mark.parametrize("arch", ["qwen3moe", "mixtral", "qwen2moe"])
def test_gpu_routed_gemm_runs_a_prefill_chunk_whole(moe_models, arch, monkeypatch):
    """With COBATCH_MOE_GEMM=1 a step of 300 rows (past ROUTED_MAX_ROWS; 75 pairs an expert or more) runs the
    routed GEMM in one piece: a row's result bitwise the same whatever the step's other rows, and the whole close
    to expert by expert (qwen2moe: its shared expert on top, and its Q5_0 down experts through the GEMM too)."""
    from cobatch.kernels import packed_experts
    _, cfg, model = load_model(moe_models[arch], "cuda", torch.bfloat16)
    layer = model.layers[0].moe
    g = torch.Generator().manual_seed(9)
    h = torch.randn(300, cfg.d_model, generator=g).bfloat16().cuda()
    other = h.clone()
    other[150:] = torch.randn(150, cfg.d_model, generator=g).bfloat16().cuda()
    monkeypatch.setattr(packed_experts, "ROUTED_GEMM", True)
    assert layer.routed_gemm and layer._gemm_slots(300) and h.shape[0] > packed_experts.ROUTED_MAX_ROWS
    got = layer(h)
    assert torch.equal(layer(other)[:150], got[:150])
    monkeypatch.setattr(packed_experts, "ROUTED_GEMM", False)
    assert not layer._gemm_slots(300)
    want = layer(h)         # expert by expert
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device)")
def test_gpu_logits_close_to_cpu_through_the_routed_gemm(moe_models, monkeypatch):
    """A 100-token prompt (25 pairs an expert: 32-pair slots of the routed GEMM) against the CPU path."""
    from cobatch.kernels import packed_experts
    monkeypatch.setattr(packed_experts, "ROUTED_GEMM", True)
    assert packed_experts.routed_slot_size(100, 2, 8, True) == 32
    ids = [int(i) for i in torch.randint(0, 49000, (100,), generator=torch.Generator().manual_seed(4))]
    got, want = gpu_and_cpu_logits(moe_models["qwen3moe"], ids)
    assert ((got - want).norm() / want.norm()).item() < 1e-2
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device)")
@pytest.mark.parametrize("arch", ["qwen3moe", "mixtral", "qwen2moe"])
def test_gpu_engine_batched_equals_alone(moe_models, arch, monkeypatch):
    """Serving an MoE model on CUDA: decode steps in CUDA graphs where the experts route on the device
    (qwen2moe-tiny's down experts are q5_0, the GEMV reading their fifth bits), batched rows equal to
    each alone, and the graphs give the tokens eager steps give."""
    def load(eager):
        # Steps of at most 16 rows: all of them stay under the GEMV crossover, whose kernels are bitwise
        # batch-invariant (a 3-prompt prefill step of 18 rows would put the attention projections through
        # cuBLAS, where only ties may part ways: tests/test_gpu_engine.py). Prefill steps eager on both sides:
        # a prefill graph's 16-row bucket runs the 16-token kernels where a 5-row step runs the GEMV's 8-token
        # tier (test_gpu_prefill_steps_replay_graphs_with_routed_experts covers them).
        monkeypatch.setattr(llm_module, "STEP_GRAPHS", False)
        return LLM.load(moe_models[arch], EngineOptions(device="cuda", ctx=256, max_num_seqs=4, quiet=True,
                                                        kv_cache_gb=1, eager=eager, max_step_tokens=16))
    llm = load(False)
    assert llm.engine.runner.graphs is not None and llm.model.graph_safe
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [llm.encode_prompt(p) for p in ("The capital of France is", "def f(x):", "1, 2, 3,")]
    alone = [llm.engine.generate([p], greedy)[0] for p in prompts]
    assert llm.engine.generate(prompts, greedy) == alone
    assert load(True).engine.generate(prompts, greedy) == alone


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device)")
@pytest.mark.parametrize("arch", ["qwen3moe", "mixtral"])
def test_gpu_prefill_steps_replay_graphs_with_routed_experts(moe_models, arch, monkeypatch):
    """Where the experts route on the device at every size (the routed GEMM past ROUTED_MAX_ROWS), steps with
    prefill chunks replay graphs up to --prefill-chunk rows (without the routed GEMM, up to ROUTED_MAX_ROWS):
    a 40-token prompt's hidden states from the (64, 1) graph close to the eager forward's (a 40-row step runs
    the routed GEMV's slots where the 64-row graph runs its own), and greedy generation of three prompts at once
    replaying the prefill step, the eager engine's tokens or part at a tie."""
    from cobatch.kernels import packed_experts
    monkeypatch.setattr(packed_experts, "ROUTED_GEMM", True)
    llm = LLM.load(moe_models[arch], EngineOptions(device="cuda", ctx=256, max_num_seqs=4, quiet=True, kv_cache_gb=1))
    runner = llm.engine.runner
    assert runner.step_graphs is not None and runner.step_graphs.rows[-1] == 512
    assert llm.model.step_graph_holds(512)
    monkeypatch.setattr(packed_experts, "ROUTED_GEMM", False)
    assert llm.model.step_graph_holds(packed_experts.ROUTED_MAX_ROWS) and not llm.model.step_graph_holds(512)
    monkeypatch.setattr(packed_experts, "ROUTED_GEMM", True)
    prompts = [llm.encode_prompt(p) for p in ("The capital of France is", "def f(x):", "1, 2, 3,")]
    assert_prefill_graphs_close_to_eager(llm, open_gguf(moe_models[arch])[1], prompts)


def test_serve_banner_says_how_decode_runs():
    """`cobatch serve` prints whether decode steps (and prefill steps) run in CUDA graphs or eager, and why eager."""
    from types import SimpleNamespace as NS

    from cobatch.server.app import _graphs_note

    def llm(device, graphs, graph_safe, step_graphs=None):
        return NS(engine=NS(runner=NS(device=torch.device(device), graphs=graphs, step_graphs=step_graphs)),
                  model=NS(graph_safe=graph_safe))

    assert _graphs_note(llm("cpu", None, True)) == ""
    assert _graphs_note(llm("cuda", object(), True)) == " (decode in CUDA graphs)"
    assert _graphs_note(llm("cuda", object(), True, object())) == " (decode and prefill in CUDA graphs)"
    assert "no device routing" in _graphs_note(llm("cuda", None, False))
    assert "--eager" in _graphs_note(llm("cuda", None, True))


def test_routed_plan_on_the_cpu_equals_expert_by_expert(moe_models):
    """The routed path's glue, run with dense CPU matmuls where CUDA runs the routed GEMV: the gate|up stack
    holds expert e at rows 2 e ffn.., its gate and up rows interleaved 8 by 8 (gate 0..7, up 0..7, gate 8..15,
    ...), the slots give each pair its expert, and the combine sums a row's experts as the expert-by-expert
    path does."""
    from cobatch.kernels.moe_routing import combine_ref, expert_slots
    f, cfg, model = load_model(moe_models["mixtral"])
    moe, n, ffn = model.layers[0].moe, cfg.n_experts, cfg.expert_ffn_dim
    gate, up, down = (f.quant_weight(f"blk.0.ffn_{x}_exps.weight") for x in ("gate", "up", "down"))
    stacked = QuantWeight.interleave_rows(gate, up, 8).dequantize()      # as models/moe.py stacks them
    gate_w, up_w, down_w = gate.dequantize(), up.dequantize(), down.dequantize()
    for e in range(n):
        for r in range(0, 2 * ffn, 8):            # each group of 8 rows: gate or up rows 8 (r // 16)..
            src = (gate_w if r % 16 == 0 else up_w)[e * ffn + r // 16 * 8:][:8]
            assert torch.equal(stacked[2 * e * ffn + r:][:8], src), (e, r)
    h = torch.randn(11, cfg.d_model, generator=torch.Generator().manual_seed(8))
    weights, ids = moe.route(h)
    s = expert_slots(ids, weights, n)
    x = h[s.pair_rows]
    y = torch.full((x.shape[0], cfg.d_model), float("nan"))
    for slot in range(s.n_slots):
        start, count, e = (int(v[slot]) for v in (s.slot_start, s.slot_count, s.slot_expert))
        rows = slice(start, start + count)
        act = torch.nn.functional.silu(x[rows] @ gate_w[e * ffn:(e + 1) * ffn].T) \
            * (x[rows] @ up_w[e * ffn:(e + 1) * ffn].T)
        y[rows] = act @ down_w[e * cfg.d_model:(e + 1) * cfg.d_model].T
    assert not y.isnan().any()          # every pair belongs to a slot
    got = combine_ref(y, s, torch.float32)
    want = moe._expert_by_expert(h, weights, ids)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
