"""A chain of q8_0 GEMVs in one persistent launch (kernels/gemv_chain.py, compiled by NVRTC).

CPU: the configs compile for sm_90a without spills (where NVRTC is installed), the K split gives each warp its items,
and unsupported inputs are refused with a clear error. Hopper: chains of one to three stages against the torch
reference (chain_ref) at 1-8 tokens, with the act epilogue and split K; a row's bits the same whatever the batch;
the counters re-armed by each launch (a second launch and a CUDA-graph replay give the same result).
"""

from __future__ import annotations

import pytest
import torch

from cobatch.kernels import gemv_chain, nvrtc, quant_pack
from cobatch.kernels.gemv_chain import ChainConfig, ChainStage
from cobatch.kernels.packed_weight import PackedWeight
from conftest import requires_cuda, requires_hopper
from kernel_checks import poisoned, relative_error
from test_quant_gemv import make_weight

CONFIGS = [ChainConfig(), ChainConfig(W=4, RT=2, CTAS=2, U=4, ITEMS=2, PF=True), ChainConfig(W=4, RT=4, U=2),
           ChainConfig(W=2, RT=1, CTAS=1, U=1, ITEMS=1), ChainConfig(PIPE=True),
           ChainConfig(W=2, RT=2, CTAS=1, U=1, ITEMS=1, PIPE=True)]
# the ring engine: slots fewer than an item's (the producer laps the ring within an item), more (it runs ahead into
# the next items and stages), several CTAs an SM, RT above W
RING_CONFIGS = [ChainConfig(W=4, CTAS=1, RING=4, CH=8), ChainConfig(W=2, RT=2, CTAS=2, RING=3, CH=4),
                ChainConfig(W=4, RT=1, CTAS=1, RING=16, CH=16), ChainConfig(W=2, RT=4, CTAS=1, RING=2, CH=32),
                # warps taking whole slots: fewer slots than warps in an item (32 chunks: 2 of 16), a ring shorter
                # than the warps, more slots than warps
                ChainConfig(W=4, RT=1, CTAS=1, RING=8, CH=16, OWN=True), ChainConfig(W=8, RT=2, CTAS=1, RING=3, CH=2,
                                                                                OWN=True),
                ChainConfig(W=2, RT=1, CTAS=2, RING=6, CH=4, OWN=True),
                # two producers, slots split and whole
                ChainConfig(W=4, RT=1, CTAS=1, RING=4, CH=8, PRODUCERS=2),
                ChainConfig(W=4, RT=2, CTAS=1, RING=8, CH=4, OWN=True, PRODUCERS=2),
                # several accumulators a row tile, slots split and whole
                ChainConfig(W=2, RT=2, CTAS=1, RING=4, CH=8, ACC=2),
                ChainConfig(W=4, RT=1, CTAS=1, RING=8, CH=4, OWN=True, ACC=4)]
CONFIGS += RING_CONFIGS
# with 4-bit planes a chunk is two 32-blocks, so a warp's x ahead is twice the registers: at most 8 chunks a warp
RING_4BIT_CONFIGS = [c for c in RING_CONFIGS if (c.CH if c.OWN else c.CH // c.W) <= 8]


# --- CPU ----------------------------------------------------------------------------------------------------

@pytest.mark.skipif(not nvrtc.available(), reason="NVRTC (nvidia-cuda-nvrtc) is not installed")
@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_compiles_without_spills(cfg, dtype):
    _, log = nvrtc.compile_cubin(gemv_chain.source(cfg, dtype, True), "gemv_chain", "90a", ("--ptxas-options=-v",))
    assert not nvrtc.spills(log), log


@pytest.mark.skipif(not nvrtc.available(), reason="NVRTC (nvidia-cuda-nvrtc) is not installed")
@pytest.mark.parametrize("cfg", RING_4BIT_CONFIGS)
def test_ring_engine_compiles_for_4bit_planes_without_spills(cfg):
    source = gemv_chain.source(cfg, torch.bfloat16, True, quant_pack.Q4_1)
    _, log = nvrtc.compile_cubin(source, "gemv_chain", "90a", ("--ptxas-options=-v",))
    assert not nvrtc.spills(log), log


def _cpu_planes(rows, cols, seed=1, fmt="q8_0"):
    w = make_weight(fmt, rows, cols, seed=seed)
    return quant_pack.pack_planes(w.fmt, rows, cols, w.raw, torch.device("cpu"), fragment=True)


def test_k_splits_give_each_cta_its_items():
    planes = _cpu_planes(1024, 4096)                              # 64 tiles of 128 chunks: 32 row blocks of 2
    cfg = ChainConfig(W=4, RT=2, U=4, ITEMS=2)
    assert gemv_chain.split_of(planes, cfg, ctas=16) == 1            # 32 items >= 2 x 16 CTAs
    assert gemv_chain.split_of(planes, cfg, ctas=32) == 2            # 64 >= 64
    assert gemv_chain.split_of(planes, cfg, ctas=10_000) == 8        # at most down to one 4-chunk group a warp
    small = _cpu_planes(16, 256)
    assert small.qs.shape[1] // 512 == 8
    with pytest.raises(ValueError, match="do not divide"):
        gemv_chain.split_of(small, ChainConfig(W=4, RT=1, U=8), ctas=1)   # 8 chunks: no 8-chunk group for 4 warps


def test_ring_engine_takes_whole_row_blocks_and_refuses_what_it_cannot_run():
    planes = _cpu_planes(1024, 4096)                              # 128 chunks a row
    assert gemv_chain.split_of(planes, ChainConfig(W=4, RT=2, RING=8, CH=16), ctas=10_000) == 1
    with pytest.raises(ValueError, match="slots of 16"):
        gemv_chain.split_of(_cpu_planes(16, 256), ChainConfig(W=4, RING=2, CH=16), ctas=1)    # 8 chunks a row
    assert gemv_chain.split_of(_cpu_planes(16, 1024), ChainConfig(W=4, RING=2, CH=32), ctas=1) == 1
    for bad in (dict(RING=1), dict(RING=4, CH=12), dict(RING=4, W=8, CH=4), dict(RING=4, PF=True),
                dict(RING=4, PIPE=True), dict(RING=4, ITEMS=2), dict(OWN=True), dict(PRODUCERS=2),
                dict(RING=6, PRODUCERS=4), dict(RING=6, PRODUCERS=3), dict(ACC=2), dict(RING=4, ACC=3)):
        with pytest.raises(ValueError, match="ring engine"):
            ChainConfig(**{"W": 4, **bad})
    assert ChainConfig(W=8, RING=4, CH=4, OWN=True).CH == 4     # whole slots: CH need not divide among the warps
    cfg = ChainConfig(W=4, RT=2, RING=8, CH=16)
    assert cfg.threads == 160 and cfg.smem_bytes() == 8 * 2 * 16 * 544
    assert cfg.smem_bytes(quant_pack.Q4_1) == 8 * 2 * 16 * (512 + 128)       # 64-column chunks: 4 f16 a row and block
    assert ChainConfig().threads == 256 and ChainConfig().smem_bytes() == 0
    assert ChainConfig(W=4, RING=4, PRODUCERS=2).threads == 192


def test_unsupported_inputs_are_refused():
    planes = _cpu_planes(64, 256, seed=3)
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    ok = ChainStage(planes, x, torch.zeros(4, 64, dtype=torch.bfloat16))
    gemv_chain.check(ok, 4)
    for stage, n_tok in ((ok, 9), (ChainStage(planes, x.float(), torch.zeros(4, 64)), 4),
                         (ChainStage(planes, x, torch.zeros(4, 64, dtype=torch.bfloat16), act="silu"), 4),
                         (ChainStage(planes, x[:, :128], torch.zeros(4, 64, dtype=torch.bfloat16)), 4)):
        with pytest.raises(ValueError, match="gemv_chain needs"):
            gemv_chain.check(stage, n_tok)
    # q4_K's planes (q4_1's): the ring engine's, not the item engine's; one format a launch
    q4 = ChainStage(_cpu_planes(64, 256, seed=3, fmt="q4_k"), x, torch.zeros(4, 64, dtype=torch.bfloat16))
    assert q4.planes.fmt_id == quant_pack.Q4_1
    gemv_chain.check(q4, 4, gemv_chain.RING_FORMATS)
    with pytest.raises(ValueError, match="q8_0 fragment-order planes"):
        gemv_chain.check(q4, 4)
    with pytest.raises(ValueError, match="one format"):
        gemv_chain.launch([ok, q4], 4, ChainConfig(W=4, RING=4, CH=4), scratch=None)
    # x of one dtype in a launch (the kernel's); each stage's out may be f16 or bf16
    gemv_chain.check(ChainStage(planes, x, torch.zeros(4, 64, dtype=torch.float16)), 4)
    f16 = ChainStage(planes, x.half(), torch.zeros(4, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="x of one dtype"):
        gemv_chain.launch([ok, f16], 4, ChainConfig(), scratch=None)


# --- Hopper -------------------------------------------------------------------------------------------------

def _weights(shapes, seed=5, fmt="q8_0"):
    """QuantWeights and their packed weights (a stage with an act reads its rows as gate|up interleaved 8 by 8)."""
    out = []
    for i, (rows, cols) in enumerate(shapes):
        w = make_weight(fmt, rows, cols, seed=seed + i, device="cuda")
        out.append((w, PackedWeight.from_quant(w, "cuda")))
    return out


def _run(stages_spec, x, n_tok, cfg, scratch, dtype):
    """stages_spec: [(PackedWeight, act)]: chained, each reading the one before's output. -> the last output."""
    stages, inp = [], x
    for pw, act in stages_spec:
        out = poisoned((n_tok, pw.rows // 2 if act else pw.rows), dtype)
        stages.append(ChainStage(pw.planes, inp, out, act))
        inp = out
    gemv_chain.launch(stages, n_tok, cfg, scratch)
    return inp


@requires_cuda
@requires_hopper
@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("n_tok", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_chain_matches_the_reference(cfg, n_tok, dtype):
    """gate_up (act) -> down -> a third matrix: MLP-like shapes, split K where the items ask for it."""
    (wg, pg), (wd, pd), (w3, p3) = _weights([(2048, 1024), (1024, 1024), (384, 1024)])
    x = torch.randn(n_tok, 1024, generator=torch.Generator().manual_seed(n_tok)).to("cuda", dtype)
    scratch = gemv_chain.ChainScratch(torch.device("cuda"))
    got = _run([(pg, "silu"), (pd, None), (p3, None)], x, n_tok, cfg, scratch, dtype)
    ref = gemv_chain.chain_ref([(wg, "silu"), (wd, None), (w3, None)], x)
    assert not got.isnan().any()
    assert relative_error(got, ref) < 1e-2, (cfg, n_tok)
    again = _run([(pg, "silu"), (pd, None), (p3, None)], x, n_tok, cfg, scratch, dtype)
    assert torch.equal(again, got)                       # the counters were re-armed
    assert int(scratch.counters.abs().sum()) == 0


@requires_cuda
@requires_hopper
@pytest.mark.parametrize("fmt", ["q4_k", "q4_1"])
@pytest.mark.parametrize("cfg", [c for c in RING_4BIT_CONFIGS if 16 % c.CH == 0])  # 1024 columns: 16 chunks
@pytest.mark.parametrize("n_tok", [1, 8])
def test_ring_chain_of_4bit_planes_matches_the_reference(fmt, cfg, n_tok):
    weights = _weights([(2048, 1024), (1024, 1024), (384, 1024)], fmt=fmt)
    x = torch.randn(n_tok, 1024, generator=torch.Generator().manual_seed(n_tok)).to("cuda", torch.bfloat16)
    scratch = gemv_chain.ChainScratch(torch.device("cuda"))
    spec = [(weights[0][1], "silu"), (weights[1][1], None), (weights[2][1], None)]
    got = _run(spec, x, n_tok, cfg, scratch, torch.bfloat16)
    ref = gemv_chain.chain_ref([(weights[0][0], "silu"), (weights[1][0], None), (weights[2][0], None)], x)
    assert not got.isnan().any()
    assert relative_error(got, ref) < 1e-2, (fmt, cfg, n_tok)
    if n_tok == 8:                                   # a row's bits whatever the batch
        one = _run(spec, x[:3], 3, cfg, scratch, torch.bfloat16)
        assert torch.equal(one, got[:3])


@requires_cuda
@requires_hopper
@pytest.mark.parametrize("cfg", [ChainConfig(), RING_CONFIGS[0], RING_CONFIGS[4]])
def test_f16_operands_and_a_bf16_output(cfg):
    """As a decode step's MLP would run it: f16 x and gate|up's output (the GEMV's operand dtype), down's output in
    the model's bf16."""
    (wg, pg), (wd, pd) = _weights([(2048, 1024), (1024, 1024)])
    x = torch.randn(5, 1024, generator=torch.Generator().manual_seed(3)).to("cuda", torch.float16)
    mid, out = poisoned((5, 1024), torch.float16), poisoned((5, 1024), torch.bfloat16)
    scratch = gemv_chain.ChainScratch(torch.device("cuda"))
    gemv_chain.launch([ChainStage(pg.planes, x, mid, "silu"), ChainStage(pd.planes, mid, out)], 5, cfg, scratch)
    ref = gemv_chain.chain_ref([(wg, "silu"), (wd, None)], x)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    assert relative_error(out, ref) < 1e-2


@requires_cuda
@requires_hopper
def test_one_stage_products_and_act():
    (w, pw), = _weights([(2048, 4096)])
    (wa, pa), = _weights([(1024, 4096)], seed=9)
    from cobatch.kernels.activation import gated_mul_ref
    from cobatch.kernels.quant_matmul import quant_matmul_ref
    x = torch.randn(8, 4096, generator=torch.Generator().manual_seed(1)).to("cuda", torch.bfloat16)
    scratch = gemv_chain.ChainScratch(torch.device("cuda"))
    got = _run([(pw, None)], x, 8, ChainConfig(), scratch, torch.bfloat16)
    assert relative_error(got, quant_matmul_ref(x, w)) < 4e-3
    gated = _run([(pa, "silu")], x, 8, ChainConfig(), scratch, torch.bfloat16)
    ref = gated_mul_ref(quant_matmul_ref(x, wa).to(torch.bfloat16), "silu", interleaved=True)
    assert relative_error(gated, ref) < 4e-3


@requires_cuda
@requires_hopper
def test_row_is_bitwise_identical_whatever_the_batch():
    (wg, pg), (wd, pd) = _weights([(2048, 1024), (512, 1024)])
    x = torch.randn(8, 1024, generator=torch.Generator().manual_seed(4)).to("cuda", torch.bfloat16)
    scratch = gemv_chain.ChainScratch(torch.device("cuda"))
    for cfg in (ChainConfig(), ChainConfig(W=2, RT=1, CTAS=1, U=2, ITEMS=8, PF=True),
                ChainConfig(W=2, RT=1, CTAS=1, U=1, ITEMS=1, PIPE=True), *RING_CONFIGS[:2]):
        full = _run([(pg, "silu"), (pd, None)], x, 8, cfg, scratch, torch.bfloat16)
        for n_tok in (1, 2, 5, 7):
            got = _run([(pg, "silu"), (pd, None)], x[:n_tok], n_tok, cfg, scratch, torch.bfloat16)
            assert torch.equal(got, full[:n_tok]), (cfg, n_tok)


@requires_cuda
@requires_hopper
@pytest.mark.parametrize("cfg", [ChainConfig(), RING_CONFIGS[0]])
def test_graph_replay(cfg):
    (wg, pg), (wd, pd) = _weights([(2048, 1024), (512, 1024)])
    dtype = torch.bfloat16
    x = torch.randn(4, 1024, generator=torch.Generator().manual_seed(8)).to("cuda", dtype)
    mid, out = poisoned((4, 1024), dtype), poisoned((4, 512), dtype)
    scratch = gemv_chain.ChainScratch(torch.device("cuda"))
    stages = [ChainStage(pg.planes, x, mid, "silu"), ChainStage(pd.planes, mid, out)]
    gemv_chain.launch(stages, 4, cfg, scratch)            # compile, and the scratch grown, outside
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemv_chain.launch(stages, 4, cfg, scratch)
    for seed in range(3):
        x.copy_(torch.randn(4, 1024, generator=torch.Generator().manual_seed(seed)).to("cuda", dtype))
        out.fill_(float("nan"))
        graph.replay()
        ref = gemv_chain.chain_ref([(wg, "silu"), (wd, None)], x)
        assert not out.isnan().any() and relative_error(out, ref) < 1e-2


# --- the decode feed-forward behind COBATCH_CHAIN_MLP -------------------------------------------------------------

def test_chain_mlp_switch_reads_a_ring_config():
    assert gemv_chain.config_from_spec("") is None and gemv_chain.config_from_spec("0") is None
    assert gemv_chain.config_from_spec("1") == gemv_chain.RING_MLP_DEFAULT
    assert gemv_chain.config_from_spec("RING=12, CH=16,W=4,CTAS=2") == ChainConfig(W=4, CTAS=2, RING=12, CH=16)
    assert gemv_chain.config_from_spec("RING=24,CH=8,OWN=1,W=8,CTAS=1").OWN is True
    for bad in ("RING=x", "RINGS=4", "W=4", "RING=4,CH=12"):
        with pytest.raises(ValueError):
            gemv_chain.config_from_spec(bad)


def test_chain_mlp_leaves_what_it_does_not_take_to_the_caller():
    planes = _cpu_planes(64, 256)
    h = torch.zeros(2, 256, dtype=torch.float16)
    weight = type("W", (), {"planes": planes, "gate_up_interleaved": True})()
    assert gemv_chain.feed_forward(h, weight, weight, "silu", torch.bfloat16, gemv_chain.RING_MLP_DEFAULT) is None


@requires_cuda
@requires_hopper
@pytest.mark.parametrize("fmt", ["q8_0", "q4_k"])
def test_ops_feed_forward_through_the_chain(monkeypatch, fmt):
    """ops.feed_forward with the switch on: one chain launch for gate|up (act) and down, the product of the kernels
    it replaces within rounding, in a CUDA graph too; 9 rows go back to the GEMM's path."""
    from cobatch import ops
    cfg = ChainConfig(W=4, RT=1, CTAS=2, RING=12, CH=8)
    monkeypatch.setattr(gemv_chain, "MLP_CONFIG", cfg)
    gemv_chain.reserve_mlp_scratch(torch.device("cuda"))
    launches = []
    real_launch = gemv_chain.launch
    monkeypatch.setattr(gemv_chain, "launch", lambda *a, **k: launches.append(a[1]) or real_launch(*a, **k))
    gen = torch.Generator().manual_seed(11)
    wg = make_weight(fmt, 2 * 1024, 1024, seed=21, device="cuda")
    wd = make_weight(fmt, 1024, 1024, seed=22, device="cuda")
    gate_up = PackedWeight.from_quant(wg, torch.device("cuda"), gate_up_interleaved=True)
    down = PackedWeight.from_quant(wd, torch.device("cuda"))
    for rows in (1, 5, 8):
        h = torch.randn(rows, 1024, generator=gen).to("cuda", torch.float16)
        got = ops.feed_forward(h, gate_up, down, "silu", dtype=torch.bfloat16)
        monkeypatch.setattr(gemv_chain, "MLP_CONFIG", None)
        want = ops.feed_forward(h, gate_up, down, "silu", dtype=torch.bfloat16)
        monkeypatch.setattr(gemv_chain, "MLP_CONFIG", cfg)
        assert got.dtype == torch.bfloat16 and relative_error(got, want) < 1e-2, (fmt, rows)
    assert launches == [1, 5, 8]
    ops.feed_forward(torch.randn(9, 1024, generator=gen).to("cuda", torch.float16), gate_up, down, "silu",
                     dtype=torch.bfloat16)
    assert launches == [1, 5, 8]                       # 9 rows: not the chain's
    h = torch.randn(4, 1024, generator=gen).to("cuda", torch.float16)
    eager = ops.feed_forward(h, gate_up, down, "silu", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = ops.feed_forward(h, gate_up, down, "silu", dtype=torch.bfloat16)
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, eager)
