"""Decode and prefill attention over the paged KV cache against paged_attention_ref.

Tiny shapes run everywhere (in the Triton interpreter on the CPU, with small tiles so that several tiles,
splits and pages are crossed); Llama-3-8B shapes (32 q heads, 8 KV heads, head dim 128) run on CUDA only.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton")

from cobatch.batch import AttentionMetadata  # noqa: E402
from cobatch.kernels.attention import (  # noqa: E402
    DecodeConfig, PrefillConfig, paged_attention_ref, paged_decode_attention, paged_prefill_attention,
    plan_decode_splits, plan_has_groups, prefill_work, prefill_work_items, row_split_len, whole_groups)
from conftest import requires_cuda  # noqa: E402
from kernel_checks import assert_matches, paged_setup, poisoned, relative_error  # noqa: E402

# Small tiles for the interpreter: several tiles per split and several splits per sequence.
TINY_DECODE = DecodeConfig(block_n=16, min_split=32, max_splits=8, programs_per_sm=64)
# A batch of up to 8 rows planned as one row, its programs walking 3 splits each (4 rows, 4 SMs here), which
# make a group: they merge them in registers.
WALKING_DECODE = DecodeConfig(block_n=16, min_split=16, max_splits=16, programs_per_sm=8, invariant_rows=8,
                              split_group=3)
DECODE_VARIANTS = {   # one split (direct write), splits + reduce kernel, several splits per program
    "single": DecodeConfig(block_n=16, min_split=1024),
    "split": TINY_DECODE,
    "walk": WALKING_DECODE,          # in groups of 3 splits (other groupings: the bitwise tests below)
}
TINY_PREFILL = PrefillConfig(block_m=16, block_n=16)


def check_attention(seq_lens, q_lens, n_q, n_kv, head_dim, dtype, seed, decode_cfg=None, prefill_cfg=None,
                    capacity=None, window=0, softcap=0.0, kv_dtype=None) -> None:
    q, k_cache, v_cache, meta = paged_setup(seq_lens, q_lens, n_q, n_kv, head_dim, dtype, seed, capacity=capacity,
                                            kv_dtype=kv_dtype)
    scale = head_dim ** -0.5
    ref = paged_attention_ref(q, k_cache, v_cache, meta, scale, window, softcap)
    out = poisoned(q.shape, dtype)
    if meta.max_query_len == 1:
        got = paged_decode_attention(q, k_cache, v_cache, meta, scale, out=out, cfg=decode_cfg or DecodeConfig(),
                                     window=window, softcap=softcap)
    else:
        got = paged_prefill_attention(q, k_cache, v_cache, meta, scale, out=out,
                                      cfg=prefill_cfg or PrefillConfig(), window=window, softcap=softcap)
    assert got is out
    assert_matches(got, ref)
    assert relative_error(got, ref) < {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]


# --- split planning -----------------------------------------------------------------------------------------

def chunk_splits(seq_len: int, num_splits: int, chunks: int, cfg: DecodeConfig = DecodeConfig()) -> list[int]:
    """How many splits each of a row's `chunks` programs walks (as the split kernel shares them out)."""
    n = -(-seq_len // row_split_len(seq_len, num_splits, cfg))
    per = -(-n // chunks)
    return [max(0, min(per, n - c * per)) for c in range(chunks)]


def test_plan_decode_splits_fills_the_gpu():
    # B=1 at 32k on 132 SMs: many splits; B=64: few; every row up to the capacity splits into whole tiles,
    # at most num_splits of them, all walked by the grid's chunks.
    cfg = DecodeConfig()
    for b, ctx in [(1, 32768), (1, 512), (8, 4096), (64, 32768), (64, 512), (3, 1), (16, 4100)]:
        num_splits, chunks = plan_decode_splits(b, 8, ctx, 132)
        assert 1 <= num_splits <= cfg.max_splits and 1 <= chunks <= num_splits
        for n in list(range(0, min(ctx, 5000) + 1, 7)) + list(range(max(0, ctx - 200), ctx + 1)):
            split_len = row_split_len(n, num_splits)
            assert split_len % cfg.block_n == 0 and split_len >= cfg.min_split, (b, ctx, n)
            assert sum(chunk_splits(n, num_splits, chunks)) == -(-n // split_len) <= num_splits, (b, ctx, n)
    assert plan_decode_splits(1, 8, 32768, 132)[0] >= 32
    assert plan_decode_splits(64, 8, 32768, 132)[0] <= 2


def test_a_short_row_splits_its_own_length_not_the_capacity():
    """A row in a step planned for a 32k capacity splits and spreads as in a step planned for its own length:
    planned from the capacity, a 4k row was one or two 512-token splits walked by one program (decode graphs
    captured for a 32k context ran 4k conversations at 2x the step time; commit cfa295a has the run's log)."""
    for b in (1, 8, 16):
        for n in (512, 4096):
            short, long = plan_decode_splits(b, 8, n, 132), plan_decode_splits(b, 8, 32768, 132)
            assert short[0] == long[0]                  # the same splits, so the same bits
            walked = [c for c in chunk_splits(n, *long) if c]
            assert walked == [c for c in chunk_splits(n, *short) if c], (b, n)   # and as many programs


def test_plan_decode_splits_is_the_same_for_up_to_invariant_rows():
    """A row splits its context the same way whether it is alone or in a step of up to invariant_rows."""
    rows = DecodeConfig().invariant_rows
    for ctx in (1, 512, 4096, 32768):
        plans = {plan_decode_splits(b, 8, ctx, 132)[0] for b in range(1, rows + 1)}
        assert len(plans) == 1, (ctx, plans)
    assert plan_decode_splits(rows + 1, 8, 32768, 132)[0] != plan_decode_splits(1, 8, 32768, 132)[0]
    # ... while a batch's programs walk several splits each, as many programs as its own plan would run
    assert chunk_splits(32768, *plan_decode_splits(1, 8, 32768, 132))[0] == 1
    assert chunk_splits(32768, *plan_decode_splits(rows, 8, 32768, 132))[0] > 1


# --- decode -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n_q,n_kv", [(4, 4), (8, 2), (7, 1)])     # GQA groups 1, 4, 7
@pytest.mark.parametrize("variant", list(DECODE_VARIANTS))
def test_decode_small(n_q, n_kv, variant):
    # Lengths off the page and tile sizes; a padded row (length 0); capacity beyond every length.
    check_attention([37, 0, 100, 5], [1, 1, 1, 1], n_q, n_kv, head_dim=32, dtype=torch.bfloat16, seed=n_q,
                    decode_cfg=DECODE_VARIANTS[variant], capacity=130)


def test_walking_plan_has_programs_walk_several_splits():
    # (num_splits, chunks): 4 rows get 4 programs each (1 row: 9, as many as a 130-token row has splits)
    assert plan_decode_splits(4, 2, 130, 4, WALKING_DECODE) == (16, 4)
    assert plan_decode_splits(1, 2, 130, 4, WALKING_DECODE) == (16, 9)
    assert row_split_len(130, 16, WALKING_DECODE) == 16 and row_split_len(400, 16, WALKING_DECODE) == 32
    assert chunk_splits(130, 16, 4, WALKING_DECODE) == [3, 3, 3, 0]
    # 4 rows: a 130-token row's programs walk its 9 splits 3 by 3, each a whole group of 3 that it merges itself;
    # in groups of 2, group 1 (splits 2-3) straddles two programs.
    assert plan_has_groups(16, 4, WALKING_DECODE) and whole_groups(9, 4, WALKING_DECODE) == [0, 1, 2]
    assert whole_groups(9, 4, replace(WALKING_DECODE, split_group=2)) == [0, 2, 3, 4]
    assert not plan_has_groups(16, 9, WALKING_DECODE)           # one row: a program per split
    assert chunk_splits(130, 16, 9, WALKING_DECODE) == [1] * 9


def test_llama8b_batches_of_invariant_rows_walk_whole_groups():
    """8 x 4k on the H200's 132 SMs: each program walks 8 splits, two groups, so a row stores 16 partials per
    head instead of 64; alone, a row's 64 programs walk one split each and the reduce folds the groups."""
    cfg = DecodeConfig()
    num_splits, chunks = plan_decode_splits(8, 8, 4096, 132)
    assert plan_has_groups(num_splits, chunks) and chunk_splits(4096, num_splits, chunks) == [8] * 8
    assert whole_groups(64, chunks) == list(range(16))
    assert not plan_has_groups(*plan_decode_splits(1, 8, 4096, 132))
    # an fp8 cache's tiles loaded as words leave the registers for them; as bytes they do not
    assert plan_has_groups(num_splits, chunks, DecodeConfig(fp8_words=True), kv_dtype=torch.float8_e4m3fn)
    assert not plan_has_groups(num_splits, chunks, DecodeConfig(fp8_words=False), kv_dtype=torch.float8_e4m3fn)
    # 4160 tokens (a 4k prompt and its answer): 33 splits of 128, 5 a program, every program busy but one
    assert chunk_splits(4160, num_splits, chunks) == [5, 5, 5, 5, 5, 5, 3, 0]
    assert whole_groups(33, chunks) == [0, 4, 5, 8]          # splits 0-3, 16-19, 20-23, 32
    assert num_splits // cfg.split_group == 16


@pytest.mark.parametrize("variant", ["split", "walk"])
def test_decode_small_row_is_bitwise_the_same_whatever_the_capacity(variant):
    """The same rows in a step planned for their own longest length and for a capacity 3x that: the same bits."""
    q, k_cache, v_cache, meta = paged_setup([100, 37, 130, 5], [1] * 4, 4, 2, 32, torch.bfloat16, seed=22,
                                            capacity=400)
    cfg = DECODE_VARIANTS[variant]
    tight = AttentionMetadata(meta.slot_mapping, meta.query_start, meta.seq_lens, meta.block_tables,
                              max_query_len=1, max_seq_len=130)
    assert torch.equal(paged_decode_attention(q, k_cache, v_cache, meta, 0.2, cfg=cfg),
                       paged_decode_attention(q, k_cache, v_cache, tight, 0.2, cfg=cfg))


@pytest.mark.parametrize("split_group", [1, 2, 3])
@pytest.mark.parametrize("window,dtype", [(0, torch.bfloat16), (40, torch.bfloat16), (0, torch.float32)])
def test_decode_small_row_is_bitwise_the_same_alone_and_batched(window, dtype, split_group):
    """Each row alone (a program per split, the reduce folding groups of splits) and among 4 rows (programs
    walking whole groups, folding them in registers; ungrouped, 2-3 splits each): the same bits. float32 rows
    show a one-ulp difference of the f32 partials that a bf16 output may round away."""
    q, k_cache, v_cache, meta = paged_setup([100, 37, 130, 5], [1] * 4, 4, 2, 32, dtype, seed=21,
                                            capacity=130)
    cfg = replace(WALKING_DECODE, split_group=split_group)
    four = paged_decode_attention(q, k_cache, v_cache, meta, 0.2, cfg=cfg, window=window)
    for r in range(4):      # rows of 7, 3, 9 and 1 splits: groups of 2 and 3 both walked whole by some row
        alone = AttentionMetadata(meta.slot_mapping[r:r + 1], meta.query_start[:2], meta.seq_lens[r:r + 1],
                                  meta.block_tables[r:r + 1], max_query_len=1, max_seq_len=meta.max_seq_len)
        one = paged_decode_attention(q[r:r + 1], k_cache, v_cache, alone, 0.2, cfg=cfg, window=window)
        assert torch.equal(one[0], four[r]), r
    assert_matches(four, paged_attention_ref(q, k_cache, v_cache, meta, 0.2, window))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_small_dtypes(dtype):
    check_attention([50, 17], [1, 1], 4, 2, head_dim=24, dtype=dtype, seed=11, decode_cfg=TINY_DECODE)


FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("words", [True, False], ids=["words", "bytes"])
@pytest.mark.parametrize("variant", list(DECODE_VARIANTS))
def test_decode_small_fp8_cache(variant, words):
    """An fp8 cache (--kv-cache-dtype fp8): the kernel widens each tile to q's dtype, loaded as 32-bit words or
    as bytes; the reference reads the same fp8 values."""
    check_attention([37, 0, 100, 5], [1, 1, 1, 1], 8, 2, head_dim=32, dtype=torch.bfloat16, seed=12,
                    decode_cfg=replace(DECODE_VARIANTS[variant], fp8_words=words), kv_dtype=FP8)


def test_fp8_words_of_heads_narrower_than_their_block():
    """Heads of 24 values in blocks of 32 (as Phi-3's 96 in 128), loaded as words: a head's 6 words widen into
    its 24 columns of the tile, against the reference."""
    check_attention([37, 0, 100, 5], [1, 1, 1, 1], 8, 2, head_dim=24, dtype=torch.bfloat16, seed=15,
                    decode_cfg=replace(DECODE_VARIANTS["split"], fp8_words=True), kv_dtype=FP8)


@pytest.mark.parametrize("words", [True, False], ids=["words", "bytes"])
@pytest.mark.parametrize("window", [0, 20])
def test_prefill_small_fp8_cache(window, words):
    check_attention([29, 70, 33, 0], [29, 21, 1, 0], 8, 2, head_dim=32, dtype=torch.bfloat16, seed=13,
                    prefill_cfg=replace(TINY_PREFILL, fp8_words=words), kv_dtype=FP8, window=window)


@pytest.mark.parametrize("q_lens", [[1, 1, 1], [3, 1, 5]], ids=["decode", "prefill"])
def test_output_in_the_next_weights_operand_dtype(q_lens):
    """paged_attention_triton(out_dtype=f16) on bf16 q and caches: the same attention, stored in f16 (ops.attention
    hands o's GEMV its operand dtype), from the decode kernel and from the prefill kernel."""
    from cobatch.kernels.attention import paged_attention_triton
    q, k_cache, v_cache, meta = paged_setup([40, 7, 70], q_lens, 8, 2, 32, torch.bfloat16, seed=14)
    ref = paged_attention_ref(q, k_cache, v_cache, meta, 0.2)
    got = paged_attention_triton(q, k_cache, v_cache, meta, 0.2, out_dtype=torch.float16)
    assert got.dtype == torch.float16 and got.shape == q.shape
    assert relative_error(got, ref) < 1e-2
    same = paged_attention_triton(q, k_cache, v_cache, meta, 0.2)
    assert same.dtype == torch.bfloat16 and relative_error(got, same) < 1e-2


@pytest.mark.parametrize("variant", ["single", "split", "prefill"])
@pytest.mark.parametrize("order", [1, 2])
def test_output_in_the_column_order_of_the_next_gemm(variant, order):
    """out_order: each row stored where operand_order puts its columns (within each 32-dim tile of a head), bit for
    bit the gather of the natural output through quant_pack.k_order: from the split kernel's direct write, the
    reduce kernel's merge and the prefill kernel, in whole 256-row tiles where allocated here."""
    from cobatch.kernels import quant_pack
    from cobatch.kernels.attention import paged_attention_triton
    q_lens = [3, 1, 5] if variant == "prefill" else [1, 1, 1]
    q, k_cache, v_cache, meta = paged_setup([40, 7, 70], q_lens, 8, 2, 64, torch.bfloat16, seed=15)
    cfg = DECODE_VARIANTS.get(variant)
    run = ((lambda out, o: paged_prefill_attention(q, k_cache, v_cache, meta, 0.2, out=out, cfg=TINY_PREFILL,
                                                   out_order=o)) if cfg is None else
           (lambda out, o: paged_decode_attention(q, k_cache, v_cache, meta, 0.2, out=out, cfg=cfg, out_order=o)))
    natural = run(torch.zeros(q.shape, dtype=torch.float16, device=q.device), 0)
    got = run(torch.zeros(q.shape, dtype=torch.float16, device=q.device), order)
    index = quant_pack.k_order(quant_pack.Q6_K if order == 2 else quant_pack.Q8_0)
    n = q.shape[0]
    assert torch.equal(got.reshape(n, -1), natural.reshape(n, -1, 32)[:, :, index].reshape(n, -1))
    assert not torch.equal(got, natural)
    if cfg is not None and q.is_cuda:
        allocated = paged_attention_triton(q, k_cache, v_cache, meta, 0.2, out_dtype=torch.float16, out_order=order)
        assert allocated.untyped_storage().nbytes() == 256 * 8 * 64 * 2


def test_decode_padded_rows_are_zero():
    q, k_cache, v_cache, meta = paged_setup([0, 0], [1, 1], 4, 2, 32, torch.bfloat16, seed=12, capacity=64)
    for cfg in DECODE_VARIANTS.values():
        out = paged_decode_attention(q, k_cache, v_cache, meta, 0.1, out=poisoned(q.shape, q.dtype), cfg=cfg)
        assert torch.equal(out, torch.zeros_like(out))


def check_rope_decode(lens: list[int], drafts: range, n_q: int, n_kv: int, head_dim: int, kv_dtype, neox: bool,
                      cfg: DecodeConfig, seed: int, capacity: int, dtype=torch.bfloat16, qk_norm: bool = False) -> None:
    """A decode step whose rows still need rope and their cache write, rows `drafts` being a speculating
    sequence as the decode graph runs it (its last token and drafts: rows on the same pages at consecutive
    lengths, each writing its own position). The decode kernel rotating q and the step's k and writing k, v
    itself (DecodeRope) against the rope kernel, then the decode kernel: the same output and caches, bitwise;
    and against the torch references (rope_ref, kv_write_ref, paged_attention_ref; k's rotation may differ
    by a bf16 ulp: one fma). qk_norm: qwen3's per-head q/k RMS norms too; their sums over a head are added in
    another order than the rope kernel's, so there the outputs and caches agree to a rounding, not bitwise."""
    from cobatch.kernels.attention import DecodeRope
    from cobatch.kernels.kv_write import kv_write_ref
    from cobatch.kernels.norm import rms_norm_ref
    from cobatch.kernels.rope import rope_cos_sin, rope_ref, rope_triton
    q, k_cache, v_cache, meta = paged_setup(lens, [1] * len(lens), n_q, n_kv, head_dim, dtype, seed,
                                            capacity=capacity, kv_dtype=kv_dtype)
    tables = meta.block_tables.clone()
    if drafts:
        tables[drafts.start:drafts.stop] = tables[drafts.start]
    bs = k_cache.shape[1]
    slots = [int(t[(n - 1) // bs]) * bs + (n - 1) % bs if n else -1 for t, n in zip(tables.tolist(), lens)]
    meta = replace(meta, block_tables=tables, slot_mapping=torch.tensor(slots, device=q.device))
    g = torch.Generator().manual_seed(seed + 1)
    k = torch.randn(len(lens), n_kv, head_dim, generator=g).to(q.device, dtype)
    v = torch.randn(len(lens), n_kv, head_dim, generator=g).to(q.device, dtype)
    positions = torch.tensor([max(n - 1, 0) for n in lens], device=q.device)
    cos_sin = rope_cos_sin(head_dim, capacity, 10000.0).to(q.device)
    norms = None
    if qk_norm:
        norms = (1 + torch.rand(head_dim, generator=g)).to(q.device, dtype), (1 + torch.rand(head_dim, generator=g)).to(
            q.device, dtype), 1e-6

    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(3)]
    fused = paged_decode_attention(q.clone(), *caches[0], meta, 0.2, cfg=cfg,
                                   rope=DecodeRope(k, v, positions, cos_sin, neox, norms))
    q_rot, _ = rope_triton(q.clone(), k.clone(), positions, cos_sin, neox, kv_write=(v, *caches[1], meta.slot_mapping),
                           qk_norm=norms)
    apart = paged_decode_attention(q_rot, *caches[1], meta, 0.2, cfg=cfg)
    assert not torch.equal(caches[0][0].view(torch.uint8), k_cache.view(torch.uint8))    # it did write
    assert torch.equal(caches[0][1].view(torch.uint8), caches[1][1].view(torch.uint8))
    if qk_norm:
        assert_matches(fused, apart)
        assert_matches(caches[0][0], caches[1][0])
        q, _ = rms_norm_ref(q, norms[0], norms[2])
        k, _ = rms_norm_ref(k, norms[1], norms[2])
    else:
        assert torch.equal(fused, apart)
        assert torch.equal(caches[0][0].view(torch.uint8), caches[1][0].view(torch.uint8))
    q_ref, k_ref = rope_ref(q, k, positions, cos_sin, neox)
    ref = paged_attention_ref(q_ref, *caches[0], meta, 0.2)                        # over the caches it wrote
    if qk_norm:     # q rounded twice to bf16 (normed, rotated), which the interpreter truncates: 1 % off there
        assert relative_error(fused, ref) < 2e-2
    else:
        assert_matches(fused, ref)
    if kv_dtype is None:     # (how values round into fp8: test_kernels_small's kv_write tests, on CUDA)
        kv_write_ref(k_ref, v, *caches[2], meta.slot_mapping)
        assert_matches(caches[0][0], caches[2][0])
        assert torch.equal(caches[0][1], caches[2][1])


@pytest.mark.parametrize("variant,neox,kv_dtype,qk_norm", [("single", False, None, False), ("split", True, None, False),
                                                           ("walk", False, None, False), ("split", False, FP8, False),
                                                           ("split", True, None, True)],
                         ids=["single-pairs", "split-halves", "walk-pairs", "split-pairs-fp8", "split-halves-qk-norm"])
def test_decode_with_rope_equals_the_rope_kernel_then_decode(variant, neox, kv_dtype, qk_norm):
    """Rows of 37 and 5 tokens, a padded row (0, slot -1), and a sequence of 100 tokens with two drafts, whose
    rows read the positions the rows before them write in the same launch."""
    check_rope_decode([37, 100, 101, 102, 0, 5], range(1, 4), 8, 2, 32, kv_dtype, neox, DECODE_VARIANTS[variant],
                      seed=31, capacity=130, qk_norm=qk_norm)


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (9, 0.0), (0, 4.0)])
@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn])
def test_decode_step_ref_at_once_equals_each_sequence_alone(window, softcap, kv_dtype):
    """The reference runs a decode step (one row a sequence) for every sequence at once, each context padded to
    the longest: it must give each row what the reference gives that sequence alone (the loop), and the padding
    must not leak, whatever the cache's unused slots hold (NaN here)."""
    seq_lens, n_q, n_kv, d = [37, 1, 100, 16, 17], 8, 2, 32
    q, k_cache, v_cache, meta = paged_setup(seq_lens, [1] * 5, n_q, n_kv, d, torch.float32, seed=13, capacity=130,
                                            kv_dtype=kv_dtype)
    used = torch.zeros(k_cache.shape[:2], dtype=torch.bool, device=k_cache.device)
    for s, n in enumerate(seq_lens):
        for pos in range(n):
            used[meta.block_tables[s, pos // 16].long(), pos % 16] = True
    for cache in (k_cache, v_cache):
        if cache.dtype == torch.float8_e4m3fn:
            cache.view(torch.uint8)[~used] = 0x7F          # e4m3fn's NaN
        else:
            cache[~used] = float("nan")
    together = paged_attention_ref(q, k_cache, v_cache, meta, 0.2, window, softcap)
    for s in range(len(seq_lens)):
        one = AttentionMetadata(meta.slot_mapping[s:s + 1], meta.query_start[:2], meta.seq_lens[s:s + 1],
                                meta.block_tables[s:s + 1], 1, meta.max_seq_len)
        alone = paged_attention_ref(q[s:s + 1], k_cache, v_cache, one, 0.2, window, softcap)
        torch.testing.assert_close(together[s:s + 1], alone, rtol=1e-6, atol=1e-6)
    assert torch.isfinite(together).all()


# --- prefill -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n_q,n_kv", [(4, 4), (8, 2), (7, 1)])
def test_prefill_small(n_q, n_kv):
    # A fresh prompt, a chunk after a cached prefix, a single-row sequence, an empty one.
    check_attention([29, 70, 33, 0], [29, 21, 1, 0], n_q, n_kv, head_dim=32, dtype=torch.bfloat16, seed=20 + n_q,
                    prefill_cfg=TINY_PREFILL)


def test_prefill_work_lists_each_tile_heaviest_first_and_pads_with_minus_one():
    """Sequences of 29, 21, 1 and 0 rows (the second after a 49-token prefix) in 16-row tiles: 2 + 2 + 1 tiles,
    ordered by the keys their last row sees (70, 65, 33, 29, 16), then padding."""
    starts, lens = [0, 29, 50, 51, 51], [29, 70, 33, 0]
    work = prefill_work(starts, lens, items=8, cfg=TINY_PREFILL)
    assert [(w >> 16, w & 0xFFFF) if w >= 0 else -1 for w in work] == [(1, 1), (1, 0), (2, 0), (0, 1), (0, 0), -1, -1,
                                                                        -1]
    assert len(prefill_work(starts, lens, cfg=TINY_PREFILL)) == 5
    assert prefill_work_items(51, 4, TINY_PREFILL) >= 5
    # the bound holds for any split of the rows among the sequences
    for q_lens in ([16, 16, 16, 3], [1, 1, 1, 48], [15, 15, 15, 6], [51, 0, 0, 0]):
        starts = [0]
        for q in q_lens:
            starts.append(starts[-1] + q)
        assert len(prefill_work(starts, q_lens, cfg=TINY_PREFILL)) <= prefill_work_items(51, 4, TINY_PREFILL)


@pytest.mark.parametrize("window", [0, 24])
def test_prefill_by_work_list_gives_the_bits_of_the_full_grid(window):
    """The kernel over a work list (padded with -1 items, as a graph's fixed grid is) stores what the grid of
    every sequence times its longest chunk's tiles stores, and nothing in the rows past the step's."""
    seq_lens, q_lens = [29, 70, 33, 0, 5], [29, 21, 1, 0, 5]
    q, k_cache, v_cache, meta = paged_setup(seq_lens, q_lens, 8, 2, 32, torch.bfloat16, seed=33)
    scale = 32 ** -0.5
    want = paged_prefill_attention(q, k_cache, v_cache, meta, scale, out=poisoned(q.shape, torch.bfloat16),
                                   cfg=TINY_PREFILL, window=window)
    starts = meta.query_start.tolist()
    work = prefill_work(starts, seq_lens, items=prefill_work_items(q.shape[0], len(seq_lens), TINY_PREFILL) + 3,
                        cfg=TINY_PREFILL)
    listed = replace(meta, prefill_work=torch.tensor(work, dtype=torch.int32, device=q.device))
    got = paged_prefill_attention(q, k_cache, v_cache, listed, scale, out=want.clone(), cfg=TINY_PREFILL,
                                  window=window)
    assert torch.equal(got, want)
    fresh = paged_prefill_attention(q, k_cache, v_cache, listed, scale, cfg=TINY_PREFILL, window=window)
    assert torch.equal(fresh, want)
    assert_matches(fresh, paged_attention_ref(q, k_cache, v_cache, meta, scale, window))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_small_dtypes(dtype):
    check_attention([40, 19], [18, 19], 4, 2, head_dim=24, dtype=dtype, seed=21, prefill_cfg=TINY_PREFILL)


# --- sliding window (Gemma's local layers) -------------------------------------------------------------------

def test_window_ref_is_attention_over_the_last_keys():
    """The reference with a window equals plain attention of each row over only its last `window` keys."""
    q, k_cache, v_cache, meta = paged_setup([45], [45], 4, 2, 16, torch.float32, seed=30)
    window = 7
    got = paged_attention_ref(q, k_cache, v_cache, meta, 0.25, window)
    blocks = meta.block_tables[0, :3].long()
    k = k_cache[blocks].reshape(-1, 2, 16)[:45]
    v = v_cache[blocks].reshape(-1, 2, 16)[:45]
    for i in (0, 6, 7, 30, 44):
        lo = max(0, i - window + 1)
        for h in range(4):
            kv = h // 2
            w = torch.softmax(k[lo:i + 1, kv] @ q[i, h] * 0.25, 0)
            assert torch.allclose(got[i, h], w @ v[lo:i + 1, kv], atol=1e-5)


@pytest.mark.parametrize("variant", list(DECODE_VARIANTS))
@pytest.mark.parametrize("window", [1, 20, 64])
def test_decode_small_window(variant, window):
    check_attention([37, 0, 100, 5], [1, 1, 1, 1], 8, 2, head_dim=32, dtype=torch.float32, seed=31,
                    decode_cfg=DECODE_VARIANTS[variant], capacity=130, window=window)


@pytest.mark.parametrize("window", [1, 5, 20, 200])
def test_prefill_small_window(window):
    # Rows whose window starts inside an early tile see none of its keys (the EMPTY_ROWS case).
    check_attention([29, 70, 33, 0], [29, 21, 1, 0], 8, 2, head_dim=32, dtype=torch.float32, seed=32,
                    prefill_cfg=TINY_PREFILL, window=window)


# --- soft-capped scores (Gemma 2) ------------------------------------------------------------------------------

def test_softcap_ref_caps_the_scores():
    q, k_cache, v_cache, meta = paged_setup([20], [20], 2, 1, 16, torch.float32, seed=33)
    q = q * 8                                  # large scores, so that the cap bites
    capped = paged_attention_ref(q, k_cache, v_cache, meta, 1.0, softcap=5.0)
    blocks = meta.block_tables[0, :2].long()
    k, v = k_cache[blocks].reshape(-1, 1, 16)[:20, 0], v_cache[blocks].reshape(-1, 1, 16)[:20, 0]
    i = 19
    w = torch.softmax(5.0 * torch.tanh((k[:i + 1] @ q[i, 0]) / 5.0), 0)
    assert torch.allclose(capped[i, 0], w @ v[:i + 1], atol=1e-5)
    assert not torch.allclose(capped, paged_attention_ref(q, k_cache, v_cache, meta, 1.0), atol=1e-2)


@pytest.mark.parametrize("variant", list(DECODE_VARIANTS))
def test_decode_small_softcap(variant):
    check_attention([37, 0, 100, 5], [1, 1, 1, 1], 8, 2, head_dim=32, dtype=torch.float32, seed=34,
                    decode_cfg=DECODE_VARIANTS[variant], capacity=130, softcap=0.5)


@pytest.mark.parametrize("window", [0, 20])
def test_prefill_small_softcap(window):
    check_attention([29, 70, 33, 0], [29, 21, 1, 0], 8, 2, head_dim=32, dtype=torch.float32, seed=35,
                    prefill_cfg=TINY_PREFILL, window=window, softcap=0.5)


# --- GPU, real shapes ----------------------------------------------------------------------------------------

LLAMA8B = dict(n_q=32, n_kv=8, head_dim=128)


@requires_cuda
@pytest.mark.parametrize("seq_lens", [[512], [4096], [32768], [4096] * 8, [1, 511, 0, 4097, 32768, 77, 2048, 16],
                                      [513] * 64])
@pytest.mark.parametrize("pdl", [False, True])
def test_decode_llama8b(seq_lens, pdl):
    check_attention(seq_lens, [1] * len(seq_lens), **LLAMA8B, dtype=torch.bfloat16, seed=len(seq_lens),
                    capacity=32768, decode_cfg=replace(DecodeConfig(), pdl=pdl))


@requires_cuda
@pytest.mark.parametrize("seq_lens", [[4096], [1, 511, 0, 4097, 32768, 77, 2048, 16]])
def test_decode_llama8b_fp8_cache(seq_lens):
    check_attention(seq_lens, [1] * len(seq_lens), **LLAMA8B, dtype=torch.bfloat16, seed=50 + len(seq_lens),
                    capacity=32768, kv_dtype=torch.float8_e4m3fn)


@requires_cuda
@pytest.mark.parametrize("kv_dtype", [None, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("neox", [False, True], ids=["pairs", "halves"])
@pytest.mark.parametrize("lens,drafts", [([511], range(0)), ([1, 4096, 4097, 4098, 0, 511, 77, 32768], range(1, 4)),
                                         ([513] * 60 + [300, 301, 302, 303], range(60, 64))],
                         ids=["one", "eight", "sixty-four"])
def test_decode_with_rope_llama8b(lens, drafts, neox, kv_dtype):
    check_rope_decode(lens, drafts, **LLAMA8B, kv_dtype=kv_dtype, neox=neox, cfg=DecodeConfig(), seed=len(lens),
                      capacity=32768)


@requires_cuda
def test_decode_with_rope_and_qk_norms_qwen3():
    """Qwen3-8B's heads (32 q heads, 8 KV heads of 128 dims, halves rotating) with its per-head q/k norms."""
    check_rope_decode([1, 4096, 4097, 0, 511, 77], range(1, 3), **LLAMA8B, kv_dtype=None, neox=True,
                      cfg=DecodeConfig(), seed=9, capacity=8192, qk_norm=True)


@requires_cuda
def test_decode_with_rope_smollm2_f16():
    """SmolLM2's heads (9 q heads, 3 KV heads of 64 dims) in f16, as the GPU engine's tests run them."""
    check_rope_decode([5, 40, 41, 0, 200], range(1, 3), 9, 3, 64, None, False, DecodeConfig(), seed=7, capacity=256,
                      dtype=torch.float16)


@requires_cuda
def test_prefill_llama8b_fp8_cache():
    check_attention([4096 + 512, 700], [512, 700], **LLAMA8B, dtype=torch.bfloat16, seed=51,
                    kv_dtype=torch.float8_e4m3fn)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_row_is_bitwise_the_same_in_any_step_of_up_to_invariant_rows(dtype):
    """Batch invariance of decode attention: each row alone, among 4 rows and among 8 gives the same bits. Alone,
    a 4k row's programs walk a split each; among 4 or 8, whole groups of splits, merged in registers. float32 rows
    show differences of the f32 partials that bf16 outputs may round away."""
    lens = [3000, 77, 4096, 1, 0, 2500, 640, 4000]
    q, k_cache, v_cache, meta = paged_setup(lens, [1] * 8, **LLAMA8B, dtype=dtype, seed=40, capacity=4096)
    scale = 128 ** -0.5

    def rows(a, b):
        sub = AttentionMetadata(meta.slot_mapping[a:b], meta.query_start[:b - a + 1], meta.seq_lens[a:b],
                                meta.block_tables[a:b], max_query_len=1, max_seq_len=meta.max_seq_len)
        return paged_decode_attention(q[a:b], k_cache, v_cache, sub, scale)

    eight = rows(0, 8)
    assert torch.equal(rows(0, 4), eight[:4]) and torch.equal(rows(4, 8), eight[4:])
    for r in range(8):
        assert torch.equal(rows(r, r + 1)[0], eight[r]), r
    assert_matches(eight, paged_attention_ref(q, k_cache, v_cache, meta, scale))


@requires_cuda
@pytest.mark.parametrize("pdl", [False, True])
def test_decode_cuda_graph_replay(pdl):
    """Captured once at a fixed capacity, replayed with other lengths, pages and queries written in place."""
    n, capacity = 6, 8192
    # The pool of the capture is sized for full-capacity sequences, so every later scenario fits in it.
    q, k_cache, v_cache, meta = paged_setup([capacity] * n, [1] * n, **LLAMA8B, dtype=torch.bfloat16, seed=30,
                                            capacity=capacity)
    scale = 128 ** -0.5
    cfg = replace(DecodeConfig(), pdl=pdl)
    # q is produced by a kernel right before attention (as rope is in the model), and two attention calls
    # run back to back: with PDL, each must still wait for its inputs.
    q_src = q.clone()

    def step():
        torch.mul(q_src, 1.0, out=q)
        first = paged_decode_attention(q, k_cache, v_cache, meta, scale, cfg=cfg)
        torch.mul(q_src, -1.0, out=q)
        return first, paged_decode_attention(q, k_cache, v_cache, meta, scale, cfg=cfg)

    step()      # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, out_neg = step()
    for seed, lens in [(31, [8192, 1, 0, 4000, 17, 640]), (32, [5, 6000, 0, 0, 8191, 2])]:
        q2, kc2, vc2, meta2 = paged_setup(lens, [1] * n, **LLAMA8B, dtype=torch.bfloat16, seed=seed,
                                          capacity=capacity)
        k_cache[: kc2.shape[0]].copy_(kc2)
        v_cache[: vc2.shape[0]].copy_(vc2)
        q_src.copy_(q2)
        meta.seq_lens.copy_(meta2.seq_lens)
        meta.block_tables.copy_(meta2.block_tables)
        out.fill_(float("nan"))
        out_neg.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches(out, paged_attention_ref(q_src, k_cache, v_cache, meta, scale))
        assert_matches(out_neg, paged_attention_ref(-q_src, k_cache, v_cache, meta, scale))


@requires_cuda
@pytest.mark.parametrize("seq_lens,q_lens", [([2048], [2048]), ([4096 + 512], [512]),
                                             ([700, 3000, 64], [700, 1000, 1])])
def test_prefill_llama8b(seq_lens, q_lens):
    check_attention(seq_lens, q_lens, **LLAMA8B, dtype=torch.bfloat16, seed=sum(q_lens))


def test_ops_attention_dispatches_decode_and_prefill():
    from cobatch import ops
    for q_lens, seq_lens in [([1, 1, 1], [40, 0, 17]), ([5, 1], [40, 17])]:
        q, k_cache, v_cache, meta = paged_setup(seq_lens, q_lens, 4, 2, 32, torch.bfloat16, seed=40)
        assert_matches(ops.attention(q, k_cache, v_cache, meta, 0.2),
                       paged_attention_ref(q, k_cache, v_cache, meta, 0.2))


GEMMA3_4B = dict(n_q=8, n_kv=4, head_dim=256)     # 256-wide heads: the kernels' largest tiles


@requires_cuda
@pytest.mark.parametrize("window,softcap", [(1024, 0.0), (0, 50.0), (4096, 50.0)])
def test_decode_gemma_shapes(window, softcap):
    check_attention([1, 1023, 1025, 5000, 0], [1] * 5, **GEMMA3_4B, dtype=torch.bfloat16, seed=window,
                    capacity=8192, window=window, softcap=softcap)


@requires_cuda
@pytest.mark.parametrize("window,softcap", [(1024, 0.0), (0, 50.0), (4096, 50.0)])
def test_prefill_gemma_shapes(window, softcap):
    check_attention([3000, 1500, 64], [3000, 700, 1], **GEMMA3_4B, dtype=torch.bfloat16, seed=window + 1,
                    window=window, softcap=softcap)
