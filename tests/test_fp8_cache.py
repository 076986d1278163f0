"""An fp8 KV cache on GPUs whose Triton has no e4m3 (Ampere): kernels/fp8_cache.py's integer conversions.

COBATCH_SOFT_FP8=1 takes the way an A100 takes: the cache as its bytes, values encoded by integer rounding and widened
by bit moves. In the interpreter (CPU), or compiled on a GPU: checked against torch's own e4m3 (every f16 value, the
rounding ties, saturation, subnormals, signed zeros), and the kernels that write and read a cache against themselves
on the native way: the same bytes and the same outputs. On a GPU with e4m3, also at a real shape against its native
conversions. tests/test_kernels_compile.py compiles them for sm_80.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from cobatch.batch import AttentionMetadata  # noqa: E402
from cobatch.kernels import fp8_cache  # noqa: E402
from cobatch.kernels.attention import DECODE_CONFIG, paged_decode_attention, paged_prefill_attention  # noqa: E402
from cobatch.kernels.kv_write import kv_write_triton, to_cache_dtype  # noqa: E402
from cobatch.kernels.mla_attention import mla_decode_attention  # noqa: E402
from cobatch.kernels.mla_latent import mla_latent_ref, mla_latent_triton  # noqa: E402
from cobatch.kernels.rope import rope_cos_sin, rope_ref, rope_triton  # noqa: E402
from cobatch.kernels.triton_support import jit, tl  # noqa: E402
from conftest import requires_cuda  # noqa: E402
from kernel_checks import DEVICE  # noqa: E402

FP8 = torch.float8_e4m3fn


@jit
def _codes_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n, other=0.0)
    tl.store(out_ptr + i, fp8_cache.e4m3_codes(x), mask=i < n)


@jit
def _widen_kernel(w_ptr, out_ptr, MODE: tl.constexpr, N: tl.constexpr, W: tl.constexpr):
    r = tl.arange(0, N)[:, None]
    w = tl.load(w_ptr + r * W + tl.arange(0, W)[None, :])
    tl.store(out_ptr + r * (4 * W) + tl.arange(0, 4 * W)[None, :], fp8_cache.widen_words(w, MODE))


def codes(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.numel(), dtype=torch.uint8, device=DEVICE)
    _codes_kernel[(triton_cdiv(x.numel(), 1024),)](x.float().contiguous().to(DEVICE), out, x.numel(), BLOCK=1024)
    return out.cpu()


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def test_encoding_matches_torch_on_every_f16_value_and_saturates():
    """Every finite f16 (so every rounding tie at e4m3's precision, subnormals and both zeros), then values past
    the largest e4m3: the bytes of kv_write.to_cache_dtype (torch's e4m3 after clamping at +-448)."""
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16)
    every = every[torch.isfinite(every)].float()
    big = torch.tensor([448.0, 449.0, 463.9, 464.0, 480.0, 1e4, 3.4e38, -448.5, -1e30])
    tiny = torch.tensor([2.0 ** -10, 2.0 ** -10 * 1.0001, 3 * 2.0 ** -10, 2.0 ** -6 * (1 - 2 ** -5), 2.0 ** -6,
                         -2.0 ** -9, 1e-30, -0.0])
    for x in (every, big, tiny):
        want = to_cache_dtype(x, FP8).view(torch.uint8)
        got = codes(x)
        bad = (got != want).nonzero().flatten()
        assert bad.numel() == 0, [(x[i].item(), got[i].item(), want[i].item()) for i in bad[:8]]


def test_bit_moves_widen_every_byte_as_the_conversion_does():
    """BITS (integer moves, times 256) against BYTES (Triton's e4m3): each of the 254 non-NaN bytes, in every
    position of a word."""
    values = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    words = values[torch.randperm(values.numel(), generator=torch.Generator().manual_seed(0))]
    words = torch.cat([words, values[:2]]).view(torch.int32).view(64, 1).to(DEVICE)   # 256 bytes as 64 words
    want = values.view(FP8).float()
    outs = {}
    for mode in (fp8_cache.BYTES, fp8_cache.BITS):
        out = torch.empty(64, 4, dtype=torch.float16, device=DEVICE)
        _widen_kernel[(1,)](words, out, MODE=mode, N=64, W=1)
        outs[mode] = out.cpu()
    assert torch.equal(outs[fp8_cache.BITS], outs[fp8_cache.BYTES])
    assert torch.equal(outs[fp8_cache.BYTES].flatten()[:254].float().sort().values, want.sort().values)


def test_without_native_e4m3_the_kernels_get_bytes_and_words(monkeypatch):
    cache = torch.zeros(2, 16, 1, 64, dtype=FP8)
    assert fp8_cache.kernel_view(cache) is cache and fp8_cache.words_mode(cache, 64, enabled=False) == 0
    monkeypatch.setenv("COBATCH_SOFT_FP8", "1")
    view = fp8_cache.kernel_view(cache)
    assert view.dtype == torch.uint8 and view.data_ptr() == cache.data_ptr() and view.shape == cache.shape
    assert fp8_cache.words_mode(cache, 64, enabled=False) == fp8_cache.BITS       # words are the only way
    with pytest.raises(ValueError, match="whole 32-bit words"):
        fp8_cache.words_mode(cache, 62, enabled=True)
    bf16 = torch.zeros(2, 16, 1, 64, dtype=torch.bfloat16)
    assert fp8_cache.kernel_view(bf16) is bf16 and fp8_cache.words_mode(bf16, 64, enabled=True) == 0


def _both_ways(monkeypatch, run):
    """run() natively, then as an A100 would (COBATCH_SOFT_FP8=1)."""
    monkeypatch.delenv("COBATCH_SOFT_FP8", raising=False)
    native = run()
    monkeypatch.setenv("COBATCH_SOFT_FP8", "1")
    return native, run()


def test_writes_on_bytes_store_the_reference_bytes(monkeypatch):
    """kv_write, rope's fused write and MLA's latent write into an fp8 cache on its bytes: exactly
    kv_write.to_cache_dtype's e4m3 (round to nearest even, +-448 at most). (The interpreter's own e4m3
    conversion rounds ties up and can lose a carry, so the native way is checked on the GPU: test_kernels_small.py
    and the CUDA test below.)"""
    monkeypatch.setenv("COBATCH_SOFT_FP8", "1")
    g = torch.Generator().manual_seed(3)
    k = (torch.randn(20, 2, 32, generator=g) * 3).to(DEVICE)
    v = (torch.randn(20, 2, 32, generator=g) * 300).to(DEVICE)
    slots = torch.randperm(32, generator=g)[:20].to(DEVICE)
    kc = torch.zeros(2, 16, 2, 32, dtype=FP8, device=DEVICE)
    vc = torch.zeros_like(kc)
    kv_write_triton(k, v, kc, vc, slots)
    assert torch.equal(kc.view(-1, 2, 32)[slots].view(torch.uint8), to_cache_dtype(k, FP8).view(torch.uint8))
    assert torch.equal(vc.view(-1, 2, 32)[slots].view(torch.uint8), to_cache_dtype(v, FP8).view(torch.uint8))
    assert vc.float().abs().max() == 448.0

    q = torch.randn(20, 4, 32, generator=g).to(DEVICE)
    cos_sin = rope_cos_sin(32, 64, 10000.0).to(DEVICE)
    positions = torch.arange(20, device=DEVICE)
    kc2, vc2 = torch.zeros_like(kc), torch.zeros_like(vc)
    rope_triton(q.clone(), k.clone(), positions, cos_sin, False, kv_write=(v, kc2, vc2, slots))
    wide_k, wide_v = (torch.zeros(2, 16, 2, 32, device=DEVICE) for _ in range(2))    # the kernel's rotated k, unrounded
    rope_triton(q.clone(), k.clone(), positions, cos_sin, False, kv_write=(v, wide_k, wide_v, slots))
    assert torch.equal(kc2.view(torch.uint8), to_cache_dtype(wide_k, FP8).view(torch.uint8))
    assert torch.equal(vc2.view(torch.uint8), vc.view(torch.uint8))
    k_rot = rope_ref(q, k, positions, cos_sin, False)[1]
    assert torch.allclose(wide_k.view(-1, 2, 32)[slots], k_rot, atol=1e-4)

    rank, rope, heads = 32, 16, 4
    kv_a = torch.randn(20, rank + rope, generator=g).to(DEVICE)
    q_rope = torch.randn(20, heads, rope, generator=g).to(DEVICE)
    weight = (1 + 0.1 * torch.randn(rank, generator=g)).to(DEVICE)
    cs = rope_cos_sin(rope, 64, 10000.0).to(DEVICE)
    latent = torch.zeros(3, 16, 1, rank + rope, dtype=FP8, device=DEVICE)
    wide = torch.zeros(3, 16, 1, rank + rope, dtype=torch.float32, device=DEVICE)   # the kernel's values, unrounded
    mla_latent_triton(q_rope, kv_a, weight, 1e-6, positions, cs, False, latent, slots)
    mla_latent_triton(q_rope, kv_a, weight, 1e-6, positions, cs, False, wide, slots)
    assert torch.equal(latent.view(torch.uint8), to_cache_dtype(wide, FP8).view(torch.uint8))
    ref = torch.zeros_like(wide)
    mla_latent_ref(q_rope, kv_a, weight, 1e-6, positions, cs, False, ref, slots)
    assert torch.allclose(wide, ref, atol=1e-5) and latent.float().abs().sum() > 0


def assert_same_outputs(native: torch.Tensor, soft: torch.Tensor) -> None:
    """The same widened values give the same outputs: to the bit in the interpreter; compiled, the two ways' loads
    may lead Triton to other MMA forms, whose sums can round apart in the last bits."""
    if native.is_cuda:
        torch.testing.assert_close(soft, native, rtol=2e-3, atol=1e-5)
    else:
        assert torch.equal(native, soft)


def test_attention_on_bytes_equals_the_native_kernels(monkeypatch):
    """Decode and prefill attention over one fp8 cache, its words widened by bit moves or by Triton's e4m3: the
    same f16 values, so the same outputs (assert_same_outputs)."""
    g = torch.Generator().manual_seed(3)
    n_kv, head_dim, page, seq_lens = 2, 32, 16, [5, 37, 20]
    blocks = [-(-n // page) for n in seq_lens]
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    b = 0
    for r, nb in enumerate(blocks):
        tables[r, :nb] = torch.arange(b, b + nb)
        b += nb
    kc = (torch.randn(b, page, n_kv, head_dim, generator=g) * 3).to(DEVICE, FP8)
    vc = (torch.randn(b, page, n_kv, head_dim, generator=g) * 3).to(DEVICE, FP8)
    q_dec = torch.randn(len(seq_lens), 4, head_dim, generator=g).to(DEVICE)
    q_pre = torch.randn(sum(seq_lens), 4, head_dim, generator=g).to(DEVICE)
    starts = torch.tensor([0] + seq_lens).cumsum(0).to(DEVICE, torch.int32)
    lens, tables = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), tables.to(DEVICE)
    dec = AttentionMetadata(torch.zeros(3, dtype=torch.int64, device=DEVICE),
                            torch.arange(4, dtype=torch.int32, device=DEVICE), lens, tables, 1, max(seq_lens))
    pre = AttentionMetadata(torch.zeros(sum(seq_lens), dtype=torch.int64, device=DEVICE), starts, lens, tables,
                            max(seq_lens), max(seq_lens))

    def run():
        return (paged_decode_attention(q_dec, kc, vc, dec, head_dim ** -0.5, cfg=DECODE_CONFIG),
                paged_prefill_attention(q_pre, kc, vc, pre, head_dim ** -0.5))

    native, soft = _both_ways(monkeypatch, run)
    assert_same_outputs(native[0], soft[0])
    assert_same_outputs(native[1], soft[1])
    assert native[0].abs().sum() > 0 and native[1].abs().sum() > 0


def test_mla_decode_on_bytes_equals_the_native_kernel(monkeypatch):
    g = torch.Generator().manual_seed(4)
    lat, rope, page, seq_lens = 32, 16, 16, [3, 40]
    cache = (torch.randn(6, page, 1, lat + rope, generator=g) * 2).to(DEVICE, FP8)
    tables = torch.tensor([[0, 0, 0], [3, 1, 5]], dtype=torch.int32, device=DEVICE)
    meta = AttentionMetadata(torch.zeros(2, dtype=torch.int64, device=DEVICE),
                             torch.arange(3, dtype=torch.int32, device=DEVICE),
                             torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), tables, 1, max(seq_lens))
    q = torch.randn(2, 4, lat + rope, generator=g).to(DEVICE)
    native, soft = _both_ways(monkeypatch, lambda: mla_decode_attention(q, cache, meta, 0.3, lat, cuda=False))
    assert_same_outputs(native, soft)
    assert native.abs().sum() > 0


@requires_cuda
def test_on_a_gpu_the_bytes_way_equals_the_native_one(monkeypatch):
    """Llama-3-8B's KV heads: kv_write then decode attention at 64 rows of 700 tokens, natively and on the cache's
    bytes (COBATCH_SOFT_FP8=1, as an A100 runs them): the same cache bytes (round to nearest even, saturating, both
    ways) and the same outputs (assert_same_outputs)."""
    g = torch.Generator(device="cuda").manual_seed(6)
    rows, n_kv, head_dim, page, ctx = 64, 8, 128, 16, 700
    blocks = -(-ctx // page)
    tables = torch.arange(rows * blocks, dtype=torch.int32, device="cuda").view(rows, blocks)
    slots = (tables.long()[:, :, None] * page + torch.arange(page, device="cuda")).view(rows, -1)[:, :ctx].flatten()
    k = torch.randn(len(slots), n_kv, head_dim, device="cuda", generator=g) * 100
    v = torch.randn(len(slots), n_kv, head_dim, device="cuda", generator=g) * 3
    q = torch.randn(rows, 32, head_dim, device="cuda", generator=g, dtype=torch.bfloat16)
    lens = torch.full((rows,), ctx, dtype=torch.int32, device="cuda")
    meta = AttentionMetadata(torch.zeros(rows, dtype=torch.int64, device="cuda"),
                             torch.arange(rows + 1, dtype=torch.int32, device="cuda"), lens, tables, 1, ctx)

    def run():
        kc = torch.zeros(rows * blocks, page, n_kv, head_dim, dtype=FP8, device="cuda")
        vc = torch.zeros_like(kc)
        kv_write_triton(k, v, kc, vc, slots)
        out = paged_decode_attention(q, kc, vc, meta, head_dim ** -0.5, cfg=DECODE_CONFIG)
        return kc.view(torch.uint8).clone(), vc.view(torch.uint8).clone(), out

    native, soft = _both_ways(monkeypatch, run)
    assert torch.equal(native[0], soft[0]) and torch.equal(native[1], soft[1])
    assert torch.equal(native[0].view(-1, n_kv, head_dim)[slots], to_cache_dtype(k, FP8).view(torch.uint8))
    assert_same_outputs(native[2], soft[2])
    assert torch.isfinite(native[2]).all()
