"""The mid-batch quantized GEMM (quant_gemm.py): Gluon on Hopper's warpgroup MMA, CUDA only.

Checked against the float64 reference (x @ dequant(W).T) on odd shapes, every config knob and token tile,
its act*mul epilogue against the act kernel, row results bitwise the same whatever the batch (within the
GEMM's token range: 17 .. 256 and beyond), CUDA-graph replay, and that PackedWeight dispatches to it. The
CPU CI compiles every variant for sm_90 (tests/test_kernels_compile.py) and checks the plan here.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cobatch.kernels import matmul_plans, quant_gemv
from cobatch.kernels import norm, quant_gemm, quant_pack
from cobatch.kernels.packed_weight import PackedWeight
from cobatch.kernels.quant_gemm import GemmConfig
from cobatch.quant.weight import QuantWeight

from conftest import requires_cuda, requires_hopper
from kernel_checks import assert_graph_replay_matches, poisoned, relative_error
from test_quant_gemv import FRAGMENT, K_QUANTS, make_weight

GEMM_FORMATS = [f for f in FRAGMENT if quant_pack.PACKED_FORMATS[f] in quant_gemm.FORMATS]




# --- CPU: the plan ------------------------------------------------------------------------------------------

def test_token_tile_is_the_smallest_that_holds_the_batch():
    assert [quant_gemm.token_tile(n) for n in (1, 16, 17, 32, 33, 64, 65, 128, 129, 256, 257, 2048)] == \
        [16, 16, 32, 32, 64, 64, 128, 128, 256, 256, 256, 256]


def test_split_tiles_cover_the_graph_buckets_between_powers_of_two(monkeypatch):
    """The ring's two-accumulator tiles: 65-96 tokens run 64 + 32 token columns instead of 128, 129-160 128 + 32
    and 161-192 128 + 64 instead of 256; the powers of two stay whole, and so does everything with the switch off."""
    monkeypatch.setattr(quant_gemm, "SPLIT_TOKEN_TILES", True)
    ns = (16, 64, 65, 96, 97, 128, 129, 160, 161, 192, 193, 256, 300)
    assert [quant_gemm.split_tile(n) for n in ns] == [
        (16, 0), (64, 0), (64, 32), (64, 32), (128, 0), (128, 0), (128, 32), (128, 32), (128, 64), (128, 64),
        (256, 0), (256, 0), (256, 0)]
    for n in ns:     # x's block (the power-of-two tile) holds both accumulators' tokens
        bn, bn2 = quant_gemm.split_tile(n)
        assert n <= bn + bn2 <= quant_gemm.token_tile(n) or n > 256
    monkeypatch.setattr(quant_gemm, "SPLIT_TOKEN_TILES", False)
    assert [quant_gemm.split_tile(n) for n in ns] == [(quant_gemm.token_tile(n), 0) for n in ns]


def test_default_config_fills_the_gpu_and_divides_k():
    for rows, chunks in [(4096, 64), (6144, 128), (28672, 64), (4096, 224), (128256, 128), (256, 12)]:
        cfg = quant_gemm.default_config(rows, chunks)
        blocks = rows // cfg.rows_per_cta()
        assert chunks % (cfg.split_k * quant_gemm.STEPS_PER_ITERATION) == 0, (rows, chunks, cfg)
        could_split_more = cfg.split_k < 8 and chunks % (2 * cfg.split_k * quant_gemm.STEPS_PER_ITERATION) == 0
        assert blocks * cfg.split_k >= 132 or not could_split_more, (rows, chunks, cfg)


# (rows_pad, K) of shapes without plans of their own: Qwen2.5-7B's qkv, o, gate|up, down and head, a k or v part, odd
UNPLANNED_SHAPES = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944), (152064, 3584), (512, 3584),
                    (256, 768), (128, 512), (1024, 2816)]


def test_default_ring_config_runs_every_format_and_token_tile_and_fills_the_gpu():
    """The ring config of an unplanned shape is one the kernel accepts, its splits and stages divide K, at least
    two of its stages fit an SM at every token tile the GEMM serves by default, and its CTAs reach 0.7 of a wave
    unless K allows no further split."""
    planes_formats = [f for f in quant_pack.FRAGMENT_FORMATS if f not in (quant_pack.Q4_K, quant_pack.Q5_K)]
    for rows_pad, cols in UNPLANNED_SHAPES:
        for fmt_id in planes_formats:
            byte = fmt_id in quant_pack.BYTE_FORMATS
            n_chunks = cols // (32 if byte else 64)
            cfg = quant_gemm.default_ring_config(rows_pad, n_chunks, byte)
            assert cfg.RING and cfg.LAG and cfg.NW == (8 if rows_pad >= 16384 else 4), cfg
            steps = cfg.steps_per_iteration()
            assert n_chunks % (cfg.split_k * steps) == 0, (rows_pad, cols, cfg)
            for bn in (t for t in quant_gemm.TOKEN_TILES if t <= matmul_plans.QUANT_GEMM_UPTO):
                assert quant_gemm.ring_stages(cfg, fmt_id, bn) >= 2, (rows_pad, cols, fmt_id, bn, cfg)
            ctas = rows_pad // cfg.rows_per_cta() * cfg.split_k
            could_split_more = cfg.split_k < 8 and n_chunks % (2 * cfg.split_k * steps) == 0
            assert ctas >= 0.7 * 132 or not could_split_more, (rows_pad, cols, cfg)
            assert ctas < 0.7 * 132 * 2 or cfg.split_k == 1, (rows_pad, cols, cfg)    # no split past what fills


def test_unplanned_shapes_get_the_ring_unless_switched_off(monkeypatch):
    """matmul_plans.RING_DEFAULT picks the ring default; off, the register path's split as before."""
    assert matmul_plans.RING_DEFAULT      # the package's default
    cfg = matmul_plans.default_gemm_config("q4_k", 3584, 56)
    assert cfg == quant_gemm.default_ring_config(3584, 56, byte_format=False) and cfg.CHUNKS == 2
    assert matmul_plans.default_gemm_config("q8_0", 3584, 112).CHUNKS == 4       # one byte a weight
    monkeypatch.setattr(matmul_plans, "RING_DEFAULT", False)
    assert matmul_plans.default_gemm_config("q4_k", 3584, 56) == quant_gemm.default_config(3584, 56)
    assert not quant_gemm.default_config(3584, 56).RING


def test_config_rejects_what_the_kernel_cannot_run():
    with pytest.raises(ValueError):
        GemmConfig(NW=2)
    with pytest.raises(ValueError):
        GemmConfig(TMA=1)        # a ring needs two buffers at least
    with pytest.raises(ValueError):
        GemmConfig(RING=4, CHUNKS=3)    # a stage's chunks divide an iteration's four
    with pytest.raises(ValueError):
        GemmConfig(RING=4, P=True)      # the ring holds no loads in registers
    with pytest.raises(ValueError):
        GemmConfig(NW=4, RING=4, APART=True)    # APART runs a CTA's two warpgroups apart
    with pytest.raises(ValueError):
        GemmConfig(NW=8, APART=True)            # ... of the ring variant
    with pytest.raises(ValueError):
        GemmConfig(NW=8, PERSIST=1)             # the persistent grid walks the ring's work items
    with pytest.raises(ValueError):
        GemmConfig(NW=8, RING=4, PERSIST=3)     # one or two CTAs an SM
    with pytest.raises(ValueError):
        GemmConfig(NW=8, LAG=True)              # LAG keeps the ring consumer's MMAs in flight
    with pytest.raises(ValueError):
        GemmConfig(NW=8, AHEAD=True)            # AHEAD loads a ring stage's bytes at once


def test_ring_runs_as_many_stages_as_fit_the_token_tile():
    """A q8_0 stage of two warpgroups and 4 chunks holds 16 KB of weights and 4 chunks of x (4 KB at 16 tokens,
    64 KB at 256); the SM holds 225 KB: 8 asked-for stages run as 8, 8, 6, 4 and 2 of them, and a ring that
    cannot have 2 does not run."""
    q8 = quant_pack.Q8_0
    ring = GemmConfig(NW=8, RING=8, CHUNKS=4)
    assert [quant_gemm.ring_stages(ring, q8, bn) for bn in quant_gemm.TOKEN_TILES] == [8, 8, 6, 4, 2]
    for bn in quant_gemm.TOKEN_TILES:
        assert quant_gemm.ring_smem_bytes(ring, q8, bn) <= quant_gemm.RING_SMEM_BYTES
    assert quant_gemm.ring_stages(GemmConfig(NW=8, RING=3, CHUNKS=4), q8, 16) == 3   # never more than asked for
    # q4_K's x is 64 columns a chunk: 4-chunk stages of 256 tokens take 148 KB each, so one fits, not two
    assert quant_gemm.ring_stages(ring, quant_pack.Q4_1, 256) == 1


def test_plan_hands_mid_batches_to_the_gemm():
    gemv = quant_gemv.GemvPlan(quant_gemv.GemvConfig())
    plan = matmul_plans.MatmulPlan(gemv, matmul_plans.DEQUANT_CUBLAS, 16, GemmConfig(), 256)
    assert plan.config_for(16) is gemv
    assert isinstance(plan.config_for(17), GemmConfig) and isinstance(plan.config_for(256), GemmConfig)
    assert plan.config_for(257) == matmul_plans.DEQUANT_CUBLAS
    assert matmul_plans.MatmulPlan(gemv, matmul_plans.DEQUANT_CUBLAS, 32).config_for(33) == matmul_plans.DEQUANT_CUBLAS


@pytest.mark.parametrize("fmt_id", [quant_pack.Q8_0, quant_pack.Q6_K, quant_pack.NVFP4])
def test_x_operands_permute_and_convert_like_the_reference(fmt_id):
    """The TMA variant's one pass over x (Triton; the interpreter on the CPU) against the gather through
    quant_pack.k_order, and the permutation is the one whose activations each lane's fragment columns need."""
    from kernel_checks import DEVICE
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(16)).to(DEVICE, torch.bfloat16)
    got = quant_gemm.x_operands(x, fmt_id)
    assert got.dtype == torch.float16 and torch.equal(got, quant_gemm.x_operands_ref(x, fmt_id))
    order = quant_pack.k_order(fmt_id)
    assert torch.equal(got[:, 32 + 5], x[:, 32 + order[5]].to(torch.float16))


def test_scratch_covers_every_token_tile_of_a_split_config():
    cfg = GemmConfig(NW=8, split_k=4)
    elems, tiles = quant_gemm.scratch_need(cfg, 4096, 300)
    assert tiles == 32 * 2 and elems == tiles * 4 * 128 * 256
    assert quant_gemm.scratch_need(GemmConfig(split_k=1), 4096, 300) == (1, 1)
    # with APART each warpgroup counts its 64 rows' K slices apart: twice the counters, the same partial sums
    apart = quant_gemm.scratch_need(GemmConfig(NW=8, split_k=4, RING=4, APART=True), 4096, 300)
    assert apart == (elems, 2 * tiles)


def test_x_scratch_holds_whole_token_tiles():
    """The TMA variants read x in whole token tiles, so the scratch reserved at load for calls of up to max_tok
    tokens holds the largest tile-rounded call: 100 tokens run a 128-token tile, 300 two of 256."""
    assert [quant_gemm.x_scratch_rows(n) for n in (1, 16, 17, 100, 256, 300)] == [16, 16, 32, 128, 256, 512]


# --- CUDA ---------------------------------------------------------------------------------------------------

def run_poisoned(pw: PackedWeight, x: torch.Tensor, config, act=None) -> torch.Tensor:
    out = poisoned((x.shape[0], pw.rows // 2 if act else pw.rows), torch.bfloat16, "cuda")
    y = pw.matmul(x, config=config, out=out, act=act)
    assert torch.isfinite(y).all(), "unwritten (NaN-poisoned) or non-finite outputs"
    return y


@requires_cuda
@requires_hopper
@pytest.mark.parametrize("fmt_name", GEMM_FORMATS)
def test_gemm_matches_reference_on_odd_shapes(fmt_name, monkeypatch):
    """Rows not a multiple of the CTA's, K not a multiple of 256 (masked x), token counts inside and across
    token tiles (the ring's two-accumulator ones too), f16 and bf16 activations, one and two warpgroups, split-K
    and the L2 prefetch."""
    monkeypatch.setattr(quant_gemm, "SPLIT_TOKEN_TILES", True)
    for rows, cols in [(200, 768), (72, 320 if fmt_name not in K_QUANTS else 1280), (1000, 1024)]:
        w = make_weight(fmt_name, rows, cols, seed=3, device="cuda")
        pw = PackedWeight.from_quant(w, "cuda")
        assert pw.planes.fragment and pw.plan.mid is not None, "the quantized GEMM was not planned"
        ref_w = w.dequantize(torch.float32).double()
        gen = torch.Generator(device="cuda").manual_seed(4)
        n_chunks = pw.planes.qs.shape[1] // 512
        configs = [GemmConfig(NW=nw, split_k=s, D=d, P=pf, TMA=tm, RING=ring, CHUNKS=c)
                   for nw, s, d, pf, tm, ring, c in [(4, 1, 2, True, 0, 0, 1), (8, 2, 0, False, 0, 0, 1),
                                                     (8, 4, 0, True, 0, 0, 1), (8, 1, 0, True, 3, 0, 1),
                                                     (4, 2, 2, False, 4, 0, 1), (8, 1, 0, False, 0, 4, 1),
                                                     (8, 2, 0, False, 0, 3, 2), (4, 1, 0, False, 0, 2, 4)]]
        configs += [GemmConfig(NW=8, split_k=s, RING=4, CHUNKS=2, APART=True) for s in (1, 2)]
        configs += [GemmConfig(NW=8, split_k=1, RING=2, CHUNKS=4, LAG=True),
                    GemmConfig(NW=4, split_k=1, RING=3, CHUNKS=4, LAG=True, AHEAD=True),
                    GemmConfig(NW=8, split_k=1, RING=8, CHUNKS=4, LAG=True),    # 8, 6, 4, 2 stages by tile
                    # the committed plans' deep rings: q8_0 qkv's and o's, and q4_K's and q6_K's
                    GemmConfig(NW=4, split_k=1, RING=6, CHUNKS=4, LAG=True, AHEAD=True),
                    GemmConfig(NW=4, split_k=2, RING=8, CHUNKS=2, LAG=True, AHEAD=True)]
        configs = [c for c in configs if n_chunks % (c.split_k * c.steps_per_iteration()) == 0]
        for cfg in [pw.plan.mid] + configs:
            for n_tok in (17, 80, 100, 170, 300):     # tiles of 32, 64 + 32, 128, 128 + 64 and two of 256
                if cfg.RING and quant_gemm.ring_stages(cfg, pw.planes.fmt_id, quant_gemm.token_tile(n_tok)) < 2:
                    continue                  # not even two stages fit an SM at this token tile: no plan runs it
                for dtype in (torch.bfloat16,) if cfg is not pw.plan.mid or n_tok > 17 else (torch.float16,
                                                                                             torch.bfloat16):
                    x = torch.randn(n_tok, cols, device="cuda", generator=gen).to(dtype)
                    y = run_poisoned(pw, x, cfg)
                    assert relative_error(y, x.double() @ ref_w.T) < 5e-3, (rows, cols, cfg, n_tok, dtype)


@requires_cuda
@requires_hopper
@pytest.mark.parametrize("fmt_name", GEMM_FORMATS)
def test_gemm_row_is_bitwise_identical_whatever_the_batch(fmt_name, monkeypatch):
    """Token counts from 17 to 300 run token tiles of 32 .. 256 (and two tiles past 256), the ring's of 96, 160 and
    192 as two accumulators: a row's result must not change, under split-K (the cross-CTA reduction is part of
    the check)."""
    monkeypatch.setattr(quant_gemm, "SPLIT_TOKEN_TILES", True)
    w = make_weight(fmt_name, 4096, 4096, seed=5, device="cuda")
    pw = PackedWeight.from_quant(w, "cuda")
    plan = pw.plan
    assert plan.mid.split_k > 1
    x = torch.randn(300, 4096, generator=torch.Generator().manual_seed(6)).to("cuda", torch.bfloat16)
    apart = GemmConfig(NW=8, split_k=plan.mid.split_k, RING=4, APART=True)     # fits an SM at 256 tokens
    # the plan's GEMM configs as it runs them (mid, then wide: one split of K), past its bound as well; and the
    # ring with its warpgroups apart (each counts its own split-K tiles)
    for config_for in (lambda n: plan.config_for(min(n, plan.mid_upto)), lambda n: apart):
        full = run_poisoned(pw, x, config_for(300))
        for n_tok in (17, 32, 33, 64, 65, 96, 129, 160, 161, 192, 200, 256, 257):
            cfg = config_for(n_tok)
            assert torch.equal(run_poisoned(pw, x[:n_tok], cfg), full[:n_tok]), (cfg, n_tok)
        for t0 in (0, 100, 250):    # the same rows at other positions of a batch
            cfg = config_for(40)
            assert torch.equal(run_poisoned(pw, x[t0:t0 + 40], cfg), full[t0:t0 + 40]), (cfg, t0)


@requires_cuda
@requires_hopper
@pytest.mark.parametrize("fmt_name", GEMM_FORMATS)
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gemm_act_epilogue_equals_the_act_kernel_after_it(fmt_name, act):
    """A gate|up weight packed interleaved: the epilogue against the GEMM's own output put through the act*mul
    kernel, with and without split-K, with rows that end inside a CTA's rows."""
    from cobatch.kernels.activation import gated_mul_triton
    inter, cols = 200, 1280
    gate, up = make_weight(fmt_name, inter, cols, seed=11), make_weight(fmt_name, inter, cols, seed=12)
    pw = PackedWeight.from_quant(QuantWeight.interleave_rows(gate, up, 8), "cuda", gate_up_interleaved=True)
    x = torch.randn(100, cols, generator=torch.Generator().manual_seed(13)).to("cuda", torch.bfloat16)
    n_chunks = pw.planes.qs.shape[1] // 512
    for cfg in [GemmConfig(NW=8), GemmConfig(NW=4, split_k=2, P=True), GemmConfig(NW=8, RING=4, CHUNKS=2),
                GemmConfig(NW=8, split_k=2, RING=4, CHUNKS=2, APART=True)]:
        if n_chunks % (cfg.split_k * cfg.steps_per_iteration()):
            continue
        for n_tok in (17, 100):
            want = gated_mul_triton(pw.matmul(x[:n_tok], config=cfg), act, interleaved=True)
            got = run_poisoned(pw, x[:n_tok], cfg, act=act)
            torch.testing.assert_close(got, want, rtol=2 ** -7, atol=1e-5, msg=f"{cfg} {n_tok}")


@requires_cuda
@requires_hopper
@pytest.mark.parametrize("fmt_name", ["q8_0", "q4_k", "q6_k"])
def test_act_epilogue_stores_in_the_column_order_the_next_gemm_reads(fmt_name):
    """out_order: the GEMV's and the GEMM's act(gate) * up stored where operand_order puts each column, bit for bit
    the gather of the natural output through quant_pack.k_order (both orders, with and without split-K)."""
    from cobatch.kernels import operand_order
    inter, cols = 256, 1280
    gate, up = make_weight(fmt_name, inter, cols, seed=21), make_weight(fmt_name, inter, cols, seed=22)
    pw = PackedWeight.from_quant(QuantWeight.interleave_rows(gate, up, 8), "cuda", gate_up_interleaved=True)
    x = torch.randn(64, cols, generator=torch.Generator().manual_seed(23)).to("cuda", torch.bfloat16)
    n_chunks = pw.planes.qs.shape[1] // 512
    calls = [(None, 4)] + [(cfg, n) for cfg in (GemmConfig(NW=8), GemmConfig(NW=8, RING=4, CHUNKS=2),
                                                GemmConfig(NW=8, split_k=2, RING=4, CHUNKS=2, APART=True))
                           if not n_chunks % (cfg.split_k * cfg.steps_per_iteration()) for n in (17, 64)]
    assert len(calls) >= 3
    for cfg, n_tok in calls:            # None: the plan's, the GEMV at 4 tokens
        natural = run_poisoned(pw, x[:n_tok], cfg, act="silu")
        for order in (operand_order.BY_32, operand_order.BY_16):
            out = poisoned((n_tok, inter), torch.bfloat16, "cuda")
            got = pw.matmul(x[:n_tok], config=cfg, out=out, act="silu", out_order=order)
            assert torch.equal(got, operand_order.ordered_ref(natural, order)), (cfg, n_tok, order)


@requires_cuda
@requires_hopper
@pytest.mark.parametrize("fmt_name", ["q8_0", "q4_k", "q6_k"])
def test_gemm_variants_give_the_same_bits(fmt_name):
    """P (loads one step ahead), D (L2 prefetch), TMA (x converted once and streamed by TMA) and RING (weights
    and x through a shared-memory ring) only move loads (AHEAD: a ring stage's at once), LAG only when MMAs
    retire, and NW only which rows a CTA owns: the results are bitwise the same."""
    w = make_weight(fmt_name, 512, 2048, seed=14, device="cuda")
    pw = PackedWeight.from_quant(w, "cuda")
    x = torch.randn(70, 2048, generator=torch.Generator().manual_seed(15)).to("cuda", torch.bfloat16)
    plain = run_poisoned(pw, x, GemmConfig(NW=8, split_k=2))
    for cfg in (GemmConfig(NW=8, split_k=2, P=True), GemmConfig(NW=8, split_k=2, D=3, P=True),
                GemmConfig(NW=4, split_k=2), GemmConfig(NW=8, split_k=2, P=True, TMA=3),
                GemmConfig(NW=4, split_k=2, TMA=2), GemmConfig(NW=8, split_k=2, RING=4),
                GemmConfig(NW=8, split_k=2, RING=3, CHUNKS=2), GemmConfig(NW=4, split_k=2, RING=6),
                GemmConfig(NW=4, split_k=2, RING=2, CHUNKS=4),
                GemmConfig(NW=8, split_k=2, RING=4, CHUNKS=2, APART=True),
                GemmConfig(NW=8, split_k=2, RING=6, APART=True), GemmConfig(NW=8, split_k=2, RING=2, CHUNKS=4),
                GemmConfig(NW=8, split_k=2, RING=8, CHUNKS=4)):     # trimmed to the stages that fit 128 tokens
        assert torch.equal(run_poisoned(pw, x, cfg), plain), cfg
        if cfg.RING:
            assert torch.equal(run_poisoned(pw, x, dataclasses.replace(cfg, LAG=True)), plain), (cfg, "LAG")
            assert torch.equal(run_poisoned(pw, x, dataclasses.replace(cfg, LAG=True, AHEAD=True)), plain), \
                (cfg, "LAG, AHEAD")


@requires_cuda
@requires_hopper
@pytest.mark.parametrize("fmt_name", ["q8_0", "q4_k", "q6_k", "nvfp4"])
def test_gemm_streams_an_x_already_in_its_order_to_the_same_bits(fmt_name):
    """An f16 x whose writer put its columns in the planes' order (operand_order; in whole 256-row tiles, or only
    its own rows) goes to the ring and TMA variants as it is, with no x_operands launch: the same bits as a bf16 x
    put in order by x_operands, at token counts that fill their tiles and that do not."""
    from cobatch.kernels import operand_order
    w = make_weight(fmt_name, 512, 2048, seed=18, device="cuda")
    pw = PackedWeight.from_quant(w, "cuda")
    order = operand_order.order_of(pw.planes.fmt_id)
    xb = torch.randn(96, 2048, generator=torch.Generator().manual_seed(19)).to("cuda", torch.bfloat16)
    x = xb.to(torch.float16)           # the same values (bf16's fit f16's here)
    for cfg in (GemmConfig(NW=8, split_k=2, RING=4), GemmConfig(NW=4, split_k=1, RING=6, PERSIST=2),
                GemmConfig(NW=8, split_k=2, TMA=3)):
        for n_tok in (64, 40):
            want = run_poisoned(pw, xb[:n_tok], cfg)
            padded = operand_order.operand_buffer(n_tok, 2048, torch.float16, "cuda", order)
            padded.copy_(operand_order.ordered_ref(x[:n_tok], order))
            for ordered in (padded, operand_order.ordered_ref(x[:n_tok], order).clone()):
                out = poisoned((n_tok, pw.rows), torch.bfloat16, "cuda")
                assert torch.equal(pw.matmul(ordered, config=cfg, out=out, x_order=order), want), (cfg, n_tok)
    with pytest.raises(AssertionError):
        pw.matmul(x[:4], config=GemmConfig(NW=8, split_k=2), x_order=order)     # the plain kernel reads x as is


@requires_cuda
@requires_hopper
@pytest.mark.parametrize("fmt_name", ["q8_0", "q4_k", "q6_k", "nvfp4"])
def test_gemm_persistent_grid_gives_the_same_bits(fmt_name):
    """PERSIST launches at most one or two CTAs an SM, each walking several (token tile, row block, K split) items
    with the ring running from one into the next: 128 row blocks x 4 splits x 2 token tiles (1024 items) give
    every CTA several, split-K counters and two token tiles included; each item's work is the one-CTA ring's,
    so the bits are too."""
    w = make_weight(fmt_name, 8192, 2048, seed=16, device="cuda")
    pw = PackedWeight.from_quant(w, "cuda")
    x = torch.randn(300, 2048, generator=torch.Generator().manual_seed(17)).to("cuda", torch.bfloat16)
    for cfg in (GemmConfig(NW=4, split_k=4, RING=3), GemmConfig(NW=8, split_k=4, RING=4, APART=True),
                GemmConfig(NW=8, split_k=1, RING=2, CHUNKS=2)):     # each within 227 KB at 256 tokens
        plain = run_poisoned(pw, x, cfg)
        for persist in (1, 2):
            assert torch.equal(run_poisoned(pw, x, dataclasses.replace(cfg, PERSIST=persist)), plain), (cfg, persist)
        assert torch.equal(run_poisoned(pw, x[:40], dataclasses.replace(cfg, PERSIST=1)), plain[:40]), cfg
        # LAG's last stage of one item retires before the next item's first: the ring's count runs on
        assert torch.equal(run_poisoned(pw, x, dataclasses.replace(cfg, PERSIST=1, LAG=True)), plain), (cfg, "LAG")


@requires_cuda
@requires_hopper
def test_a_chain_of_programmatic_dependents_gives_the_bits_of_plain_launches(monkeypatch):
    """With GEMM_PDL, x_operands and the ring variant launch as programmatic dependents: a ring's first weight
    stages load while the kernel before still runs, while its x, its stores and the next x_operands' writes into
    the shared x scratch wait for that kernel. A chain RMSNorm -> GEMM -> RMSNorm -> ... (each step reading the
    one before; split-K counters, the persistent grid and the x scratch shared), eager and replayed in a CUDA
    graph, gives the bits of the same chain launched plainly."""
    assert quant_gemm._chained(torch.empty(1, device="cuda"))["PDL"]
    gen = torch.Generator().manual_seed(31)
    weights = [PackedWeight.from_quant(make_weight(f, 2048, 2048, seed=40 + i, device="cuda"), "cuda")
               for i, f in enumerate(["q8_0", "q4_k", "q6_k", "q8_0"])]
    configs = [GemmConfig(NW=4, split_k=4, RING=3, PERSIST=1), GemmConfig(NW=8, split_k=4, RING=4, APART=True),
               GemmConfig(NW=8, split_k=1, RING=2, CHUNKS=2), GemmConfig(NW=8, split_k=2, RING=4, CHUNKS=2, LAG=True)]
    norm_w = (torch.rand(2048, generator=gen) + 0.5).to("cuda", torch.bfloat16)
    x = torch.randn(96, 2048, generator=gen).to("cuda", torch.bfloat16)

    def chain(x):
        for pw, cfg in zip(weights, configs):
            h, _ = norm.rms_norm_triton(x, norm_w, 1e-6)
            x = pw.matmul(h, config=cfg)
        return x

    monkeypatch.setattr(quant_gemm, "GEMM_PDL", False)
    want = chain(x)
    assert torch.isfinite(want).all()
    monkeypatch.setattr(quant_gemm, "GEMM_PDL", True)
    assert torch.equal(chain(x), want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = chain(x)
    for _ in range(3):
        got.zero_()
        graph.replay()
        assert torch.equal(got, want)


@requires_cuda
@requires_hopper
def test_gemm_cuda_graph_replay():
    w = make_weight("q4_k", 4096, 4096, seed=8, device="cuda")
    pw = PackedWeight.from_quant(w, "cuda")
    assert pw.plan.mid.split_k > 1
    x = torch.randn(48, 4096, device="cuda").to(torch.bfloat16)
    assert_graph_replay_matches(pw.matmul, x, torch.empty(48, 4096, device="cuda", dtype=torch.bfloat16))
    for streamed in (GemmConfig(NW=8, split_k=pw.plan.mid.split_k, P=True, TMA=3),    # descriptors captured too
                     GemmConfig(NW=8, split_k=pw.plan.mid.split_k, RING=4, CHUNKS=2),
                     GemmConfig(NW=8, split_k=pw.plan.mid.split_k, RING=4, CHUNKS=2, APART=True)):
        assert_graph_replay_matches(lambda x, out=None: pw.matmul(x, config=streamed, out=out), x,
                                    torch.empty(48, 4096, device="cuda", dtype=torch.bfloat16))


@requires_cuda
@requires_hopper
def test_packed_weight_dispatches_by_batch(monkeypatch):
    """Past the GEMV's tokens and up to the plan's bound (a shape without an entry in quant_configs.json: 17 ..
    QUANT_GEMM_UPTO) calls run the quantized GEMM, more run dequantize + cuBLAS; COBATCH_QUANT_GEMM=0 plans
    without it."""
    w = make_weight("q8_0", 512, 1024, seed=9, device="cuda")
    pw = PackedWeight.from_quant(w, "cuda")
    first = matmul_plans.QUANT_GEMM_CROSSOVER + 1
    assert (pw.plan.crossover, pw.plan.mid_upto) == (first - 1, matmul_plans.QUANT_GEMM_UPTO)
    assert pw.plan.mid.RING, "an unplanned shape runs the ring default"
    calls = []
    monkeypatch.setattr(quant_gemm, "launch", lambda *a, **k: calls.append(a[1].shape[0]))
    for n_tok in (first - 1, first, matmul_plans.QUANT_GEMM_UPTO, matmul_plans.QUANT_GEMM_UPTO + 1):
        pw.matmul(torch.randn(n_tok, 1024, device="cuda").to(torch.bfloat16))
    assert calls == [first, matmul_plans.QUANT_GEMM_UPTO]
    monkeypatch.setenv("COBATCH_QUANT_GEMM", "0")
    assert PackedWeight.from_quant(w, "cuda").plan.mid is None


@requires_cuda
@requires_hopper
def test_a_row_keeps_its_bits_where_the_plan_switches_to_the_wide_config():
    """The committed plan of q8_0 6144x4096 (Llama-3-8B's qkv) runs its mid config up to wide_from tokens and
    a variant streaming x (TMA or ring) past it: the same row gives the same bits on both sides of the switch."""
    w = make_weight("q8_0", 6144, 4096, seed=16, device="cuda")
    pw = PackedWeight.from_quant(w, "cuda")
    plan = pw.plan
    assert plan.wide is not None and plan.wide.streams_x() and plan.wide_from < plan.mid_upto, plan
    n = plan.wide_from
    assert plan.config_for(n) is plan.mid and plan.config_for(n + 1) is plan.wide
    x = torch.randn(n + 20, 4096, generator=torch.Generator().manual_seed(17)).to("cuda", torch.bfloat16)
    assert torch.equal(run_poisoned(pw, x[:n], None)[:n], run_poisoned(pw, x, None)[:n])
    ref_w = w.dequantize(torch.float32).double()
    assert relative_error(run_poisoned(pw, x, None), x.double() @ ref_w.T) < 5e-3
