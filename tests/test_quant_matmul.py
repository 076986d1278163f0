"""Quantized matmul: repacked planes, the narrow GEMV / dequant GEMM kernel, and its batch invariance.

On the CPU the Triton kernel runs in the interpreter (conftest sets TRITON_INTERPRET=1) on tiny shapes;
the GPU tests run the compiled kernel (inline-asm dequant, tensor cores) at Llama-3-8B shapes.
"""

from __future__ import annotations

import json

import gguf
import pytest
import torch

from cobatch.kernels import matmul_plans, quant_gemv, scratch
from cobatch.kernels import quant_matmul as qm
from cobatch.kernels import quant_pack
from cobatch.kernels.matmul_plans import MatmulPlan
from cobatch.kernels.packed_weight import PackedWeight
from cobatch.kernels.quant_gemm import GemmConfig
from cobatch.kernels.quant_matmul import TileConfig, quant_matmul_ref
from cobatch.kernels.quant_pack import PACKED_FORMATS, pack_planes, unpack_planes
from cobatch.quant.formats import dequantize, format_of, random_quantized
from cobatch.quant.weight import QuantWeight
from cobatch.testing.hf_checkpoints import checkpoint_weight

from conftest import requires_cuda
from kernel_checks import assert_graph_replay_matches

T = gguf.GGMLQuantizationType
PACKED = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "fp8_e4m3", "nvfp4"]
# Tiny shapes: rows not a multiple of BN, K a multiple of the block but not of the tile (K-quants: 256).
SMALL_SHAPES = {"q8_0": (40, 96), "q4_0": (72, 160), "q4_1": (33, 64), "q5_0": (40, 96), "q5_1": (24, 96),
                "q4_k": (40, 512), "q5_k": (24, 512), "q6_k": (24, 512), "fp8_e4m3": (40, 96), "nvfp4": (40, 96)}
TINY_SHAPES = {**SMALL_SHAPES, "q4_k": (24, 256), "q5_k": (24, 256), "q6_k": (24, 256)}   # the slower multi-run tests
# The small-shape tests run the interpreter on the CPU and the compiled kernel on a GPU, with one explicit
# plan: split-K 2 (the deterministic reduction is exercised) and a GEMM tier past 4 tokens.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL_PLAN = MatmulPlan(TileConfig(16, 64, 64, 2, 4, 3), TileConfig(32, 64, 64, 1, 4, 3), 4)


def make_weight(fmt_name: str, rows: int, cols: int, seed: int, device=DEVICE) -> QuantWeight:
    fmt = format_of(fmt_name)
    if fmt.ggml_type is None:     # a checkpoint format: a normal matrix as such a checkpoint holds it
        w = checkpoint_weight(torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.02, fmt_name)
        return QuantWeight(fmt, rows, cols, w.raw.to(device), w.row_scale.to(device))
    raw = random_quantized(fmt.ggml_type, rows, cols, torch.Generator().manual_seed(seed))
    return QuantWeight(fmt, rows, cols, raw.to(device))


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


def run_poisoned(pw: PackedWeight, x: torch.Tensor, config: TileConfig | None = None) -> torch.Tensor:
    out = torch.full((x.shape[0], pw.rows), float("nan"), dtype=x.dtype, device=x.device)
    y = pw.matmul(x, config=config, out=out)
    assert y.data_ptr() == out.data_ptr()
    assert torch.isfinite(y).all(), "unwritten (NaN-poisoned) or non-finite outputs"
    return y


# --- repack -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt_name", PACKED)
def test_planes_decode_to_the_gguf_values(fmt_name):
    rows, cols = SMALL_SHAPES[fmt_name]
    w = make_weight(fmt_name, rows, cols, seed=1, device="cpu")
    planes = pack_planes(w.fmt, rows, cols, w.raw, torch.device("cpu"), row_scale=w.row_scale)
    if fmt_name == "fp8_e4m3":     # q8_0's planes: the row scale as an f16 d
        w = QuantWeight(w.fmt, rows, cols, w.raw, w.row_scale.half().float())
    want = dequantize(w.raw, w.fmt.ggml_type, cols) if w.row_scale is None else w.dequantize(torch.float32)
    torch.testing.assert_close(unpack_planes(planes), want, rtol=0, atol=0)
    assert planes.rows_pad % 128 == 0 and planes.cols_pad % 256 == 0


def test_fp8_row_scales_pack_where_f16_holds_them_times_256():
    """FP8's d is the row scale times 256 (the GEMV's e4m3 decode reads values times 2^-8) in an f16, as a normal
    number: scales from 2^-14 to 65504 / 256 pack (zero rows too), smaller or larger ones run dense."""
    assert quant_pack.fp8_packable(torch.tensor([2.0 ** -14, 1e-3, 0.0, -0.5, 255.875]))
    for bad in (2.0 ** -15, 256.0, -300.0):
        assert not quant_pack.fp8_packable(torch.tensor([1e-3, bad])), bad


def test_nbytes_counts_what_the_kernel_reads():
    for fmt_name, per_256 in [("q8_0", 272), ("q4_0", 144), ("q4_1", 160), ("q5_0", 176), ("q5_1", 192), ("q4_k", 148),
                              ("q5_k", 180), ("q6_k", 212), ("fp8_e4m3", 272), ("nvfp4", 146)]:   # nvfp4: + a row scale
        w = make_weight(fmt_name, 128, 512, seed=2, device="cpu")
        assert PackedWeight.from_quant(w, "cpu").nbytes == 128 * 2 * per_256, fmt_name


# --- the kernel under the interpreter ---------------------------------------------------------------------

@pytest.mark.parametrize("fmt_name", PACKED)
def test_narrow_kernel_matches_reference(fmt_name):
    rows, cols = SMALL_SHAPES[fmt_name]
    w = make_weight(fmt_name, rows, cols, seed=3)
    pw = PackedWeight.from_quant(w, DEVICE, plan=SMALL_PLAN)
    gen = torch.Generator().manual_seed(4)
    for n_tok in (1, 3):
        x = torch.randn(n_tok, cols, generator=gen).to(DEVICE, torch.bfloat16)
        y = run_poisoned(pw, x)
        assert y.shape == (n_tok, rows) and y.dtype == torch.bfloat16
        assert rel_err(y, quant_matmul_ref(x, w)) < 1e-2


@pytest.mark.parametrize("fmt_name", ["q8_0", "q4_k", "q6_k", "fp8_e4m3", "nvfp4"])
def test_gemm_config_matches_reference(fmt_name):
    rows, cols = TINY_SHAPES[fmt_name]
    w = make_weight(fmt_name, rows, cols, seed=5)
    pw = PackedWeight.from_quant(w, DEVICE, plan=SMALL_PLAN)
    n_tok = pw.plan.crossover + 33                     # past the crossover: the GEMM tiles, two token tiles
    x = torch.randn(n_tok, cols, generator=torch.Generator().manual_seed(6)).to(DEVICE, torch.float16)
    y = run_poisoned(pw, x)
    assert y.dtype == torch.float16
    assert rel_err(y, quant_matmul_ref(x, w)) < 1e-2


@pytest.mark.parametrize("fmt_name", PACKED)
def test_row_is_bitwise_identical_whatever_the_batch(fmt_name):
    """Row t alone (n_tok = 1) equals row t inside every batch up to the crossover, bit for bit."""
    rows, cols = TINY_SHAPES[fmt_name]
    pw = PackedWeight.from_quant(make_weight(fmt_name, rows, cols, seed=7), DEVICE, plan=SMALL_PLAN)
    assert pw.plan.narrow.split_k > 1                  # the deterministic split-K reduction is exercised
    T_max = pw.plan.crossover
    x = torch.randn(T_max, cols, generator=torch.Generator().manual_seed(8)).to(DEVICE, torch.bfloat16)
    alone = torch.cat([run_poisoned(pw, x[t:t + 1]) for t in range(T_max)])
    for n_tok in range(2, T_max + 1):
        together = run_poisoned(pw, x[:n_tok])
        assert torch.equal(together, alone[:n_tok]), n_tok


def test_interleaved_gate_up_with_act_equals_act_of_the_plain_matmuls():
    """A gate|up pair packed with its rows interleaved 8 by 8 (QuantWeight.interleave_rows), asked for
    act(gate) * up (the path of the steps the GEMV's epilogue does not serve: here the Triton kernel, then
    gated_mul reading the interleaved layout), equals the act of the gate and up matmuls run apart."""
    from cobatch.kernels.activation import gated_mul_ref
    inter, cols = 24, 96
    gate, up = make_weight("q8_0", inter, cols, seed=21), make_weight("q8_0", inter, cols, seed=22)
    both = QuantWeight.interleave_rows(gate, up, 8)
    assert torch.equal(both.raw[8:16], up.raw[:8]) and torch.equal(both.raw[16:24], gate.raw[8:16])
    pw = PackedWeight.from_quant(both, DEVICE, plan=SMALL_PLAN, gate_up_interleaved=True)
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(23)).to(DEVICE, torch.bfloat16)
    for act in ("silu", "gelu_tanh"):
        out = torch.full((3, inter), float("nan"), dtype=x.dtype, device=DEVICE)
        got = pw.matmul(x, act=act, out=out)
        assert got.shape == (3, inter) and torch.isfinite(got).all()
        plain = torch.cat([quant_matmul_ref(x, gate), quant_matmul_ref(x, up)], -1).to(x.dtype)
        assert rel_err(got, gated_mul_ref(plain, act)) < 2e-2, act
    with pytest.raises(AssertionError):      # act on a weight not packed for it
        PackedWeight.from_quant(gate, DEVICE, plan=SMALL_PLAN).matmul(x, act="silu")


def test_split_k_counters_are_rearmed():
    pw = PackedWeight.from_quant(make_weight("q4_0", 72, 160, seed=9), DEVICE, plan=SMALL_PLAN)
    run_poisoned(pw, torch.randn(2, 160).to(DEVICE, torch.bfloat16))
    _, count = scratch.SplitScratch.get(torch.device(DEVICE))
    assert int(count.abs().sum()) == 0


def test_leading_dims_and_empty_batch():
    w = make_weight("q8_0", 40, 96, seed=10)
    pw = PackedWeight.from_quant(w, DEVICE, plan=SMALL_PLAN)
    x = torch.randn(2, 1, 96).to(DEVICE, torch.bfloat16)
    assert pw.matmul(x).shape == (2, 1, 40)
    assert pw.matmul(torch.empty(0, 96, dtype=torch.bfloat16, device=DEVICE)).shape == (0, 40)


def test_plan_switches_to_the_wide_gemm_config_past_wide_from():
    """The GEMV up to the crossover, the mid GEMM config, the wide one past wide_from up to mid_upto, then the
    prefill path; a wide config with another split of K (other bits for the same row) is refused."""
    mid, wide = GemmConfig(NW=8, split_k=4), GemmConfig(NW=4, split_k=4, P=True, TMA=3)
    plan = MatmulPlan(SMALL_PLAN.narrow, matmul_plans.DEQUANT_CUBLAS, 16, mid, 256, wide, 64)
    assert [plan.config_for(n) for n in (16, 17, 64, 65, 256, 257)] == [
        SMALL_PLAN.narrow, mid, mid, wide, wide, matmul_plans.DEQUANT_CUBLAS]
    assert plan.gemm_configs() == [mid, wide]
    with pytest.raises(ValueError, match="split of K"):
        MatmulPlan(SMALL_PLAN.narrow, matmul_plans.DEQUANT_CUBLAS, 16, mid, 256, GemmConfig(NW=4, split_k=2, TMA=3), 64)



def test_a_shape_without_plans_runs_those_of_the_nearest_row_count_of_its_k(tmp_path, monkeypatch):
    """A stacked q|k (5120 x 4096) runs the q|k|v plans (6144 x 4096): the nearest row count of the same K by
    ratio, the larger on a tie; a K no entry has keeps the built-in default."""
    assert matmul_plans.nearest_shape(5120, 4096, ["6144x4096", "4096x4096", "1024x4096"]) == "6144x4096"
    assert matmul_plans.nearest_shape(2048, 4096, ["1024x4096", "4096x4096"]) == "4096x4096"
    assert matmul_plans.nearest_shape(1024, 4096, ["1024x4096", "4096x4096"]) == "1024x4096"
    assert matmul_plans.nearest_shape(4096, 12288, ["4096x14336", "4096x4096"]) is None
    gemv = {"W": 4, "RT": 1, "split_k": 2, "U": 8, "D": 0}
    table = {"formats": {"q4_k": {"shapes": {"6144x4096": {"gemv": gemv, "gemv_crossover": 32},
                                             "1024x4096": {"gemv": {**gemv, "RT": 4}}}}}}
    path = tmp_path / "configs.json"
    path.write_text(__import__("json").dumps(table))
    monkeypatch.setenv("COBATCH_QUANT_CONFIGS", str(path))
    monkeypatch.setattr(matmul_plans, "interpreting", lambda: False)
    stacked = matmul_plans.plan_for("q4_k", 5120, 4096, 4096, gemv=True)
    assert stacked.narrow.default == quant_gemv.GemvConfig(**gemv) and stacked.crossover == 32
    other_k = matmul_plans.plan_for("q4_k", 4096, 12288, 12288, gemv=True)
    assert other_k.narrow.default != quant_gemv.GemvConfig(**gemv)


def test_projections_stack_by_runs_of_one_format():
    """q|k|v of a *_K_M layer (Q4_K q and k, Q6_K v) is two matrices: q|k stacked, then v; formats that alternate
    stay apart, so the outputs keep their order."""
    from cobatch.models.linear import format_runs
    q4 = make_weight("q4_k", 48, 256, seed=4, device="cpu")
    k4 = make_weight("q4_k", 16, 256, seed=5, device="cpu")
    v6 = make_weight("q6_k", 16, 256, seed=6, device="cpu")
    assert [[p.rows for p in run] for run in format_runs([q4, k4, v6])] == [[48, 16], [16]]
    assert [len(run) for run in format_runs([q4, v6, k4])] == [1, 1, 1]


def test_row_stack_writes_each_part_s_columns_of_one_output():
    """A RowStack of a packed Q4_K and a packed Q6_K matrix (the interpreter's kernels) and a dense one: each part's
    product lands in its own columns, the same values as each part alone."""
    from cobatch.models.linear import RowStack
    a, b = make_weight("q4_k", 40, 256, seed=7, device="cpu"), make_weight("q6_k", 24, 256, seed=8, device="cpu")
    dense = torch.randn(8, 256, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    stack = RowStack([PackedWeight.from_quant(a, DEVICE, plan=SMALL_PLAN),
                      PackedWeight.from_quant(b, DEVICE, plan=SMALL_PLAN), dense.to(DEVICE)])
    gen = torch.Generator().manual_seed(10)
    for lead in ((2,), (3, 2)):
        x = torch.randn(*lead, 256, generator=gen).to(DEVICE, torch.bfloat16)
        y = stack.matmul(x)
        assert y.shape == (*lead, 72)
        parts = [stack.parts[0].matmul(x), stack.parts[1].matmul(x), torch.nn.functional.linear(x, dense.to(DEVICE))]
        assert torch.equal(y, torch.cat(parts, dim=-1))


def test_after_attention_marks_every_packed_part_and_leaves_dense_tensors():
    """o's projection is marked as following decode attention (quant_gemv.launch's `dependent`): a packed matrix, each
    packed part of a RowStack; a dense tensor (the CPU path) comes back as it was. Other projections stay unmarked."""
    from cobatch.models.linear import RowStack, after_attention
    a, b = make_weight("q4_k", 40, 256, seed=7, device="cpu"), make_weight("q6_k", 24, 256, seed=8, device="cpu")
    single = PackedWeight.from_quant(a, DEVICE, plan=SMALL_PLAN)
    assert single.follows_attention is False
    assert after_attention(single) is single and single.follows_attention is True
    dense = torch.zeros(8, 256)
    stack = RowStack([PackedWeight.from_quant(b, DEVICE, plan=SMALL_PLAN), dense])
    assert after_attention(stack) is stack and stack.parts[0].follows_attention is True
    assert not hasattr(dense, "follows_attention") and after_attention(dense) is dense


@pytest.mark.parametrize("fmt_name", ["fp8_e4m3", "nvfp4"])
def test_checkpoint_formats_hand_batches_past_the_narrow_kernel_to_cublas(monkeypatch, fmt_name):
    """Row-major FP8 and NVFP4 planes (no Hopper GPU, or COBATCH_TRITON_GEMV=1) are read by the Triton kernel up to
    its crossover; past it they are dequantized for cuBLAS (quant_configs.json's defaults for them)."""
    monkeypatch.setattr(matmul_plans, "interpreting", lambda: False)
    plan = matmul_plans.plan_for(fmt_name, 4096, 4096, 4096)
    assert isinstance(plan.narrow, TileConfig) and plan.gemm == matmul_plans.DEQUANT_CUBLAS and plan.mid is None
    assert plan.config_for(plan.crossover) is plan.narrow
    assert plan.config_for(plan.crossover + 1) == matmul_plans.DEQUANT_CUBLAS


def test_a_checkpoint_format_s_own_configs_sit_over_those_of_the_format_it_runs_like(monkeypatch, tmp_path):
    """FP8 with a GEMV config of its own for a shape keeps q8_0's GEMM configs for it (matmul_plans.PLANS_LIKE), but
    not q8_0's GEMV tiers, and takes all of q8_0's for a shape it has nothing for."""
    gemv = {"W": 4, "RT": 1, "split_k": 1, "U": 16}
    fp8_gemv = {"W": 8, "RT": 2, "split_k": 2, "U": 2}
    mid = {"NW": 8, "split_k": 2, "RING": 4, "CHUNKS": 2}
    shapes = {"4096x4096": {"gemv": gemv, "gemv_upto": {"8": gemv}, "quant_gemm": mid, "quant_gemm_upto": 128},
              "1024x4096": {"gemv": gemv, "quant_gemm": mid, "quant_gemm_upto": 64}}
    table = {"formats": {"q8_0": {"shapes": shapes},
                         "fp8_e4m3": {"shapes": {"4096x4096": {"gemv": fp8_gemv}}}}}
    path = tmp_path / "configs.json"
    path.write_text(__import__("json").dumps(table))
    monkeypatch.setenv("COBATCH_QUANT_CONFIGS", str(path))
    monkeypatch.setattr(matmul_plans, "interpreting", lambda: False)
    own = matmul_plans.plan_for("fp8_e4m3", 4096, 4096, 4096, gemv=True, quant_gemm_too=True)
    assert own.narrow.default == quant_gemv.GemvConfig(**fp8_gemv)
    assert own.narrow.upto == ()           # q8_0's tiers split K otherwise: FP8's own GEMV plan replaces them whole
    assert own.mid == GemmConfig(**mid) and own.mid_upto == 128
    borrowed = matmul_plans.plan_for("fp8_e4m3", 1024, 4096, 4096, gemv=True, quant_gemm_too=True)
    assert borrowed.narrow.default == quant_gemv.GemvConfig(**gemv) and borrowed.mid_upto == 64


def test_fp8_scales_f16_cannot_hold_run_as_a_dense_matrix():
    """FP8 planes are q8_0's, with the row scale as an f16 d: a scale below f16's normal range falls back to the
    dequantized matrix (exact), a weight of representable scales is packed."""
    w = make_weight("fp8_e4m3", 40, 96, seed=18, device="cpu")
    assert PackedWeight.from_quant(w, "cpu").planes is not None
    tiny = QuantWeight(w.fmt, w.rows, w.cols, w.raw, w.row_scale * 1e-4)
    pw = PackedWeight.from_quant(tiny, "cpu")
    assert pw.planes is None and torch.equal(pw.dense, tiny.dequantize(torch.float32).to(torch.bfloat16))


@pytest.mark.parametrize("ggml_type", [T.Q2_K, T.Q3_K, T.F16])
def test_unpacked_formats_fall_back_to_a_dense_matrix(ggml_type):
    fmt = format_of(ggml_type)
    assert fmt.name not in PACKED_FORMATS
    rows, cols = 24, 256
    w = QuantWeight(fmt, rows, cols, random_quantized(ggml_type, rows, cols, torch.Generator().manual_seed(11)))
    pw = PackedWeight.from_quant(w, DEVICE)
    assert pw.dense is not None and pw.nbytes == rows * cols * 2
    x = torch.randn(3, cols).to(DEVICE, torch.bfloat16)
    assert rel_err(pw.matmul(x), quant_matmul_ref(x, w)) < 1e-2


# --- GPU: real shapes, the compiled kernel -----------------------------------------------------------------

def random_weight_cuda(fmt_name: str, rows: int, cols: int, seed: int) -> QuantWeight:
    """Valid random blocks, built in row slices (random_quantized is CPU-only) and moved to the GPU."""
    if fmt_name in ("fp8_e4m3", "nvfp4"):
        return make_weight(fmt_name, rows, cols, seed, device="cuda")
    fmt = format_of(fmt_name)
    parts = [random_quantized(fmt.ggml_type, min(1024, rows - r0), cols, torch.Generator().manual_seed(seed + r0))
             for r0 in range(0, rows, 1024)]
    return QuantWeight(fmt, rows, cols, torch.cat(parts).cuda())


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("fmt_name", PACKED)
def test_gpu_matches_reference_at_llama_shapes(fmt_name, dtype):
    for rows, cols in [(4096, 4096), (1024, 14336)]:
        w = random_weight_cuda(fmt_name, rows, cols, seed=12)
        pw = PackedWeight.from_quant(w, "cuda")
        ref_w = w.dequantize(torch.float32)
        gen = torch.Generator(device="cuda").manual_seed(13)
        for n_tok in (1, 2, 8, pw.plan.crossover, pw.plan.crossover + 1, 64, 300):
            x = torch.randn(n_tok, cols, device="cuda", generator=gen).to(dtype)
            y = run_poisoned(pw, x)
            ref = x.double() @ ref_w.double().T
            assert rel_err(y, ref) < 1e-2, (rows, cols, n_tok)



@requires_cuda
def test_gpu_mixed_format_qkv_is_two_matrices_written_in_place():
    """A Q4_K_M layer's q|k|v (Q4_K q and k, Q6_K v): q|k stacked on the q|k|v plans, v on its own, each writing its
    columns of one output, on every path from the GEMV through the GEMM to dequantize + cuBLAS."""
    from cobatch.models.linear import RowStack, load_linear
    q, k, v = (random_weight_cuda(fmt, rows, 4096, seed=20 + i)
               for i, (fmt, rows) in enumerate((("q4_k", 4096), ("q4_k", 1024), ("q6_k", 1024))))
    stack = load_linear([q, k, v], torch.device("cuda"), torch.bfloat16)
    assert isinstance(stack, RowStack) and [p.rows for p in stack.parts] == [5120, 1024]
    gemm_too = matmul_plans.uses_quant_gemm(torch.device("cuda"))
    assert stack.parts[0].plan == matmul_plans.plan_for("q4_k", 6144, 4096, 4096, gemv=True, quant_gemm_too=gemm_too)
    ref_w = torch.cat([w.dequantize(torch.float32) for w in (q, k, v)])
    gen = torch.Generator(device="cuda").manual_seed(23)
    for n_tok in (1, 8, 16, 40, 300, 600):
        x = torch.randn(n_tok, 4096, device="cuda", generator=gen).to(torch.bfloat16)
        y = stack.matmul(x)
        assert y.shape == (n_tok, 6144) and torch.isfinite(y).all()
        assert rel_err(y, x.double() @ ref_w.double().T) < 1e-2, n_tok
        assert torch.equal(y[:, 5120:], stack.parts[1].matmul(x)), n_tok



@requires_cuda
@pytest.mark.parametrize("fmt_name", ["q8_0", "fp8_e4m3", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k"])
def test_gpu_fragment_dequantize_writes_the_gemv_s_f16_values(fmt_name):
    """The prefill path's dense matrix from fragment-order planes (kernels/fragment_dequant.py): in f16 each value
    is the planes' value rounded to f16 once, as the GEMV's decode makes it (q8_0 and FP8 bit for bit), or for the
    4-bit formats within an f16 rounding plus what the GEMV's high-nibble scale d / 16 loses where it is an f16
    subnormal (at most 15 * 16 * 2^-25); q6_K's scales d s are rounded to f16 twice first (its f32 d, then the
    product); in bf16 within a bf16 rounding more; rows past a 64-row block masked."""
    from cobatch.kernels import fragment_dequant
    w = random_weight_cuda(fmt_name, 200, 2048, seed=30)
    pw = PackedWeight.from_quant(w, "cuda")
    assert fragment_dequant.supports(pw.planes)
    ref = unpack_planes(pw.planes).float()
    out16 = fragment_dequant.dequantize(pw.planes, torch.full((200, 2048), float("nan"), device="cuda",
                                                               dtype=torch.float16))
    if fmt_name in ("q8_0", "fp8_e4m3"):
        assert torch.equal(out16, ref.half())
    else:
        rel = 2.0 ** -9 if fmt_name == "q6_k" else 2.0 ** -11
        assert ((out16.float() - ref).abs() <= ref.abs() * rel + 2.0 ** -16).all()
    out = qm.dequantize_planes(pw.planes, torch.empty(200, 2048, device="cuda", dtype=torch.bfloat16))
    assert ((out.float() - ref).abs() <= ref.abs() * 2.0 ** -7 + 2.0 ** -16).all()


@requires_cuda
@pytest.mark.parametrize("fmt_name", PACKED)
def test_gpu_row_is_bitwise_identical_whatever_the_batch(fmt_name):
    for rows, cols in [(4096, 4096), (6144, 4096)]:
        pw = PackedWeight.from_quant(random_weight_cuda(fmt_name, rows, cols, seed=14), "cuda")
        T_max = pw.plan.crossover
        x = torch.randn(T_max, cols, device="cuda").to(torch.bfloat16)
        alone = torch.cat([run_poisoned(pw, x[t:t + 1]) for t in range(T_max)])
        for n_tok in range(2, T_max + 1):
            assert torch.equal(run_poisoned(pw, x[:n_tok]), alone[:n_tok]), (rows, n_tok)


@requires_cuda
def test_gpu_cuda_graph_replay():
    """Captured once, replayed with new inputs: no host sync or allocation inside, split-K re-armed."""
    w = random_weight_cuda("q4_k", 4096, 4096, seed=15)
    pw = PackedWeight.from_quant(w, "cuda")
    assert pw.plan.narrow.split_k > 1
    x = torch.randn(4, 4096, device="cuda").to(torch.bfloat16)
    assert_graph_replay_matches(pw.matmul, x, torch.empty(4, 4096, device="cuda", dtype=torch.bfloat16))


@pytest.mark.parametrize("fmt_name", PACKED)
def test_dequantize_kernel_and_cublas_gemm_path(fmt_name):
    rows, cols = TINY_SHAPES[fmt_name]
    w = make_weight(fmt_name, rows, cols, seed=16)
    plan = MatmulPlan(SMALL_PLAN.narrow, matmul_plans.DEQUANT_CUBLAS, 4)
    pw = PackedWeight.from_quant(w, DEVICE, plan=plan)
    dense = torch.full((rows, cols), float("nan"), dtype=torch.float16, device=DEVICE)
    qm.dequantize_planes(pw.planes, dense)
    assert rel_err(dense, w.dequantize().to(DEVICE)) < 1e-3
    x = torch.randn(9, cols, generator=torch.Generator().manual_seed(17)).to(DEVICE, torch.bfloat16)
    assert rel_err(run_poisoned(pw, x), quant_matmul_ref(x, w)) < 1e-2


def test_load_plan_reads_the_table_in_force(tmp_path, monkeypatch):
    """bench/plan_ab.py plans loaded weights again by pointing COBATCH_QUANT_CONFIGS at another table: load_plan
    takes that table's entry for the weight's format and shape, and the package's without the variable."""
    from types import SimpleNamespace
    monkeypatch.setattr(matmul_plans, "interpreting", lambda: False)     # the interpreter's plans ignore the tables
    planes = SimpleNamespace(cols_pad=4096, fragment=True)
    mine = {"W": 2, "RT": 1, "split_k": 4, "U": 8, "D": 0, "R": 128}
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"formats": {"q8_0": {"shapes": {"4096x4096": {"gemv": mine, "gemv_crossover": 12}}}}}))
    monkeypatch.setenv("COBATCH_QUANT_CONFIGS", str(path))
    plan = matmul_plans.load_plan("q8_0", 4096, 4096, planes, torch.device("cpu"))
    assert plan.narrow.default == quant_gemv.GemvConfig(**mine) and plan.crossover == 12 and plan.mid is None
    monkeypatch.delenv("COBATCH_QUANT_CONFIGS")
    package = json.loads(matmul_plans.CONFIG_PATH.read_text())["formats"]["q4_k"]["shapes"]["4096x4096"]
    plan = matmul_plans.load_plan("q4_k", 4096, 4096, planes, torch.device("cpu"))
    assert plan.narrow.default == quant_gemv.GemvConfig(**package["gemv"]) != quant_gemv.GemvConfig(**mine)
