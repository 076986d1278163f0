"""The mid-batch quantized GEMM in CUDA C++ (quant_gemm_cuda.py, compiled by NVRTC).

CPU: x's staging kernel (through the Triton interpreter) against its torch reference, and, where NVRTC is
installed (the test extras install it), every config the benchmarks run compiles for sm_90a without spills or
serialized wgmmas. Hopper: products against the float64 reference over token tiles, configs, split-K, the act
epilogue and output types; a row's bits the same whatever the batch within a token tile's range and across
tiles; CUDA-graph replay.
"""

from __future__ import annotations

import pytest
import torch

from cobatch.kernels import nvrtc, quant_gemm_cuda, quant_pack
from cobatch.kernels.packed_weight import PackedWeight
from cobatch.kernels.quant_gemm_cuda import CudaGemmConfig
from cobatch.kernels.quant_matmul import quant_matmul_ref
from conftest import requires_cuda, requires_hopper
from kernel_checks import assert_graph_replay_matches, poisoned, relative_error
from test_quant_gemv import make_weight


# the configs bench/gemm_cuda.py sweeps around, at the token tiles they serve, per kernel format (a 4-bit chunk is 64
# columns: twice a q8_0 chunk's operand registers)
COMPILED = {
    quant_pack.Q8_0: [
        (CudaGemmConfig(WG=2, RB=1, CH=4, S=6), 64), (CudaGemmConfig(WG=2, RB=2, CH=4, S=4), 64),
        (CudaGemmConfig(WG=1, RB=1, CH=4, S=6, split_k=2, MINB=2), 32),
        (CudaGemmConfig(WG=2, RB=1, CH=2, S=8, MINB=1), 128), (CudaGemmConfig(WG=2, RB=1, CH=4, S=6), 16),
        (CudaGemmConfig(WG=1, RB=1, CH=4, S=8, split_k=4, MINB=2, LAG=True), 64),
        (CudaGemmConfig(WG=1, RB=1, CH=4, S=8, split_k=4, MINB=2, WREG=1), 64),
        (CudaGemmConfig(WG=2, RB=1, CH=4, S=8, MINB=1, WREG=1), 128),
        (CudaGemmConfig(WG=1, RB=1, CH=4, S=8, MINB=2, WREG=2), 64),
        (CudaGemmConfig(WG=1, RB=1, CH=4, S=8, MINB=2, WREG=2, L2PF=2), 64),
        (CudaGemmConfig(WG=1, RB=1, CH=4, S=8, split_k=4, MINB=2, PRODUCERS=2), 64),
        (CudaGemmConfig(WG=2, RB=1, CH=4, S=6, PRODUCERS=4), 64)],
    quant_pack.Q4_1: [
        (CudaGemmConfig(WG=2, RB=1, CH=2, S=6), 64), (CudaGemmConfig(WG=2, RB=2, CH=2, S=4), 64),
        (CudaGemmConfig(WG=1, RB=1, CH=2, S=6, split_k=2, MINB=2), 32),
        (CudaGemmConfig(WG=2, RB=1, CH=1, S=8, MINB=1), 128),
        (CudaGemmConfig(WG=1, RB=1, CH=2, S=8, split_k=4, MINB=2, LAG=True), 64),
        (CudaGemmConfig(WG=2, RB=1, CH=2, S=8, MINB=1, WREG=1), 128),
        (CudaGemmConfig(WG=1, RB=1, CH=2, S=8, MINB=2, WREG=2), 64),
        (CudaGemmConfig(WG=1, RB=1, CH=2, S=8, split_k=4, MINB=2, PRODUCERS=2), 64)]}

# --- CPU ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bn,n_tok", [(16, 16), (16, 5), (64, 40), (32, 70)])
def test_x_image_is_the_reference_layout(bn, n_tok):
    """Tokens padded with zeros to whole tiles; each chunk's 32 columns in the planes' order (k_order) as four
    groups of 8 columns, each group's tokens in 8 x 8 core matrices of 128 bytes."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(n_tok, 256, generator=torch.Generator().manual_seed(n_tok)).to(device, torch.bfloat16)
    tiles = -(-n_tok // bn)
    out = torch.full((tiles, 8, bn * 32), float("nan"), dtype=torch.float16, device=device)
    quant_gemm_cuda.x_image(x, bn, out, pdl=False)
    ref = quant_gemm_cuda.x_image_ref(x, bn)
    assert torch.equal(out, ref)
    # the reference itself: token t, logical column k of chunk c sits at [t // bn, c, kc, t % bn // 8, t % 8, k % 8]
    order = quant_pack.k_order(quant_pack.Q8_0)
    t, c, k = min(n_tok - 1, 11), 3, 13
    img = ref.view(tiles, 8, 4, bn // 8, 8, 8)
    assert img[t // bn, c, k // 8, t % bn // 8, t % 8, k % 8] == x[t, 32 * c + order[k]].half()
    assert not ref.isnan().any()


def test_config_stages_fit_an_sm():
    """A stage of 16 row tiles and 4 chunks carries 34 KB of weights and scales (16 x 4 x 544 bytes) and
    4 x 64 bn bytes of x: 38 KB at 16 tokens, 66 KB at 128, of the SM's 226 KB."""
    cfg = CudaGemmConfig(WG=2, RB=2, CH=4, S=8)
    assert [cfg.stages(bn) for bn in quant_gemm_cuda.TOKEN_TILES] == [5, 5, 4, 3]
    # 4-bit chunks: 64 columns, 128 bytes of sides a tile: 16 x 4 x 640 bytes and 4 x 128 bn bytes of x a stage
    assert [cfg.stages(bn, quant_pack.Q4_1) for bn in quant_gemm_cuda.TOKEN_TILES] == [4, 4, 3, 2]
    for bn in quant_gemm_cuda.TOKEN_TILES:
        assert cfg.smem_bytes(bn) <= quant_gemm_cuda.SMEM_LIMIT
        assert cfg.smem_bytes(bn, quant_pack.Q4_1) <= quant_gemm_cuda.SMEM_LIMIT
    with pytest.raises(ValueError):
        CudaGemmConfig(RB=3)
    with pytest.raises(ValueError):
        CudaGemmConfig(PRODUCERS=3)
    # a stage a producer warp at least: 4 producers run where the 4-bit ring holds 4 stages, not at 128 tokens (2)
    four = CudaGemmConfig(WG=2, RB=1, CH=4, S=8, PRODUCERS=4)
    assert four.runs_at(64, quant_pack.Q4_1) and not four.runs_at(128, quant_pack.Q4_1)
    assert CudaGemmConfig(WG=2, PRODUCERS=2).threads() == 320


def test_a_plan_table_names_the_cuda_kernel(monkeypatch, tmp_path):
    """quant_configs.json's "quant_gemm" with "kernel": "cuda" plans the CUDA C++ GEMM for the mid-size batches (and
    without it the Gluon one's GemmConfig); a config round-trips through its entry; a weight whose planes it cannot
    run is refused at load with a clear error."""
    from cobatch.kernels import matmul_plans
    from cobatch.kernels.quant_gemm import GemmConfig
    from cobatch.kernels.quant_pack import pack_planes
    cfg = CudaGemmConfig(WG=1, RB=2, CH=4, S=6, split_k=2, MINB=2)
    assert quant_gemm_cuda.from_plan_entry(quant_gemm_cuda.plan_entry(cfg)) == cfg
    gemv = {"W": 4, "RT": 1, "split_k": 2, "U": 8}
    shapes = {"4096x4096": {"gemv": gemv, "quant_gemm": quant_gemm_cuda.plan_entry(cfg), "quant_gemm_upto": 128},
              "1024x4096": {"gemv": gemv, "quant_gemm": {"NW": 8, "split_k": 2, "RING": 4}}}
    table = {"formats": {"q8_0": {"shapes": shapes}, "q6_k": {"shapes": {"128x256": shapes["4096x4096"]}}}}
    path = tmp_path / "configs.json"
    path.write_text(__import__("json").dumps(table))
    monkeypatch.setenv("COBATCH_QUANT_CONFIGS", str(path))
    monkeypatch.setattr(matmul_plans, "interpreting", lambda: False)
    plan = matmul_plans.plan_for("q8_0", 4096, 4096, 4096, gemv=True, quant_gemm_too=True)
    assert plan.mid == cfg and plan.config_for(64) is plan.mid and plan.config_for(129) == matmul_plans.DEQUANT_CUBLAS
    assert matmul_plans.plan_for("q8_0", 1024, 4096, 4096, gemv=True, quant_gemm_too=True).mid == \
        GemmConfig(NW=8, split_k=2, RING=4)
    monkeypatch.setattr(matmul_plans, "uses_quant_gemm", lambda device: True)
    w = make_weight("q6_k", 128, 256, seed=1)
    planes = pack_planes(w.fmt, w.rows, w.cols, w.raw, torch.device("cpu"), fragment=True)
    with pytest.raises(ValueError, match="CUDA C"):
        matmul_plans.load_plan("q6_k", 128, 256, planes, torch.device("cpu"))


def test_the_kernel_dequantizes_with_the_gemvs_instructions():
    """The CUDA source carries quant_gemv's dequantization PTX itself (operands renumbered for asm()), so the CUDA
    and Gluon kernels cannot drift apart on the operand values they feed the MMAs."""
    from cobatch.kernels import quant_gemv
    src = quant_gemm_cuda.source(CudaGemmConfig(), 64, 0, 2, True)
    for ptx, name in ((quant_gemv.ASM_Q8, "ASM_DEQUANT_Q8"), (quant_gemv.ASM_NIB_AFFINE, "ASM_DEQUANT_Q4")):
        literal = quant_gemm_cuda.asm_literal(ptx)
        assert f"#define {name} {literal}\n" in src
        assert "$" not in literal and "%0" in literal
    assert "xor.b32 u, %2, 0x80808080" in quant_gemm_cuda.asm_literal(quant_gemv.ASM_Q8)


def test_a_first_range_takes_the_fewest_tokens(monkeypatch, tmp_path):
    """"quant_gemm_first" (up to "quant_gemm_first_upto" tokens) runs ahead of the mid and wide configs; load checks a
    CUDA config only at the tokens it serves (this one's stages fit a 32-token tile, not a 128-token one)."""
    from cobatch.kernels import matmul_plans, quant_gemv
    from cobatch.kernels.quant_gemm import GemmConfig
    first = CudaGemmConfig(WG=1, RB=1, CH=8, S=4, split_k=2, MINB=2)
    assert first.stages(32) >= 2 and first.stages(128) < 2
    entry = {"gemv": {"W": 4, "RT": 1, "split_k": 2, "U": 8}, "quant_gemm_crossover": 8, "quant_gemm_upto": 256,
             "quant_gemm": {"NW": 4, "split_k": 2, "RING": 6}, "quant_gemm_wide": {"NW": 4, "split_k": 2, "RING": 4},
             "quant_gemm_wide_from": 128, "quant_gemm_first": quant_gemm_cuda.plan_entry(first),
             "quant_gemm_first_upto": 32}
    path = tmp_path / "configs.json"
    path.write_text(__import__("json").dumps({"formats": {"q8_0": {"shapes": {"1024x2048": entry}}}}))
    monkeypatch.setenv("COBATCH_QUANT_CONFIGS", str(path))
    monkeypatch.setattr(matmul_plans, "interpreting", lambda: False)
    monkeypatch.setattr(matmul_plans, "uses_quant_gemm", lambda device: True)
    w = make_weight("q8_0", 1024, 2048, seed=1)
    planes = quant_pack.pack_planes(w.fmt, w.rows, w.cols, w.raw, torch.device("cpu"), fragment=True)
    plan = matmul_plans.load_plan("q8_0", 1024, 2048, planes, torch.device("cpu"))
    picked = {n: plan.config_for(n) for n in (8, 9, 32, 33, 128, 129, 256)}
    assert isinstance(picked[8], quant_gemv.GemvPlan)
    assert picked[9] == picked[32] == first
    assert picked[33] == picked[128] == GemmConfig(NW=4, split_k=2, RING=6)
    assert picked[129] == picked[256] == GemmConfig(NW=4, split_k=2, RING=4)
    assert plan.gemm_ranges()[0] == (first, 32)
    # NVFP4 borrows q4_K's plans (PLANS_LIKE), but not a CUDA C++ config: that kernel does not read its planes
    nvfp4 = {"formats": {"q4_k": {"shapes": {"1024x2048": entry}}}}
    path.write_text(__import__("json").dumps(nvfp4))
    matmul_plans._config_table.cache_clear()
    borrowed = matmul_plans.plan_for("nvfp4", 1024, 2048, 2048, gemv=True, quant_gemm_too=True)
    assert borrowed.first is None and borrowed.mid == GemmConfig(NW=4, split_k=2, RING=6)
    assert matmul_plans.plan_for("q4_k", 1024, 2048, 2048, gemv=True, quant_gemm_too=True).first == first
    monkeypatch.setattr(quant_gemm_cuda.nvrtc, "available", lambda: False)     # no NVRTC: the mid config's calls
    w4 = make_weight("q4_k", 1024, 2048, seed=1)
    planes4 = quant_pack.pack_planes(w4.fmt, w4.rows, w4.cols, w4.raw, torch.device("cpu"), fragment=True)
    assert matmul_plans.load_plan("q4_k", 1024, 2048, planes4, torch.device("cpu")).config_for(9) == GemmConfig(
        NW=4, split_k=2, RING=6)


def _planned_cuda_configs() -> list[tuple[str, str, CudaGemmConfig, int, int]]:
    """(format, shape, config, first token count, last) of every CUDA config the package's plan table names."""
    import json
    from cobatch.kernels import matmul_plans
    out = []
    for fmt, ft in json.loads(matmul_plans.CONFIG_PATH.read_text()).get("formats", {}).items():
        for shape, entry in ft.get("shapes", {}).items():
            first_tok = int(entry.get("quant_gemm_crossover", matmul_plans.QUANT_GEMM_CROSSOVER)) + 1
            for key, upto in (("quant_gemm_first", entry.get("quant_gemm_first_upto", 0)),
                              ("quant_gemm", entry.get("quant_gemm_upto", matmul_plans.QUANT_GEMM_UPTO))):
                if entry.get(key, {}).get("kernel") == quant_gemm_cuda.PLAN_KERNEL:
                    out.append((fmt, shape, quant_gemm_cuda.from_plan_entry(entry[key]), first_tok, int(upto)))
    return out


@pytest.mark.skipif(not nvrtc.available(), reason="NVRTC (nvidia-cuda-nvrtc) is not installed")
def test_the_planned_configs_compile_without_spills_or_serialized_wgmma():
    """Every CUDA config of the package's plans, at every token tile it serves: a kernel change that makes one spill
    or serialize its wgmmas fails here, on the CPU, before it costs a decode step."""
    planned = _planned_cuda_configs()
    assert planned      # q4_K's qkv, o and down take it at their fewest tokens (decode_cuda_gemm_first_ab.md)
    for fmt, shape, cfg, lo, hi in planned:
        fmt_id = quant_pack.fragment_layout(quant_pack.PACKED_FORMATS[fmt])
        tiles = sorted({quant_gemm_cuda.token_tile(n) for n in (lo, hi)} |
                       {b for b in quant_gemm_cuda.TOKEN_TILES if lo <= b <= hi})
        for bn in tiles:
            assert cfg.runs_at(bn, fmt_id), (fmt, shape, cfg, bn)
            _, log = nvrtc.compile_cubin(quant_gemm_cuda.source(cfg, bn, 0, 2, True, fmt_id), "quant_gemm", "90a",
                                         ("--ptxas-options=-v",))
            assert not nvrtc.spills(log) and "C751" not in log, (fmt, shape, cfg, bn, log)


@pytest.mark.skipif(not nvrtc.available(), reason="NVRTC (nvidia-cuda-nvrtc) is not installed")
@pytest.mark.parametrize("fmt_id", quant_gemm_cuda.FORMATS)
@pytest.mark.parametrize("probe", [1, 2, 3])
def test_the_probes_compile(fmt_id, probe):
    """bench/gemm_cuda.py --probe's kernels (without MMAs, dequantization or both), for each format."""
    cfg = CudaGemmConfig(WG=1, RB=1, CH=2, S=6, MINB=2, PROBE=probe)
    assert quant_gemm_cuda.cubin(cfg, 64, 0, 2, True, fmt_id)[0]


@pytest.mark.skipif(not nvrtc.available(), reason="NVRTC (nvidia-cuda-nvrtc) is not installed")
@pytest.mark.parametrize("fmt_id,cfg,bn", [(f, c, bn) for f, cases in COMPILED.items() for c, bn in cases])
@pytest.mark.parametrize("act", [0, 1])
def test_kernel_compiles_without_spills_or_serialized_wgmma(fmt_id, cfg, bn, act):
    assert cfg.runs_at(bn, fmt_id)
    _, log = nvrtc.compile_cubin(quant_gemm_cuda.source(cfg, bn, act, 2, True, fmt_id), "quant_gemm", "90a",
                                 ("--ptxas-options=-v",))
    assert not nvrtc.spills(log), log
    assert "C751" not in log, log          # ptxas's "wgmma ... serialized" performance warnings


# --- Hopper -------------------------------------------------------------------------------------------------

CONFIGS = [CudaGemmConfig(WG=2, RB=1, CH=4, S=6), CudaGemmConfig(WG=1, RB=2, CH=2, S=3),
           CudaGemmConfig(WG=2, RB=1, CH=2, S=4),
           CudaGemmConfig(WG=2, RB=2, CH=1, S=2, split_k=4), CudaGemmConfig(WG=1, RB=1, CH=8, S=4, split_k=2, MINB=2),
           CudaGemmConfig(WG=2, RB=1, CH=4, S=3, split_k=2, LAG=True),
           CudaGemmConfig(WG=1, RB=1, CH=8, S=4, split_k=2, MINB=2, WREG=1),
           CudaGemmConfig(WG=2, RB=1, CH=4, S=3, split_k=4, WREG=2, L2PF=2),
           CudaGemmConfig(WG=1, RB=1, CH=2, S=5, split_k=2, MINB=2, PRODUCERS=2),
           CudaGemmConfig(WG=2, RB=1, CH=2, S=4, PRODUCERS=4)]


FORMATS = ["q8_0", "q4_k", "q4_1"]     # q4_K's fragment planes are q4_1's: one kernel format serves both


def _weight(rows=1024, cols=2048, seed=3, fmt="q8_0"):
    w = make_weight(fmt, rows, cols, seed=seed, device="cuda")
    return w, PackedWeight.from_quant(w, "cuda")


@requires_cuda
@requires_hopper
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("n_tok", [1, 16, 17, 40, 64, 100, 128, 200])
def test_product_matches_the_reference(fmt, cfg, n_tok):
    w, pw = _weight(fmt=fmt)
    x = torch.randn(n_tok, w.cols, generator=torch.Generator().manual_seed(n_tok)).to("cuda", torch.bfloat16)
    if not quant_gemm_cuda.supports(pw.planes, cfg, n_tok):
        # its stages do not divide this format's chunks, or do not fit an SM at this token tile: a clear refusal
        with pytest.raises(ValueError, match="cannot run these planes"):
            pw.matmul(x, config=cfg)
        return
    out = pw.matmul(x, config=cfg, out=poisoned((n_tok, w.rows), torch.bfloat16))
    ref = quant_matmul_ref(x, w)
    assert not out.isnan().any()
    assert relative_error(out, ref) < 4e-3, (cfg, n_tok)


@requires_cuda
@requires_hopper
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_act_epilogue_and_output_types(out_dtype, act):
    """gate|up rows interleaved 8 by 8 (QuantWeight.interleave_rows): act(gate) * up, each half rounded to the
    output type first; and plain products in f32 and f16."""
    from cobatch.kernels.activation import gated_mul_ref
    w, _ = _weight(rows=1024, cols=1024, seed=7)
    pw = PackedWeight.from_quant(w, "cuda", gate_up_interleaved=True)
    x = torch.randn(48, w.cols, generator=torch.Generator().manual_seed(2)).to("cuda", out_dtype)
    cfg = CudaGemmConfig(WG=2, RB=1, CH=4, S=4, split_k=2)
    plain = pw.matmul(x, config=cfg, out=poisoned((48, w.rows), out_dtype))
    assert relative_error(plain, quant_matmul_ref(x, w)) < 4e-3
    gated = pw.matmul(x, config=cfg, act=act, out=poisoned((48, w.rows // 2), out_dtype))
    ref = gated_mul_ref(plain, act, interleaved=True)
    assert relative_error(gated, ref) < 4e-3


@requires_cuda
@requires_hopper
@pytest.mark.parametrize("fmt", ["q8_0", "q4_k"])
def test_row_is_bitwise_identical_whatever_the_batch(fmt):
    """A row's result does not depend on the other tokens of the call, within a token tile's range and across
    tiles and token offsets, under split-K (the cross-CTA reduction in split order is part of the check)."""
    w, pw = _weight(rows=2048, cols=4096, seed=5, fmt=fmt)
    x = torch.randn(300, w.cols, generator=torch.Generator().manual_seed(6)).to("cuda", torch.bfloat16)
    for cfg in (CudaGemmConfig(WG=2, RB=1, CH=4, S=4, split_k=4), CudaGemmConfig(WG=2, RB=2, CH=2, S=3),
                CudaGemmConfig(WG=2, RB=1, CH=4, S=4, split_k=2, WREG=1)):
        full = pw.matmul(x[:256], config=cfg, out=poisoned((256, w.rows), torch.bfloat16))
        for n_tok in (1, 17, 32, 33, 64, 65, 128, 200, 256):
            got = pw.matmul(x[:n_tok], config=cfg, out=poisoned((n_tok, w.rows), torch.bfloat16))
            assert torch.equal(got, full[:n_tok]), (cfg, n_tok)
        for t0 in (3, 100):
            got = pw.matmul(x[t0:t0 + 40], config=cfg, out=poisoned((40, w.rows), torch.bfloat16))
            assert torch.equal(got, full[t0:t0 + 40]), (cfg, t0)


@requires_cuda
@requires_hopper
def test_graph_replay():
    w, pw = _weight()
    x = torch.randn(64, w.cols, generator=torch.Generator().manual_seed(9)).to("cuda", torch.bfloat16)
    cfg = CudaGemmConfig(WG=2, RB=1, CH=4, S=4, split_k=2)
    assert_graph_replay_matches(lambda x, out=None: pw.matmul(x, config=cfg, out=out), x,
                                poisoned((64, w.rows), torch.bfloat16))
