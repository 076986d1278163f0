"""The small fused ops (rms_norm, rope, kv_write, rope+kv_write, silu_mul) against their torch references.

Tiny shapes run everywhere (in the Triton interpreter on the CPU); real Llama-3-8B shapes run on CUDA only.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from cobatch.kernels.activation import gated_mul_ref, gated_mul_triton  # noqa: E402
from cobatch.kernels.kv_write import kv_write_ref, kv_write_triton  # noqa: E402
from cobatch.kernels.norm import rms_norm_ref, rms_norm_triton  # noqa: E402
from cobatch.kernels.rope import rope_cos_sin, rope_ref, rope_triton  # noqa: E402
from conftest import requires_cuda  # noqa: E402
from kernel_checks import DEVICE, assert_matches, assert_same_cache, poisoned  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# --- rms_norm -----------------------------------------------------------------------------------------------

def check_rms_norm(rows: int, hidden: int, dtype: torch.dtype, with_residual: bool, in_place: bool,
                   seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g).to(DEVICE, dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(DEVICE)   # GGUF norm weights are f32
    residual = torch.randn(rows, hidden, generator=g).to(DEVICE, dtype) if with_residual else None
    ref_out, ref_h = rms_norm_ref(x, weight, 1e-5, residual)
    out = poisoned(x.shape, dtype)
    if with_residual and in_place:
        res = residual.clone()
        got_out, got_h = rms_norm_triton(x, weight, 1e-5, res, out=out, residual_out=res)
        assert got_h is res
    else:
        h_buf = poisoned(x.shape, dtype) if with_residual else None
        got_out, got_h = rms_norm_triton(x, weight, 1e-5, residual, out=out, residual_out=h_buf)
    assert got_out is out
    assert_matches(got_out, ref_out)
    assert_matches(got_h, ref_h)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual,in_place", [(False, False), (True, False), (True, True)])
def test_rms_norm_small(dtype, with_residual, in_place):
    check_rms_norm(5, 48, dtype, with_residual, in_place, seed=1)     # 48: not a power of two


def test_rms_norm_writes_the_normed_rows_in_the_next_weights_operand_dtype():
    """ops.rms_norm(out_dtype=f16) on bf16 rows: the normed rows in f16, rounded once from float32 (the reference's
    float32 result rounded to f16), the residual stream in bf16 as before."""
    from cobatch import ops
    g = torch.Generator().manual_seed(3)
    x, residual = (torch.randn(5, 48, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(48, generator=g)).to(DEVICE)
    normed, stream = ops.rms_norm(x, weight, 1e-5, residual, out_dtype=torch.float16)
    assert normed.dtype == torch.float16 and stream.dtype == torch.bfloat16
    h = (x.float() + residual.float()).to(torch.bfloat16).float()
    want = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.float()
    assert_matches(normed, want.to(torch.float16))
    assert_matches(stream, h.to(torch.bfloat16))


@pytest.mark.parametrize("order", [1, 2])
def test_rms_norm_writes_the_normed_rows_in_the_order_the_next_gemm_reads(order):
    """ops.rms_norm(out_order=...) stores each normed column where quant_pack.k_order puts it (the gather of the
    natural result through k_order, as x_operands' reference does), in whole 256-row tiles; the residual stream
    keeps the model's order."""
    from cobatch import ops
    from cobatch.kernels import operand_order, quant_pack
    g = torch.Generator().manual_seed(5)
    x, residual = (torch.randn(5, 96, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(96, generator=g)).to(DEVICE)
    natural, want_stream = rms_norm_ref(x, weight, 1e-5, residual, out_dtype=torch.float16)
    index = quant_pack.k_order(quant_pack.Q6_K if order == operand_order.BY_16 else quant_pack.Q8_0)
    want = natural.reshape(5, 3, 32)[:, :, index].reshape(5, 96)
    kernel_out = poisoned((5, 96), torch.float16)
    rms_norm_triton(x, weight, 1e-5, residual, out=kernel_out, order=order)      # the kernel (interpreted on CPU)
    normed, stream = ops.rms_norm(x, weight, 1e-5, residual, out_dtype=torch.float16, out_order=order)
    for got in (kernel_out, normed):     # to a bf16 ulp: the interpreter rounds the residual sum toward zero
        assert_matches(got[:, 32 + 3], natural[:, 32 + index[3]], dtype=torch.bfloat16)
        assert_matches(got, want, dtype=torch.bfloat16)
    assert torch.equal(stream, want_stream)
    if DEVICE != "cpu":
        assert normed.untyped_storage().nbytes() == 256 * 96 * 2


@requires_cuda
@pytest.mark.parametrize("rows", [1, 7, 2048])
def test_rms_norm_llama8b(rows):
    for dtype in (torch.bfloat16, torch.float32):
        check_rms_norm(rows, 4096, dtype, True, True, seed=rows)
        check_rms_norm(rows, 4096, dtype, False, False, seed=rows + 1)


# --- rope (and rope fused with the KV write) --------------------------------------------------------------

def make_caches(num_blocks: int, block_size: int, n_kv: int, head_dim: int, dtype, g) -> tuple[torch.Tensor, ...]:
    shape = (num_blocks, block_size, n_kv, head_dim)
    return (torch.randn(shape, generator=g).to(DEVICE, dtype), torch.randn(shape, generator=g).to(DEVICE, dtype))


def random_slots(rows: int, num_slots: int, g, skip_every: int = 4) -> torch.Tensor:
    """Distinct slots in random order, every skip_every-th row padded (-1)."""
    slots = torch.randperm(num_slots, generator=g)[:rows]
    slots[::skip_every] = -1
    return slots.to(DEVICE)


def check_rope(rows: int, n_q: int, n_kv: int, head_dim: int, rot: int, neox: bool, dtype, seed: int,
               fused_kv_write: bool, block_size: int = 16, cache_dtype=None) -> None:
    g = torch.Generator().manual_seed(seed)
    # q, k, v as strided views of one fused qkv output, as the model produces them.
    qkv = torch.randn(rows, (n_q + 2 * n_kv) * head_dim, generator=g).to(DEVICE, dtype)
    q = qkv[:, : n_q * head_dim].view(rows, n_q, head_dim)
    k = qkv[:, n_q * head_dim: (n_q + n_kv) * head_dim].view(rows, n_kv, head_dim)
    v = qkv[:, (n_q + n_kv) * head_dim:].view(rows, n_kv, head_dim)
    max_pos = 4096
    cos_sin = rope_cos_sin(rot, max_pos, 500000.0).to(DEVICE)
    positions = torch.randint(0, max_pos, (rows,), generator=g).to(DEVICE)
    ref_q, ref_k = rope_ref(q, k, positions, cos_sin, neox)
    if not fused_kv_write:
        got_q, got_k = rope_triton(q, k, positions, cos_sin, neox)
    else:
        num_blocks = (rows + block_size - 1) // block_size + 3
        k_cache, v_cache = make_caches(num_blocks, block_size, n_kv, head_dim, cache_dtype or dtype, g)
        k_cache[0, 0] = float("nan")     # poison: a skipped or mis-addressed slot shows up
        slots = random_slots(rows, num_blocks * block_size, g)
        ref_kc, ref_vc = k_cache.clone(), v_cache.clone()
        got_q, got_k = rope_triton(q, k, positions, cos_sin, neox, kv_write=(v, k_cache, v_cache, slots))
        # The cache holds exactly the rotated k the kernel returns (which matches ref_k within tolerance:
        # in f32 the GPU fuses multiply-adds where torch does not).
        kv_write_ref(got_k, v, ref_kc, ref_vc, slots)
        assert_same_cache(k_cache, ref_kc)
        assert_same_cache(v_cache, ref_vc)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()   # in place
    assert_matches(got_q, ref_q)
    assert_matches(got_k, ref_k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_rope_small(dtype, neox, fused):
    check_rope(rows=9, n_q=6, n_kv=3, head_dim=32, rot=32, neox=neox, dtype=dtype, seed=2, fused_kv_write=fused)


@pytest.mark.parametrize("neox", [False, True])
def test_rope_partial_rotary_small(neox):
    # rot < head_dim (phi/stablelm style), odd head counts, GQA group 7.
    check_rope(rows=5, n_q=7, n_kv=1, head_dim=40, rot=16, neox=neox, dtype=torch.bfloat16, seed=3,
               fused_kv_write=True)


@requires_cuda
@pytest.mark.parametrize("rows", [1, 64, 2048])
@pytest.mark.parametrize("neox", [False, True])
def test_rope_llama8b(rows, neox):
    check_rope(rows, 32, 8, 128, 128, neox, torch.bfloat16, seed=rows, fused_kv_write=False)
    check_rope(rows, 32, 8, 128, 128, neox, torch.bfloat16, seed=rows + 1, fused_kv_write=True)
    # an fp8 cache gets the rotated bf16 k, converted once (bitwise the reference's conversion on CUDA)
    check_rope(rows, 32, 8, 128, 128, neox, torch.bfloat16, seed=rows + 2, fused_kv_write=True,
               cache_dtype=torch.float8_e4m3fn)


# --- kv_write --------------------------------------------------------------------------------------------

def check_kv_write(rows: int, n_kv: int, head_dim: int, dtype, cache_dtype, seed: int, block_size: int = 16) -> None:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(rows, 2, n_kv, head_dim, generator=g).to(DEVICE, dtype)
    if cache_dtype == torch.float8_e4m3fn:
        # Values fp8 holds exactly: this checks where each value goes. How values round into fp8 is the
        # hardware's conversion (test_fp8_cache_write_saturates_and_rounds_to_nearest, on CUDA); Triton 3.6's
        # interpreter gets it wrong (1.953125 -> 1.0: a mantissa carry is lost).
        kv = kv.to(cache_dtype).to(dtype)
    k, v = kv[:, 0], kv[:, 1]                                    # strided views
    num_blocks = (rows + block_size - 1) // block_size + 2
    k_cache, v_cache = make_caches(num_blocks, block_size, n_kv, head_dim, cache_dtype, g)
    k_cache.view(-1)[::5] = float("nan")
    slots = random_slots(rows, num_blocks * block_size, g, skip_every=3)
    ref_kc, ref_vc = k_cache.clone(), v_cache.clone()
    kv_write_ref(k, v, ref_kc, ref_vc, slots)
    kv_write_triton(k, v, k_cache, v_cache, slots)
    assert_same_cache(k_cache, ref_kc)
    assert_same_cache(v_cache, ref_vc)


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                               (torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                               (torch.bfloat16, torch.float8_e4m3fn)])
def test_kv_write_small(dtype, cache_dtype):
    check_kv_write(rows=11, n_kv=3, head_dim=24, dtype=dtype, cache_dtype=cache_dtype, seed=4)


@requires_cuda
@pytest.mark.parametrize("rows", [1, 64, 2048])
def test_kv_write_llama8b(rows):
    check_kv_write(rows, 8, 128, torch.bfloat16, torch.bfloat16, seed=rows)
    check_kv_write(rows, 8, 128, torch.bfloat16, torch.float8_e4m3fn, seed=rows + 1)


@requires_cuda
@pytest.mark.parametrize("fused", [False, True])
def test_fp8_cache_write_saturates_and_rounds_to_nearest(fused):
    """An fp8 cache: values past the largest finite e4m3 (448) are stored as +-448, not NaN, by the reference
    and the kernels alike; values inside its range round to the nearest fp8 (3 mantissa bits)."""
    k = torch.tensor([[[1000.0, -3000.0, 448.0, 1.0 + 2 ** -4, 0.3, -1e-3, 460.0, 96.0]]])
    v = -k
    slots = torch.tensor([1])
    want = torch.tensor([448.0, -448.0, 448.0, 1.0, 0.3, -1e-3, 448.0, 96.0]).to(torch.float8_e4m3fn).float()
    assert want[:3].tolist() == [448.0, -448.0, 448.0] and want[3].item() == 1.0   # 1 + 1/16 ties to even
    for kc_dtype, write in (("ref", kv_write_ref), ("kernel", kv_write_triton)):
        kc = torch.zeros(2, 1, 1, 8, dtype=torch.float8_e4m3fn, device=DEVICE)
        vc = torch.zeros_like(kc)
        if write is kv_write_triton and fused:
            cos_sin = rope_cos_sin(8, 4, 10000.0).to(DEVICE)
            q = torch.zeros(1, 1, 8, device=DEVICE)
            # position 0: the rotation is the identity, so the cache gets k itself
            rope_triton(q, k.to(DEVICE).clone(), torch.zeros(1, dtype=torch.int64, device=DEVICE), cos_sin, False,
                        kv_write=(v.to(DEVICE), kc, vc, slots.to(DEVICE)))
        else:
            write(k.to(DEVICE), v.to(DEVICE), kc, vc, slots.to(DEVICE))
        assert torch.equal(kc[1, 0, 0].float().cpu(), want), kc_dtype
        assert torch.equal(vc[1, 0, 0].float().cpu(), -want), kc_dtype
        assert torch.equal(kc[0].float().cpu(), torch.zeros(1, 1, 8))


@pytest.mark.parametrize("neox", [False, True])
def test_rope_with_qk_norm_equals_the_norms_then_rope(neox):
    """qwen3's per-head q / k RMS norms done by the rope kernel, on strided views of one qkv output: the
    same as rms_norm (weights per head dim) and then rope, and the cache gets the normed, rotated k."""
    rows, n_q, n_kv, head_dim = 5, 6, 2, 64
    g = torch.Generator().manual_seed(31)
    qkv = (3 * torch.randn(rows, (n_q + 2 * n_kv) * head_dim, generator=g)).to(DEVICE, torch.bfloat16)
    q = qkv[:, :n_q * head_dim].view(rows, n_q, head_dim)
    k = qkv[:, n_q * head_dim:(n_q + n_kv) * head_dim].view(rows, n_kv, head_dim)
    v = qkv[:, (n_q + n_kv) * head_dim:].view(rows, n_kv, head_dim)
    qw, kw = (1 + 0.3 * torch.randn(head_dim, generator=g)).to(DEVICE, torch.bfloat16), \
        (1 + 0.3 * torch.randn(head_dim, generator=g)).to(DEVICE, torch.bfloat16)
    cos_sin = rope_cos_sin(head_dim, 512, 1e6).to(DEVICE)
    positions = torch.tensor([0, 7, 100, 511, 3], device=DEVICE)
    ref_q, ref_k = rope_ref(rms_norm_ref(q, qw, 1e-6)[0], rms_norm_ref(k, kw, 1e-6)[0], positions, cos_sin, neox)
    k_cache, v_cache = make_caches(2, 16, n_kv, head_dim, torch.bfloat16, g)
    slots = torch.tensor([3, -1, 20, 8, 31], device=DEVICE)
    ref_kc, ref_vc = k_cache.clone(), v_cache.clone()
    kv_write_ref(ref_k, v, ref_kc, ref_vc, slots)
    got_q, got_k = rope_triton(q, k, positions, cos_sin, neox, kv_write=(v, k_cache, v_cache, slots),
                               qk_norm=(qw, kw, 1e-6))
    assert_matches(got_q, ref_q)
    assert_matches(got_k, ref_k)
    assert_matches(k_cache, ref_kc)
    assert_same_cache(v_cache, ref_vc)


# --- silu_mul ---------------------------------------------------------------------------------------------

def check_silu_mul(rows: int, inter: int, dtype, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(rows, 2 * inter, generator=g)).to(DEVICE, dtype)
    out = gated_mul_triton(x, "silu", out=poisoned((rows, inter), dtype))
    assert_matches(out, gated_mul_ref(x, "silu"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_small(dtype):
    check_silu_mul(3, 1100, dtype, seed=5)     # 1100: two column blocks, the second partial


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_mul_small(dtype):
    x = torch.randn(3, 2 * 1100, generator=torch.Generator().manual_seed(6)).to(DEVICE, dtype)
    out = gated_mul_triton(x, "gelu_tanh", out=poisoned((3, 1100), dtype))
    assert_matches(out, gated_mul_ref(x, "gelu_tanh"))
    # The reference is tanh-GELU: 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) times up.
    g, up = x[:, :1100].float(), x[:, 1100:].float()
    want = 0.5 * g * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (g + 0.044715 * g ** 3))) * up
    assert torch.allclose(gated_mul_ref(x, "gelu_tanh").float(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gated_mul_reads_the_interleaved_layout(act):
    """Interleaved gate|up: columns 16 j + i are gate column 8 j + i and 16 j + 8 + i its up (i < 8). The same
    values laid out both ways give the same result, in the reference and in the kernel."""
    inter = 1104                                     # 2 column blocks of the kernel, the second partial
    g = torch.Generator().manual_seed(9)
    gate, up = (2 * torch.randn(3, inter, generator=g)).bfloat16(), (2 * torch.randn(3, inter, generator=g)).bfloat16()
    plain = torch.cat([gate, up], -1)
    inter8 = torch.empty(3, 2 * inter, dtype=torch.bfloat16)
    for j in range(inter // 8):
        inter8[:, 16 * j:16 * j + 8] = gate[:, 8 * j:8 * j + 8]
        inter8[:, 16 * j + 8:16 * j + 16] = up[:, 8 * j:8 * j + 8]
    want = gated_mul_ref(plain, act)
    assert torch.equal(gated_mul_ref(inter8, act, interleaved=True), want)
    out = gated_mul_triton(inter8.to(DEVICE), act, out=poisoned((3, inter), torch.bfloat16), interleaved=True)
    assert_matches(out, gated_mul_triton(plain.to(DEVICE), act))


@requires_cuda
@pytest.mark.parametrize("rows", [1, 64, 2048])
def test_silu_mul_llama8b(rows):
    check_silu_mul(rows, 14336, torch.bfloat16, seed=rows)


# --- programmatic dependent launch ----------------------------------------------------------------------------

@requires_cuda
def test_pdl_chain_waits_for_each_input(monkeypatch):
    """silu_mul -> rms_norm (+ residual, in place) -> rope on the norm's output, each reading what the previous
    one wrote, captured in one CUDA graph and launched as programmatic dependents: every replay equals the
    chain run eagerly without PDL. The intermediates are NaN-poisoned before each replay, so a kernel that
    read its input (or wrote) before its wait would show up."""
    from cobatch.kernels.triton_support import pdl_launch
    rows, inter, hidden = 5, 14336, 4096
    g = torch.Generator().manual_seed(11)
    x = torch.randn(rows, 2 * inter, generator=g).to("cuda", torch.bfloat16)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to("cuda")
    res = torch.randn(rows, hidden, generator=g).to("cuda", torch.bfloat16)
    pos = torch.tensor([0, 3, 17, 400, 4095], device="cuda")
    cs = rope_cos_sin(128, 4096, 500000.0).to("cuda")
    act = torch.empty(rows, inter, device="cuda", dtype=torch.bfloat16)
    normed = torch.empty(rows, hidden, device="cuda", dtype=torch.bfloat16)
    assert pdl_launch(x)["PDL"]

    def chain(x, res):
        gated_mul_triton(x, "silu", out=act)
        rms_norm_triton(act[:, :hidden], w, 1e-5, res, out=normed, residual_out=res)
        q = normed.view(rows, 32, 128)
        rope_triton(q[:, :24], q[:, 24:], pos, cs, neox=False)
        return normed, res

    res0 = res.clone()
    chain(x, res.clone())
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain(x, res)
    for seed in range(3):
        x.copy_(torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(seed)).to(x))
        res.copy_(res0)
        act.fill_(float("nan"))
        normed.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        got_normed, got_res = normed.clone(), res.clone()
        monkeypatch.setenv("COBATCH_PDL", "0")
        want_normed, want_res = (t.clone() for t in chain(x.clone(), res0.clone()))
        monkeypatch.delenv("COBATCH_PDL")
        assert torch.isfinite(want_normed).all()
        assert torch.equal(got_normed, want_normed) and torch.equal(got_res, want_res), seed


# --- ops dispatch ---------------------------------------------------------------------------------------------

def test_ops_small_ops_match_references():
    """ops.* picks Triton on CUDA and the reference on the CPU; either way the results match the reference."""
    from cobatch import ops
    g = torch.Generator().manual_seed(6)
    x = torch.randn(4, 64, generator=g).to(DEVICE, torch.bfloat16)
    res = torch.randn(4, 64, generator=g).to(DEVICE, torch.bfloat16)
    w = torch.rand(64, generator=g).to(DEVICE)
    ref_out, ref_h = rms_norm_ref(x, w, 1e-6, res)
    out, h = ops.rms_norm(x, w, 1e-6, res.clone())
    assert_matches(out, ref_out)
    assert_matches(h, ref_h)
    res2 = res.clone()
    out, h = ops.rms_norm(x, w, 1e-6, res2, inplace_residual=True)
    assert h.data_ptr() == res2.data_ptr()
    assert_matches(out, ref_out)
    assert_matches(res2, ref_h)
    assert_matches(ops.gated_mul(x), gated_mul_ref(x, "silu"))

    q = torch.randn(3, 4, 32, generator=g).to(DEVICE, torch.bfloat16)
    k = torch.randn(3, 2, 32, generator=g).to(DEVICE, torch.bfloat16)
    v = torch.randn(3, 2, 32, generator=g).to(DEVICE, torch.bfloat16)
    pos = torch.tensor([5, 0, 77], device=DEVICE)
    cs = rope_cos_sin(32, 128, 10000.0).to(DEVICE)
    ref_q, ref_k = rope_ref(q, k, pos, cs, False)
    k_cache, v_cache = make_caches(2, 16, 2, 32, torch.bfloat16, g)
    ref_kc, ref_vc = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([3, -1, 20], device=DEVICE)
    kv_write_ref(ref_k, v, ref_kc, ref_vc, slots)
    got_q, got_k = ops.rope_kv_write(q.clone(), k.clone(), v, pos, cs, False, k_cache, v_cache, slots)
    assert_matches(got_q, ref_q)
    assert_matches(got_k, ref_k)
    assert_matches(k_cache, ref_kc)
    assert_same_cache(v_cache, ref_vc)
    got_q, got_k = ops.rope(q.clone(), k.clone(), pos, cs, False)
    assert_matches(got_q, ref_q)
    assert_matches(got_k, ref_k)
    kc2, vc2 = k_cache.clone(), v_cache.clone()
    ops.kv_write(got_k, v, kc2, vc2, slots)
    assert_same_cache(kc2, k_cache)
    assert_same_cache(vc2, v_cache)


# --- the CPU path's linear ----------------------------------------------------------------------------------

@pytest.mark.parametrize("rows", [1, 2, 8, 16, 17])
def test_cpu_linear_equals_the_float64_product_for_every_batch_shape(rows):
    """Decode steps of up to 16 rows run as weight @ x.T (one row padded to two), longer ones as F.linear: both
    are f32 products of the same values, within f32 rounding of the float64 product, and `out` may be a column
    slice of a wider matrix."""
    from cobatch import ops
    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(96, 160, generator=g), torch.randn(rows, 160, generator=g)
    want = x.double() @ w.double().T
    got = ops.linear(x, w)
    assert got.shape == (rows, 96) and got.is_contiguous()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    wide = torch.full((rows, 200), float("nan"))
    ops.linear(x, w, out=wide[:, 50:146])
    assert torch.equal(wide[:, 50:146], got) and wide[:, :50].isnan().all() and wide[:, 146:].isnan().all()
