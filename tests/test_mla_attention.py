"""MLA decode and prefill attention over the latent paged cache (kernels/mla_attention.py) against their torch
reference, and the reference's absorbed form against attention over the decompressed keys and values
(paged_attention_ref).

Tiny shapes run in the Triton interpreter on the CPU, with small tiles so that several tiles, splits and pages are
crossed; DeepSeek's shapes (latent 512, rope 64, 16 and 128 heads) run on CUDA only.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton")

from cobatch.batch import AttentionMetadata  # noqa: E402
from cobatch.kernels.attention import DecodeConfig, paged_attention_ref  # noqa: E402
from cobatch.kernels.mla_attention import (MlaPrefillConfig, mla_attention_ref, mla_decode_attention,  # noqa: E402
                                           mla_prefill_attention)
from conftest import requires_cuda  # noqa: E402
from kernel_checks import paged_setup, poisoned, relative_error  # noqa: E402

SINGLE = DecodeConfig(block_n=16, min_split=1024)
SPLIT = DecodeConfig(block_n=16, min_split=16, max_splits=8, programs_per_sm=64)


def latent_setup(seq_lens, n_heads, lat, rope, dtype, seed, block_size=16, capacity=None, q_lens=None):
    """Random absorbed queries [rows, H, lat + rope] (one row per sequence, or q_lens), a random latent cache of
    one head, and each sequence's blocks scattered over the pool (paged_setup's, with one KV head as wide as the
    query)."""
    q, cache, _, meta = paged_setup(seq_lens, q_lens or [1] * len(seq_lens), n_heads, 1, lat + rope, dtype, seed,
                                    block_size=block_size, capacity=capacity)
    return q, cache, meta


def test_absorbed_reference_is_attention_over_the_decompressed_keys_and_values():
    """DeepSeek's MLA as its model code writes it (keys = [W_UK c ; k_rope], values = W_UV c, per head) equals the
    absorbed form (q_lat = q_nope W_UK, out = out_lat W_UV^T) that the kernel computes (both references compute in
    float32)."""
    g = torch.Generator().manual_seed(1)
    n_heads, lat, rope, nope, v_dim = 4, 32, 8, 12, 10
    q, cache, meta = latent_setup([5, 23, 40], n_heads, lat, rope, torch.float64, seed=2)
    w_uk = torch.randn(n_heads, nope, lat, generator=g, dtype=torch.float64).to(q.device)
    w_uv = torch.randn(n_heads, v_dim, lat, generator=g, dtype=torch.float64).to(q.device)
    q_nope = torch.randn(3, n_heads, nope, generator=g, dtype=torch.float64).to(q.device)
    q_rope = q[..., lat:]
    scale = (nope + rope) ** -0.5
    c, k_rope = cache[..., :lat], cache[..., lat:]                 # [blocks, page, 1, .]
    # decompressed: one KV head per query head (MHA), keys nope + rope wide, values padded to the keys' width
    k_heads = torch.cat([torch.einsum("bpol,hnl->bphn", c, w_uk), k_rope.expand(-1, -1, n_heads, -1)], -1)
    v_heads = torch.einsum("bpol,hvl->bphv", c, w_uv)
    v_heads = torch.nn.functional.pad(v_heads, (0, nope + rope - v_dim))
    want = paged_attention_ref(torch.cat([q_nope, q_rope], -1), k_heads, v_heads, meta, scale)[..., :v_dim]
    q_lat = torch.einsum("shn,hnl->shl", q_nope, w_uk)
    out_lat = mla_attention_ref(torch.cat([q_lat, q_rope], -1), cache, meta, scale, lat).double()
    got = torch.einsum("shl,hvl->shv", out_lat, w_uv)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cfg,dtype", [(SPLIT, torch.float32), (SINGLE, torch.bfloat16)], ids=["split", "single"])
def test_decode_matches_reference(cfg, dtype):
    """Rows of one token, of a page and a bit, of several splits, and an empty (padded) row; 20 heads in two
    blocks of 16, the second one partly masked; the rope part padded from 8 to 16."""
    q, cache, meta = latent_setup([1, 17, 50, 0], 20, 16, 8, dtype, seed=3)
    ref = mla_attention_ref(q, cache, meta, 0.3, 16)
    got = mla_decode_attention(q, cache, meta, 0.3, 16, out=poisoned((4, 20, 16), dtype), cfg=cfg)
    assert torch.isfinite(got).all()
    assert torch.equal(got[3], torch.zeros_like(got[3]))
    assert relative_error(got, ref) < {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]


def test_a_row_has_the_same_bits_alone_and_batched():
    """Up to DecodeConfig.invariant_rows rows split as one row does: a row's output does not depend on its
    neighbours (speculative drafts, batched sessions)."""
    q, cache, meta = latent_setup([50, 5], 16, 16, 8, torch.float32, seed=4)
    batched = mla_decode_attention(q, cache, meta, 0.3, 16, cfg=SPLIT)
    for r in range(2):
        alone = AttentionMetadata(meta.slot_mapping[r:r + 1], meta.query_start[:2], meta.seq_lens[r:r + 1],
                                  meta.block_tables[r:r + 1], 1, meta.max_seq_len)
        assert torch.equal(mla_decode_attention(q[r:r + 1], cache, alone, 0.3, 16, cfg=SPLIT), batched[r:r + 1]), r


# prefill: small query blocks so that a chunk spans several token tiles and head blocks
PREFILL_SMALL = MlaPrefillConfig(rows=16, block_h=8, block_n=16, num_warps=4)


def test_query_parts_apart_give_the_bits_of_the_whole_query():
    """The model hands the kernels q_latent and q_rope as two tensors (no concatenation), q_latent as a transposed
    view of a [heads, rows, rank] product: the same bits as the concatenated query, from both kernels."""
    q, cache, meta = latent_setup([1, 17, 50, 0], 20, 16, 8, torch.bfloat16, seed=3)
    q_latent, q_rope = q[..., :16].transpose(0, 1).contiguous().transpose(0, 1), q[..., 16:]
    assert not q_latent.is_contiguous() and not q_rope.is_contiguous()
    assert torch.equal(mla_decode_attention(q_latent, cache, meta, 0.3, 16, cfg=SPLIT, q_rope=q_rope),
                       mla_decode_attention(q, cache, meta, 0.3, 16, cfg=SPLIT))
    assert torch.equal(mla_prefill_attention(q_latent, cache, meta, 0.3, 16, cfg=PREFILL_SMALL, q_rope=q_rope),
                       mla_prefill_attention(q, cache, meta, 0.3, 16, cfg=PREFILL_SMALL))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_matches_reference(dtype):
    """Chunks of 1 to 21 rows over contexts that start before the chunk (a later chunk of a prompt), a whole
    prompt, a decode row among them and a sequence without rows in the step; 12 heads in two blocks of 8, the
    second partly masked; rope padded from 8 to 16."""
    seq_lens, q_lens = [21, 40, 5, 23, 9], [21, 12, 1, 0, 9]
    q, cache, meta = latent_setup(seq_lens, 12, 16, 8, dtype, seed=6, q_lens=q_lens)
    ref = mla_attention_ref(q, cache, meta, 0.3, 16)
    got = mla_prefill_attention(q, cache, meta, 0.3, 16, cfg=PREFILL_SMALL)
    assert got.dtype == dtype and torch.isfinite(got).all()
    assert relative_error(got, ref) < {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    # a row does not depend on the other rows of its step: the whole prompt alone gives the same bits
    alone = AttentionMetadata(meta.slot_mapping[:21], meta.query_start[:2], meta.seq_lens[:1],
                              meta.block_tables[:1], 21, meta.max_seq_len)
    assert torch.equal(mla_prefill_attention(q[:21], cache, alone, 0.3, 16, cfg=PREFILL_SMALL), got[:21])


FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("words", [True, False], ids=["words", "bytes"])
def test_an_fp8_cache_is_widened_for_both_kernels(words):
    """--kv-cache-dtype fp8 on a DeepSeek model: the latent rows stored in e4m3 (mla_latent writes them so), read
    as 32-bit words or as bytes and widened to f16 with the queries; against the reference on the same fp8
    values. The bound is f16's rounding of q and of the products."""
    q, cache, meta = latent_setup([1, 17, 50, 0], 20, 16, 8, torch.bfloat16, seed=3)
    cache = cache.to(FP8)
    ref = mla_attention_ref(q, cache, meta, 0.3, 16)
    for cfg in (SINGLE, SPLIT):
        got = mla_decode_attention(q, cache, meta, 0.3, 16, out=poisoned((4, 20, 16), torch.bfloat16),
                                   cfg=replace(cfg, fp8_words=words))
        assert torch.equal(got[3], torch.zeros_like(got[3])) and relative_error(got, ref) < 1e-2
    seq_lens, q_lens = [21, 40, 5], [21, 12, 1]
    q, cache, meta = latent_setup(seq_lens, 12, 16, 8, torch.bfloat16, seed=6, q_lens=q_lens)
    cache = cache.to(FP8)
    got = mla_prefill_attention(q, cache, meta, 0.3, 16, cfg=replace(PREFILL_SMALL, fp8_words=words))
    assert relative_error(got, mla_attention_ref(q, cache, meta, 0.3, 16)) < 1e-2


def test_prefill_by_work_list_gives_the_bits_of_the_full_grid():
    """Over attention.prefill_work's list (tiles of 8 rows, each four of the kernel's 2-row token tiles; padded
    with -1 items, as a graph's fixed grid is) the kernel stores what the grid of every sequence times its longest
    chunk's tiles stores, and nothing in the rows past the step's."""
    from cobatch.kernels.attention import PrefillConfig, prefill_work, prefill_work_items
    seq_lens, q_lens = [21, 40, 5, 0, 9], [21, 12, 1, 0, 9]
    q, cache, meta = latent_setup(seq_lens, 12, 16, 8, torch.bfloat16, seed=8, q_lens=q_lens)
    tiles = PrefillConfig(block_m=8)
    want = mla_prefill_attention(q, cache, meta, 0.3, 16, out=poisoned(q.shape[:2] + (16,), torch.bfloat16),
                                 cfg=PREFILL_SMALL)
    work = prefill_work(meta.query_start.tolist(), seq_lens,
                        items=prefill_work_items(q.shape[0], len(seq_lens), tiles) + 3, cfg=tiles)
    listed = replace(meta, prefill_work=torch.tensor(work, dtype=torch.int32, device=q.device))
    got = mla_prefill_attention(q, cache, listed, 0.3, 16, out=want.clone(), cfg=PREFILL_SMALL, work_rows=8)
    assert torch.equal(got, want)
    fresh = mla_prefill_attention(q, cache, listed, 0.3, 16, cfg=PREFILL_SMALL, work_rows=8)
    assert torch.equal(fresh, want)
    assert relative_error(fresh, mla_attention_ref(q, cache, meta, 0.3, 16)) < 1e-2


def test_prefill_of_padded_rows_stays_zero():
    """Rows past query_start[-1] (a step padded to a bucket) come out as zeros, as the reference's do."""
    q, cache, meta = latent_setup([10, 4], 4, 16, 8, torch.float32, seed=7, q_lens=[6, 4])
    padded = torch.cat([q, q.new_ones(3, 4, 24)])
    got = mla_prefill_attention(padded, cache, meta, 0.5, 16, cfg=PREFILL_SMALL)
    assert torch.equal(got[10:], q.new_zeros(3, 4, 16))
    assert relative_error(got[:10], mla_attention_ref(q, cache, meta, 0.5, 16)) < 1e-5


@requires_cuda
@pytest.mark.parametrize("n_heads", [16, 128])
@pytest.mark.parametrize("seq_lens", [[1], [512] * 8, [4000, 17, 900, 8192]])
def test_deepseek_shapes_on_the_gpu(n_heads, seq_lens):
    """DeepSeek-V2-Lite (16 heads) and V3 (128) latent shapes, bf16, the default plan (PDL, splits)."""
    q, cache, meta = latent_setup(seq_lens, n_heads, 512, 64, torch.bfloat16, seed=5, block_size=64)
    ref = mla_attention_ref(q, cache, meta, 192 ** -0.5, 512)
    got = mla_decode_attention(q, cache, meta, 192 ** -0.5, 512)
    assert relative_error(got, ref) < 1e-2


@requires_cuda
@pytest.mark.parametrize("n_heads", [16, 128])
def test_deepseek_shapes_with_an_fp8_cache_on_the_gpu(n_heads):
    """The same latent shapes in an fp8 cache (decode: the CUDA split kernel's fp8 rows on Hopper, their own tests in
    test_mla_decode_cuda.py), decode and prefill, against the reference on the same fp8 values."""
    seq_lens, q_lens = [4000, 17, 900, 8192], [1, 1, 1, 1]
    q, cache, meta = latent_setup(seq_lens, n_heads, 512, 64, torch.bfloat16, seed=5, block_size=64, q_lens=q_lens)
    cache = cache.to(FP8)
    ref = mla_attention_ref(q, cache, meta, 192 ** -0.5, 512)
    assert relative_error(mla_decode_attention(q, cache, meta, 192 ** -0.5, 512), ref) < 1e-2
    seq_lens, q_lens = [700, 300, 1], [300, 300, 1]
    q, cache, meta = latent_setup(seq_lens, n_heads, 512, 64, torch.bfloat16, seed=8, block_size=64, q_lens=q_lens)
    cache = cache.to(FP8)
    ref = mla_attention_ref(q, cache, meta, 192 ** -0.5, 512)
    assert relative_error(mla_prefill_attention(q, cache, meta, 192 ** -0.5, 512), ref) < 1e-2


@requires_cuda
@pytest.mark.parametrize("n_heads", [16, 128])
def test_deepseek_prefill_shapes_on_the_gpu(n_heads):
    """A 2048-row chunk after 2048 cached rows, a 300-row prompt and decode rows, at DeepSeek's latent shapes,
    bf16, the default config."""
    seq_lens, q_lens = [4096, 300, 700, 1], [2048, 300, 1, 1]
    q, cache, meta = latent_setup(seq_lens, n_heads, 512, 64, torch.bfloat16, seed=8, block_size=64, q_lens=q_lens)
    ref = mla_attention_ref(q, cache, meta, 192 ** -0.5, 512)
    got = mla_prefill_attention(q, cache, meta, 192 ** -0.5, 512)
    assert relative_error(got, ref) < 1e-2
