"""Attention over the paged KV cache: each sequence's rows attend causally to its own context."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from cobatch.batch import AttentionMetadata
from cobatch.kernels.fp8_cache import FP8_DTYPES, kernel_view, to_cache, widen_words, words_mode
from cobatch.kernels.operand_order import NATURAL, operand_buffer, ordered_columns
from cobatch.kernels.rope import rotary_dims, rotated
from cobatch.kernels.triton_support import (device_sms, dot_in_f32, gdc_launch_dependents, gdc_wait,
                                             jit, next_pow2, pdl_launch, tl, triton)


def reference_sequences(meta: AttentionMetadata, block_size: int):
    """For the torch references: (first row, end row, context length, cache blocks) of each sequence that has
    rows in this step and a context."""
    starts, lens = meta.query_start.tolist(), meta.seq_lens.tolist()
    for s, ctx in enumerate(lens):
        a, b = starts[s], starts[s + 1]
        if b > a and ctx > 0:
            yield a, b, ctx, meta.block_tables[s, : (ctx + block_size - 1) // block_size].long()


def hidden_keys(ctx: int, q_len: int, device, window: int = 0) -> torch.Tensor:
    """[q_len, ctx] True where a key is hidden from a row: after its position (row i sits at ctx - q_len + i), or
    with a sliding window (> 0) before its last `window` keys."""
    q_pos = torch.arange(ctx - q_len, ctx, device=device)[:, None]
    key_pos = torch.arange(ctx, device=device)[None, :]
    hidden = key_pos > q_pos
    if window > 0:
        hidden |= key_pos <= q_pos - window
    return hidden


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """q: [N, Hq, D]; caches [num_blocks, block_size, Hk, D] (this step's K/V already written).

    Row i of sequence s sits at position seq_len - q_len + i and sees keys 0..that position, or with a
    sliding window (> 0) only the last `window` of them (Gemma's local layers). softcap > 0 (Gemma 2): scores
    become softcap * tanh(score / softcap). Rows past query_start[-1] (padding) come out as zeros.
    """
    n_rows, n_heads, head_dim = q.shape
    n_kv, block_size = k_cache.shape[2], k_cache.shape[1]
    group = n_heads // n_kv
    if _one_row_each(meta, n_rows):
        return _decode_step_ref(q, k_cache, v_cache, meta, scale, window, softcap)
    out = torch.zeros_like(q)
    for a, b, ctx, blocks in reference_sequences(meta, block_size):
        q_len = b - a
        k = k_cache[blocks].reshape(-1, n_kv, head_dim)[:ctx].float().transpose(0, 1)  # [Hk, L, D]
        v = v_cache[blocks].reshape(-1, n_kv, head_dim)[:ctx].float().transpose(0, 1)
        qh = q[a:b].float().view(q_len, n_kv, group, head_dim).permute(1, 2, 0, 3)      # [Hk, G, q, D]
        scores = torch.einsum("hgqd,hkd->hgqk", qh, k) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        scores.masked_fill_(hidden_keys(ctx, q_len, q.device, window), float("-inf"))
        o = torch.einsum("hgqk,hkd->hgqd", scores.softmax(-1), v)
        out[a:b] = o.permute(2, 0, 1, 3).reshape(q_len, n_heads, head_dim).to(q.dtype)
    return out


def _one_row_each(meta: AttentionMetadata, n_rows: int) -> bool:
    """A decode step: every sequence has exactly one row (at most one each, and as many rows as sequences, none of
    them padding), and a context."""
    s = meta.num_seqs
    return (meta.max_query_len == 1 and n_rows == s and s > 1 and int(meta.query_start[-1]) == s
            and bool((meta.seq_lens > 0).all()))


def _decode_step_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float, window: int, softcap: float) -> torch.Tensor:
    """paged_attention_ref for a decode step, every sequence at once: each one's context gathered and padded to the
    longest, the padding hidden (and its values zeroed: a padded slot may hold anything). The same products as the
    loop per sequence, without its Python loop."""
    n_seqs, n_heads, head_dim = q.shape
    n_kv, block_size = k_cache.shape[2], k_cache.shape[1]
    lens = meta.seq_lens.long()
    longest = int(lens.max())
    blocks = meta.block_tables[:, : (longest + block_size - 1) // block_size].long()

    def gathered(cache: torch.Tensor) -> torch.Tensor:      # [S, Hk, L, D]
        return cache[blocks].reshape(n_seqs, -1, n_kv, head_dim)[:, :longest].float().transpose(1, 2)
    key_pos = torch.arange(longest, device=q.device)
    hidden = key_pos[None, :] >= lens[:, None]                                         # [S, L]
    if window > 0:
        hidden |= key_pos[None, :] <= lens[:, None] - 1 - window
    k = gathered(k_cache)
    v = gathered(v_cache).masked_fill(hidden[:, None, :, None], 0.0)
    qh = q.float().view(n_seqs, n_kv, n_heads // n_kv, head_dim)                       # [S, Hk, G, D]
    scores = torch.einsum("shgd,shld->shgl", qh, k) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    scores.masked_fill_(hidden[:, None, None, :], float("-inf"))
    o = torch.einsum("shgl,shld->shgd", scores.softmax(-1), v)
    return o.reshape(n_seqs, n_heads, head_dim).to(q.dtype)


# --- Triton: shared pieces --------------------------------------------------------------------------------

LOG2E = 1.4426950408889634


@jit
def _tile_pages(bt_row_ptr, toks, end, PAGE: tl.constexpr):
    """The cache pages of tokens `toks` (< end) of one sequence, from its block table.

    The decode loop looks up the next tile's pages at the end of each iteration and carries them, and the first
    tile's before waiting for the previous kernel: one DRAM round trip less after the wait (H200: a call of
    B = 1 x 512 6.6 -> 5.7 us, 1 x 4k 11.6 -> 11.0 us;
    bench/results/kernels_attention-2026-11-30-pages-ahead.log at 5a66009^).
    With the lookup carried, Triton's pipeliner gives K/V num_stages - 1 shared buffers (looked up in their own
    iteration, it gave one at any num_stages); two buffers (77 KB at 64-token tiles, 2 programs per SM) or 32-token
    tiles in 3 stages measured no better. Prefill looks up each tile's pages in its own iteration: carried there,
    it ran 2-3 % slower."""
    return tl.load(bt_row_ptr + toks // PAGE, mask=toks < end, other=0).to(tl.int64)


@jit
def _load_rows(row_ptrs, d, row_mask, WIDTH: tl.constexpr, OPERAND: tl.constexpr, FP8_WORDS: tl.constexpr = 0):
    """The first WIDTH elements of rows at row_ptrs, as [R, len(d)] in OPERAND (masked rows and columns 0): an fp8
    cache's are widened to f16 in registers (the bytes read are what it saves).
    FP8_WORDS (an fp8 cache: fp8_cache.widen_words' mode): the bytes are loaded as 32-bit words and widened a
    word at a time. Loaded as bytes, Triton kept V's tile as fp8 in shared memory and read it back one byte per
    load in the dot's layout (64 single-byte loads a thread and tile, then repacking) and repacked K's bytes
    too; as words it widens in registers and stages f16 for ldmatrix, as for a bf16 cache (sm_90 SASS, 2 stages:
    the decode loop 791 -> 539 instructions a 64-token tile)."""
    if FP8_WORDS:
        w = tl.arange(0, d.shape[0] // 4)
        words = row_ptrs[:, None].to(tl.pointer_type(tl.int32)) + w[None, :]
        return widen_words(tl.load(words, mask=row_mask[:, None] & (w < WIDTH // 4)[None, :], other=0), FP8_WORDS)
    return tl.load(row_ptrs[:, None] + d[None, :], mask=row_mask[:, None] & (d < WIDTH)[None, :],
                   other=0.0).to(OPERAND)


@jit
def _gather_kv_tile(kc_ptr, vc_ptr, page, toks, tok_mask, kv_head, d, cache_block_stride, cache_slot_stride,
                    cache_head_stride, PAGE: tl.constexpr, HEAD_D: tl.constexpr, OPERAND: tl.constexpr,
                    FP8_WORDS: tl.constexpr):
    """K and V rows [BLOCK_N, BLOCK_D] of tokens `toks` of one sequence, on their pages (_tile_pages), as OPERAND
    (_load_rows)."""
    off = page * cache_block_stride + (toks % PAGE) * cache_slot_stride + kv_head * cache_head_stride
    return (_load_rows(kc_ptr + off, d, tok_mask, HEAD_D, OPERAND, FP8_WORDS),
            _load_rows(vc_ptr + off, d, tok_mask, HEAD_D, OPERAND, FP8_WORDS))


@jit
def _online_softmax_step(q, k, v, m, l, acc, qk_scale, valid, DOT_F32: tl.constexpr, EMPTY_ROWS: tl.constexpr = False,
                         softcap=0.0, SOFTCAP: tl.constexpr = False):
    """One tile of flash attention: scores q.k^T over `valid`, then fold p.v into (m, l, acc), all f32.
    qk_scale includes log2(e), so exp2 gives the softmax weights. EMPTY_ROWS: a row may have no valid key in
    this tile and none before it (its max stays -inf), so the exponents are taken against 0 instead of NaN.
    SOFTCAP (Gemma 2): scores become softcap * tanh(score / softcap) before the softmax."""
    if DOT_F32:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if SOFTCAP:      # tanh(x) = 2 sigmoid(2x) - 1, x = score / softcap; qk_scale carries log2(e) = 1.4427
        s = (2.0 * tl.sigmoid(s * (2.0 * qk_scale / (1.4426950408889634 * softcap))) - 1.0) \
            * (softcap * 1.4426950408889634)
    else:
        s = s * qk_scale
    return _softmax_fold(s, v, m, l, acc, valid, DOT_F32=DOT_F32, EMPTY_ROWS=EMPTY_ROWS)


@jit
def _softmax_fold(s, v, m, l, acc, valid, DOT_F32: tl.constexpr, EMPTY_ROWS: tl.constexpr = False):
    """Fold one tile's scores s (already times qk_scale, log2(e) included) over `valid`, and its values v, into
    the running (m, l, acc) of flash attention. Shared with the MLA decode kernel (mla_attention.py), whose
    scores are two dots."""
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    if EMPTY_ROWS:
        m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp2(m - m_ref)
        p = tl.exp2(s - m_ref[:, None])
    else:
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    if DOT_F32:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l, acc * alpha[:, None] + pv


def operand_dtype(q: torch.Tensor, k_cache: torch.Tensor):
    """The dtype the kernels' dots take K, V and q in: the cache's, except that an fp8 cache is widened to f16
    as its tiles are loaded (one cvt per two values, where bf16 takes a second conversion per value: sm_90
    compile, 128 more per 64-token tile; f16 also holds every e4m3 value and the softmax weights exactly enough).
    q goes to f16 then: a query beyond f16's 65504 is not a thing models make."""
    dtype = torch.float16 if k_cache.dtype in FP8_DTYPES else k_cache.dtype
    return getattr(tl, str(dtype).removeprefix("torch."))


def _cache_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    return k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)


# --- Triton: decode (one query row per sequence, flash-decoding split along the context) ------------------

@dataclass(frozen=True, slots=True)
class DecodeConfig:
    block_n: int = 64            # tokens per tile (several pages)
    num_warps: int = 4
    # The next tile's pages are looked up a tile ahead in the loop (_tile_pages), so 2 stages keep the pipeline
    # that 3 stages gave when the lookup was in the tile's own iteration (2026-11-29: the lookup a stage ahead of
    # the K/V loads, B=8 x 4k 0.75 -> 0.80, kernels_attention-2026-11-29-stages.md at 5a66009^): one K/V buffer,
    # 45 KB of shared memory, 128 registers, 4 programs per SM (one wave of 512). 3 stages would double-buffer K/V
    # in 77 KB and halve the programs per SM: B=8 x 4k 0.75 -> 0.71 (kernels_attention-2026-11-30-pages-ahead.log
    # at 5a66009^).
    num_stages: int = 2
    min_split: int = 64          # fewest tokens one program walks (B=1 x 4k: 0.35 -> 0.38 against 128)
    max_splits: int = 64         # the reduce holds all splits of a row in registers
    programs_per_sm: int = 4     # how many split programs to aim for per multiprocessor
    # Steps of up to this many rows split the context as one row would. A row's output then depends on its
    # own length and the capacity only, not on how many rows share the step: bitwise the same alone, in a
    # batch, or beside its speculative drafts (the GEMV is batch-invariant up to 16 rows too). The batch's
    # programs walk several splits each (as many programs as its own plan), yet pay for the extra partials
    # at long contexts: H200, of copy, 8 x 4k 0.84 -> 0.73, 4 x 4k 0.70 -> 0.63; 16 x 4k would be
    # 0.93 -> 0.80, so 16 rows keep their own plan (bench/results/kernels_attention-2026-11-30-invariant.md at
    # 5a66009^).
    invariant_rows: int = 8
    # A row's splits merge in groups of this many (splits 0..G-1, G..2G-1, ...: folded in order, then the groups
    # at once). A group that one program walks whole is folded in its registers and stored as one partial; the
    # reduce kernel folds the others the same way, in the same order. So a row keeps its bits either way, and a
    # batch of invariant rows (8 x 4k: 8 splits a program) writes and reads a G-th of the partials. H200, of
    # copy, G = 1 -> 4 / 8: 8 x 4k 0.72 -> 0.76 / 0.78, 4 x 4k 0.62 -> 0.64 / 0.61 (4 splits a program: no
    # group is whole at G = 8, and its reduce folds 8 deep), B = 1 the same
    # (bench/results/kernels_attention-2026-11-30-split-groups.log at 5a66009^). 1: no groups.
    split_group: int = 4
    # ptxas's register cap for 128-wide heads, for 4 programs per SM. Left alone, an fp8 cache's kernel took
    # 160-184 registers (its tiles widened in registers), a windowed or soft-capped one 134-136 since splits
    # follow each row's length; capped at 128 none of them spills (sm_90 compile, tests/test_kernels_compile.py).
    # One-split bf16 kernels stay uncapped: they fit 128 alone, and the cap made them spill 8 bytes. 256-wide
    # heads (Gemma) need 200-255 and spill under it, so they are not capped either.
    max_registers: int = 128
    # Programmatic dependent launch (where the device has it): the split kernel reads the sequence lengths
    # while the previous kernel finishes and waits for it before touching q, the caches or the outputs.
    # H200: B=1 x 512 8.5 -> 6.6 us a call, big shapes within 3 %; prefetching the first 64-256 tokens of
    # K/V into L2 before the wait gained nothing (bench/results/kernels_attention-2026-11-29-pdl-sweep.json at
    # 5a66009^).
    pdl: bool = True
    # An fp8 cache's tiles loaded as 32-bit words and widened a word at a time (_gather_kv_tile's FP8_WORDS);
    # COBATCH_FP8_KV_WORDS=0: loaded as bytes, as before, for comparisons.
    fp8_words: bool = os.environ.get("COBATCH_FP8_KV_WORDS", "1") != "0"
    # The words' pipeline depth: their tiles wait in registers, not shared memory, and 3 stages fit 128 registers
    # without spills (sm_90). H100, of copy in the cache's bytes, 2 -> 3 stages: 64 x 4k 84 -> 88 %, 64 x 32k
    # 87 -> 92 %, 8 x 32k 73 -> 78 %, 1 x 32k 56 -> 59 %, B = 1 and 8 x 512 level
    # (bench/results/kernels_attention_fp8_words.json; 32-token tiles in 3 stages lost everywhere).
    fp8_num_stages: int = 3
    # Tried and removed (2bab51b has it): past invariant_rows, a step whose rows and KV heads alone made a given
    # number of programs an SM ran unsplit. The kernel alone took 32 x 512 from 34.0 to 29.7 us
    # (kernels_attention_split_aim.json), but whole steps (decode_unsplit_fill_ab.md, H100) were level or slower
    # at fills of 1.5 and 2.2.
    # Tried and removed: letting the last split program of a (sequence, KV head) merge the partials instead of
    # launching the reduce kernel. One program merging GROUP heads serially is a tail that the reduce kernel's
    # (seq, head) grid spreads out: B=1 x 4k fell from 34 to 22 % of copy, B=8 x 4k from 74 to 69 %
    # (bench/results/kernels_attention-2026-11-29-fused-merge.json at 5a66009^, variants 0 = fused, 1 = reduce kernel).


DECODE_CONFIG = DecodeConfig()


@jit
def _step_rows_of_sequence(slot_ptr, bt_row, row, seq_len, PAGE: tl.constexpr):
    """How many of this step's rows, ending at `row`, write the last positions of row's sequence: the row itself
    (none for a padded row, slot -1) and, for a draft row of a speculating sequence in the decode graph, the rows
    just before it (its last token and earlier drafts, positions seq_len - 2, seq_len - 3, ...). A row before it
    is one of them when the slot it writes is that position's slot on this row's pages: no other row of a step
    writes a slot of another sequence."""
    n = (tl.load(slot_ptr + row) >= 0).to(tl.int32)
    same = n > 0
    while same:
        pos = seq_len - 1 - n
        ok = (n <= row) & (pos >= 0)
        theirs = tl.load(slot_ptr + row - n, mask=ok, other=-1)
        mine = tl.load(bt_row + pos // PAGE, mask=ok, other=0).to(tl.int64) * PAGE + pos % PAGE
        same = ok & (theirs == mine)
        n += same.to(tl.int32)
    return n


@jit
def _rotated_head(x_ptr, d, partner, mask, cos, signed_sin, norm_ptr, eps, HEAD_D: tl.constexpr,
                  QK_NORM: tl.constexpr):
    """One head's (or a block of heads', [G, D]) dims rotated and rounded to x's dtype. QK_NORM (qwen3): each head
    RMS-normed with the weights at norm_ptr first and rounded to x's dtype, as the rope kernel does."""
    x = tl.load(x_ptr + d, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(x_ptr + partner, mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:
        rstd = tl.rsqrt(tl.sum(x * x, axis=-1, keep_dims=True) / HEAD_D + eps)
        x = (x * rstd * tl.load(norm_ptr + d, mask=mask, other=0.0).to(tl.float32))
        xp = (xp * rstd * tl.load(norm_ptr + partner, mask=mask, other=0.0).to(tl.float32))
        x = x.to(x_ptr.dtype.element_ty).to(tl.float32)
        xp = xp.to(x_ptr.dtype.element_ty).to(tl.float32)
    return rotated(x, xp, cos, signed_sin).to(x_ptr.dtype.element_ty)


@jit
def _write_new_kv(k_new_ptr, v_new_ptr, kc_ptr, vc_ptr, slot_ptr, row, kv_head, k_row_stride, k_head_stride,
                  v_row_stride, v_head_stride, cos, signed_sin, d, partner, mask, cache_block_stride,
                  cache_slot_stride, cache_head_stride, kn_ptr, eps, PAGE: tl.constexpr, HEAD_D: tl.constexpr,
                  QK_NORM: tl.constexpr):
    """Row `row`'s K of one KV head rotated (as the rope kernel rotates it, rounded to its dtype) and its V,
    into the cache at the row's slot: ops.rope_kv_write's work for one head."""
    k = _rotated_head(k_new_ptr + row * k_row_stride + kv_head * k_head_stride, d, partner, mask, cos, signed_sin,
                      kn_ptr, eps, HEAD_D, QK_NORM)
    v = tl.load(v_new_ptr + row * v_row_stride + kv_head * v_head_stride + d, mask=mask)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    dst = (slot // PAGE) * cache_block_stride + (slot % PAGE) * cache_slot_stride + kv_head * cache_head_stride + d
    tl.store(kc_ptr + dst, to_cache(k, kc_ptr), mask=mask)
    tl.store(vc_ptr + dst, to_cache(v, vc_ptr), mask=mask)


@jit
def _decode_split_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, seq_lens_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
                         k_new_ptr, v_new_ptr, pos_ptr, cs_ptr, slot_ptr, qn_ptr, kn_ptr,
                         q_row_stride, q_head_stride, bt_stride, cache_block_stride, cache_slot_stride,
                         cache_head_stride, out_row_stride, out_head_stride, k_row_stride, k_head_stride,
                         v_row_stride, v_head_stride, cs_stride, qk_scale, eps,
                         num_splits, window, softcap, GROUP: tl.constexpr, HEAD_D: tl.constexpr,
                         PAGE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                         MIN_SPLIT: tl.constexpr, SPLIT_GROUP: tl.constexpr, GROUPS: tl.constexpr,
                         SINGLE_SPLIT: tl.constexpr, PDL: tl.constexpr, DOT_F32: tl.constexpr,
                         SOFTCAP: tl.constexpr, WINDOWED: tl.constexpr, OPERAND: tl.constexpr,
                         ROPE: tl.constexpr, NEOX: tl.constexpr, QK_NORM: tl.constexpr,
                         FP8_WORDS: tl.constexpr = 0, ORDER: tl.constexpr = 0):
    """Program (seq, kv_head, chunk): all GROUP query heads of one KV head over a chunk of the row's splits
    (its splits shared evenly among the grid's chunks), so each KV tile is read once per sequence. Each split's
    partial (max, sum, acc) is computed from scratch over its own tiles, so it has the same bits however many
    splits a program walks: the split plan, not the grid, fixes a row's numerics; and the plan is the row's own
    (_row_split_len), not the batch's or the graph's capacity. GROUPS: a group of SPLIT_GROUP splits (0..G-1,
    G..2G-1, ...) that lies wholly in one program is merged there as the reduce kernel would (_merge_partial),
    and stored as one partial under its first split (_whole_group). Tiles are aligned to BLOCK_N (split_len is
    a multiple); a sliding window masks the keys before it. Chunks past seq_len run no iterations.
    ROPE: q and this step's k arrive unrotated (every dim rotates; NEOX: halves, else adjacent pairs). The
    program rotates its q heads, and writes the rotated k and the v of the step's rows whose positions fall
    in its chunk into the cache before reading it (the rope kernel's work, same bits, one launch less). QK_NORM:
    each q and k head RMS-normed first (qwen3), as the rope kernel does."""
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    # Sequence metadata is written before the step starts, so it may be read before the predecessor finishes.
    seq_len = tl.load(seq_lens_ptr + seq)
    split_len, row_splits, splits_per_program, start, end = _program_chunk(seq_len, num_splits, MIN_SPLIT, BLOCK_N)
    chunk_start = start
    program_first = tl.program_id(2) * splits_per_program
    program_last = tl.minimum(program_first + splits_per_program, row_splits) - 1
    if WINDOWED:                       # sliding window: only the last `window` keys (tiles before: no work)
        first_key = tl.maximum(seq_len - window, 0)
        start = tl.maximum(start, first_key // BLOCK_N * BLOCK_N)
    # So are the block tables: the first tile's pages are looked up before the wait too (one round trip less
    # after it).
    bt_row = bt_ptr + seq * bt_stride
    page = _tile_pages(bt_row, start + tl.arange(0, BLOCK_N), end, PAGE)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_mask = g < GROUP
    d_mask = d < HEAD_D
    gd_mask = g_mask[:, None] & d_mask[None, :]
    heads = kv_head * GROUP + g
    if ROPE:        # positions, slots and the rotation table are step metadata too
        cs_index, partner, sign = rotary_dims(d, HEAD_D, NEOX)
        cs_row = cs_ptr + tl.load(pos_ptr + seq) * cs_stride
        cos = tl.load(cs_row + cs_index, mask=d_mask, other=0.0)
        signed_sin = tl.load(cs_row + HEAD_D // 2 + cs_index, mask=d_mask, other=0.0) * sign
        # the step's rows of this sequence whose positions seq_len - 1 - i lie in this chunk: i in [i_lo, i_hi)
        i_lo = tl.maximum(seq_len - end, 0)
        i_hi = tl.minimum(_step_rows_of_sequence(slot_ptr, bt_row, seq, seq_len, PAGE), seq_len - chunk_start)
    if PDL:
        gdc_wait()                     # q and this step's K/V come from the previous kernel

    q_row = q_ptr + seq * q_row_stride + heads[:, None] * q_head_stride
    if ROPE:
        q = _rotated_head(q_row, d[None, :], partner[None, :], gd_mask, cos[None, :], signed_sin[None, :], qn_ptr, eps,
                          HEAD_D, QK_NORM).to(OPERAND)
        # this row's own k and v with the rotation already loaded, then any earlier rows of a speculating one
        _write_new_kv(k_new_ptr, v_new_ptr, kc_ptr, vc_ptr, slot_ptr, seq, kv_head, k_row_stride, k_head_stride,
                      v_row_stride, v_head_stride, cos, signed_sin, d, partner, d_mask & (i_lo == 0) & (i_hi > 0),
                      cache_block_stride, cache_slot_stride, cache_head_stride, kn_ptr, eps, PAGE, HEAD_D, QK_NORM)
        for i in range(tl.maximum(i_lo, 1), i_hi):
            cs_i = cs_ptr + tl.load(pos_ptr + seq - i) * cs_stride
            _write_new_kv(k_new_ptr, v_new_ptr, kc_ptr, vc_ptr, slot_ptr, seq - i, kv_head, k_row_stride,
                          k_head_stride, v_row_stride, v_head_stride, tl.load(cs_i + cs_index, mask=d_mask),
                          tl.load(cs_i + HEAD_D // 2 + cs_index, mask=d_mask) * sign, d, partner, d_mask,
                          cache_block_stride, cache_slot_stride, cache_head_stride, kn_ptr, eps, PAGE, HEAD_D,
                          QK_NORM)
        tl.debug_barrier()             # the CTA's writes before its reads of the cache
    else:
        q = tl.load(q_row + d[None, :], mask=gd_mask, other=0.0).to(OPERAND)

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    group_m = tl.full([BLOCK_G], float("-inf"), tl.float32)      # the merged partial of a whole group
    group_l = tl.zeros([BLOCK_G], tl.float32)
    group_acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    # Partials laid out [seq, q_head, split, ...]; the reduce reads the splits the window and seq_len reach.
    part_row = (seq * (tl.num_programs(1) * GROUP) + heads) * num_splits
    for tok0 in range(start, end, BLOCK_N):
        toks = tok0 + tl.arange(0, BLOCK_N)
        tok_mask = toks < end
        k, v = _gather_kv_tile(kc_ptr, vc_ptr, page, toks, tok_mask, kv_head, d, cache_block_stride,
                               cache_slot_stride, cache_head_stride, PAGE=PAGE, HEAD_D=HEAD_D, OPERAND=OPERAND,
                               FP8_WORDS=FP8_WORDS)
        page = _tile_pages(bt_row, toks + BLOCK_N, end, PAGE)      # the next tile's, carried
        if WINDOWED:    # the keys of the tile before the window are loaded (they are cached) but not attended
            tok_mask &= toks >= first_key
        m, l, acc = _online_softmax_step(q, k, v, m, l, acc, qk_scale, tok_mask[None, :], DOT_F32=DOT_F32,
                                         softcap=softcap, SOFTCAP=SOFTCAP)
        if not SINGLE_SPLIT:
            # The split's last tile: store its partial (or fold it into its group's).
            split_done = ((tok0 + BLOCK_N) % split_len == 0) | (tok0 + BLOCK_N >= end)
            split = tok0 // split_len
            split_store = split_done
            if GROUPS:
                whole, group_first, group_last = _whole_group(split, row_splits, program_first, program_last,
                                                              SPLIT_GROUP)
                if split_done & whole:
                    group_m, group_l, group_acc = _merge_partial(group_m, group_l, group_acc, m, l, acc)
                    # Its last split stores it; an empty group again (max -inf) weighs what it held by
                    # exp2(-inf) = 0 at its first fold.
                    if split == group_last:
                        _store_partial(part_acc_ptr, part_ml_ptr, part_row + group_first, group_m, group_l,
                                       group_acc, d, g_mask, gd_mask, BLOCK_D)
                        group_m = tl.full([BLOCK_G], float("-inf"), tl.float32)
                split_store = split_done & ~whole
            _store_partial(part_acc_ptr, part_ml_ptr, part_row + split, m, l, acc, d, g_mask & split_store,
                           gd_mask & split_store, BLOCK_D)
            # The next split starts from scratch: with m = -inf its first tile scales l and acc by exp2(-inf) = 0.
            m = tl.where(split_done, float("-inf"), m)
    if PDL:
        # The next kernel may launch now (not at the start: a chain would get resident all at once).
        gdc_launch_dependents()

    if SINGLE_SPLIT:
        # Empty context (padded row): l == 0 and acc == 0, so the row comes out as zeros.
        out = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(out_ptr + seq * out_row_stride + heads[:, None] * out_head_stride + ordered_columns(d, ORDER)[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=gd_mask)


@jit
def _row_split_len(seq_len, num_splits, MIN_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr):
    """A row's split length from its own length only: at most num_splits splits of at least MIN_SPLIT tokens,
    in whole BLOCK_N tiles. So a row's bits depend neither on the rows beside it (up to invariant_rows) nor on
    the capacity a graph was captured for, and a short row in a long-context graph still spreads out."""
    per = tl.maximum((seq_len + num_splits - 1) // num_splits, MIN_SPLIT)
    return (per + BLOCK_N - 1) // BLOCK_N * BLOCK_N


@jit
def _program_chunk(seq_len, num_splits, MIN_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr):
    """(split_len, the row's splits, splits per program, this program's first and end token): the row's splits
    shared among the grid's chunks (program_id 2), so a short row in a long-capacity grid still spreads out."""
    split_len = _row_split_len(seq_len, num_splits, MIN_SPLIT, BLOCK_N)
    row_splits = tl.cdiv(seq_len, split_len)
    splits_per_program = tl.cdiv(row_splits, tl.num_programs(2))
    start = tl.program_id(2) * (splits_per_program * split_len)
    end = tl.minimum(seq_len, start + splits_per_program * split_len)
    return split_len, row_splits, splits_per_program, start, end


@jit
def _store_partial(part_acc_ptr, part_ml_ptr, part, m, l, acc, d, g_mask, gd_mask, BLOCK_D: tl.constexpr):
    """One split's (or group's) partial (max, sum, acc) of each query head, at partial index `part`."""
    tl.store(part_acc_ptr + part[:, None] * BLOCK_D + d[None, :], acc, mask=gd_mask)
    tl.store(part_ml_ptr + part * 2, m, mask=g_mask)
    tl.store(part_ml_ptr + part * 2 + 1, l, mask=g_mask)


@jit
def _whole_group(split, row_splits, program_first, program_last, SPLIT_GROUP: tl.constexpr):
    """(whether the group of `split` lies wholly in the program walking splits program_first..program_last, its
    first split, its last split): the split kernel merges and stores such a group itself, the reduce kernel
    reads it as one partial."""
    first = split // SPLIT_GROUP * SPLIT_GROUP
    last = tl.minimum(first + SPLIT_GROUP, row_splits) - 1
    return (first >= program_first) & (last <= program_last), first, last


@jit
def _merge_partial(m, l, acc, m_s, l_s, acc_s):
    """Fold split partial (m_s, l_s, acc_s) into the running (m, l, acc): the same operations in the split
    kernel (its registers) and the reduce kernel (the stored splits), so both give the same bits. The fmas are
    spelled out so that the compiler's contraction cannot differ between them. An empty side (max -inf) gets
    weight exp2(-inf) = 0, and two empty sides stay empty (no NaN)."""
    m_new = tl.maximum(m, m_s)
    m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)
    a = tl.exp2(m - m_ref)
    b = tl.exp2(m_s - m_ref)
    return m_new, tl.fma(l_s, b, l * a), tl.fma(acc_s, b[:, None], acc * a[:, None])


@jit
def _merge_splits(part_acc_ptr, part_ml_ptr, part0, first_valid, n_valid, splits_per_program, out_row_ptr,
                  HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_GROUPS: tl.constexpr, SPLIT_GROUP: tl.constexpr,
                  GROUPS: tl.constexpr, ORDER: tl.constexpr = 0):
    """Merge one head's splits first_valid .. n_valid - 1 (max, sum, acc), stored from partial index part0
    on, into its output row: each group of SPLIT_GROUP splits folded in order (_merge_partial), then the groups
    at once. GROUPS: a group that lay wholly in one split program (of splits_per_program) was folded there and
    stored under its first split; it is read as that one partial (folded into an empty group: the same bits)."""
    grp = tl.arange(0, BLOCK_GROUPS)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_D
    first = grp * SPLIT_GROUP
    whole = first < 0                                  # False, as a tensor
    if GROUPS:
        program_first = first // splits_per_program * splits_per_program     # of the program walking `first`
        whole = _whole_group(first, n_valid, program_first,
                             tl.minimum(program_first + splits_per_program, n_valid) - 1, SPLIT_GROUP)[0]
    has_valid = (tl.minimum(first + SPLIT_GROUP, n_valid) > first_valid) & (first < n_valid)
    m = tl.full([BLOCK_GROUPS], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_GROUPS], tl.float32)
    acc = tl.zeros([BLOCK_GROUPS, BLOCK_D], tl.float32)
    for j in tl.static_range(SPLIT_GROUP):
        sp = first + j
        if j == 0:
            s_mask = tl.where(whole, has_valid, (sp >= first_valid) & (sp < n_valid))
        else:
            s_mask = ~whole & (sp >= first_valid) & (sp < n_valid)
        part = part0 + sp
        m_s = tl.load(part_ml_ptr + part * 2, mask=s_mask, other=float("-inf"))
        l_s = tl.load(part_ml_ptr + part * 2 + 1, mask=s_mask, other=0.0)
        acc_s = tl.load(part_acc_ptr + part[:, None] * BLOCK_D + d[None, :],
                        mask=s_mask[:, None] & d_mask[None, :], other=0.0)
        m, l, acc = _merge_partial(m, l, acc, m_s, l_s, acc_s)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max > float("-inf"), m_max, 0.0)   # empty row: every weight exp2(-inf) = 0, no NaN
    w = tl.exp2(m - m_max)
    denom = tl.sum(w * l, axis=0)
    out = tl.sum(w[:, None] * acc, axis=0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_row_ptr + ordered_columns(d, ORDER), out.to(out_row_ptr.dtype.element_ty), mask=d_mask)


@jit
def _decode_reduce_kernel(part_acc_ptr, part_ml_ptr, seq_lens_ptr, out_ptr, out_row_stride, out_head_stride,
                          num_splits, chunks, window, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr,
                          MIN_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_GROUPS: tl.constexpr,
                          SPLIT_GROUP: tl.constexpr, GROUPS: tl.constexpr, PDL: tl.constexpr,
                          ORDER: tl.constexpr = 0):
    """Program (seq, q_head): merge the splits that seq_len (and the window) reach into the final row. `chunks`:
    the split kernel's programs per row and KV head, which decide whether they stored groups or splits. ORDER:
    the row's columns in operand_order's order (within each head: HEAD_D a multiple of 32)."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if PDL:
        gdc_launch_dependents()
    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = _row_split_len(seq_len, num_splits, MIN_SPLIT, BLOCK_N)
    n_valid = tl.minimum((seq_len + split_len - 1) // split_len, num_splits)
    first_valid = 0
    if window > 0:                     # splits wholly before the window hold no partial
        first_valid = tl.maximum(seq_len - window, 0) // split_len
    if PDL:
        gdc_wait()                     # the split kernel's partials
    _merge_splits(part_acc_ptr, part_ml_ptr, (seq * tl.num_programs(1) + head) * num_splits, first_valid, n_valid,
                  tl.maximum(tl.cdiv(n_valid, chunks), 1), out_ptr + seq * out_row_stride + head * out_head_stride,
                  HEAD_D=HEAD_D, BLOCK_D=BLOCK_D, BLOCK_GROUPS=BLOCK_GROUPS, SPLIT_GROUP=SPLIT_GROUP, GROUPS=GROUPS,
                  ORDER=ORDER)


def plan_decode_splits(num_seqs: int, n_kv_heads: int, max_seq_len: int, sms: int,
                       cfg: DecodeConfig = DECODE_CONFIG) -> tuple[int, int]:
    """(num_splits, chunks) from host ints only, so a captured graph stays valid for any seq_lens <= max_seq_len.
    num_splits is the most splits a row may have; each row splits its own length into at most that many
    (row_split_len), and the grid's `chunks` programs per row and KV head share a row's splits evenly, so a row
    holding 4k tokens in a graph planned for 32k still spreads over the GPU. It aims at about
    cfg.programs_per_sm programs per SM: B=1 splits up to 64 ways, while B=64 (already 512 programs) does not
    split, which spares the reduce launch (H200: 0.78 vs 0.69 of copy at 512 tokens, 0.99 vs 0.94 at 4k). Up to
    cfg.invariant_rows sequences split as one does, and the fewer programs they want walk several splits each."""
    def splits_for(rows: int) -> int:
        return max(1, min(cfg.max_splits, round(cfg.programs_per_sm * sms / (rows * n_kv_heads))))

    own = splits_for(num_seqs)
    num_splits = own if num_seqs > cfg.invariant_rows else splits_for(1)
    reachable = min(num_splits, triton.cdiv(max(max_seq_len, 1), cfg.min_split))   # splits of a row <= capacity
    return num_splits, min(own, reachable)


def decode_register_cap(num_splits: int, kv_dtype: torch.dtype, head_dim: int,
                        cfg: DecodeConfig = DECODE_CONFIG) -> int | None:
    """maxnreg for the split kernel (see DecodeConfig.max_registers)."""
    if head_dim > 128:
        return None
    return cfg.max_registers if num_splits > 1 or kv_dtype in FP8_DTYPES else None


def plan_has_groups(num_splits: int, chunks: int, cfg: DecodeConfig = DECODE_CONFIG,
                    kv_dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether a plan's programs may walk a whole group of cfg.split_group splits (the kernels' GROUPS: without
    it they compile no group code). Not with an fp8 cache loaded as bytes: its widened tiles leave no registers
    for the group's accumulator (24 bytes of spills under the 128 cap, sm_90 compile; loaded as words, 128
    registers and none); its rows fold groups in the reduce kernel only, which gives the same bits."""
    return (cfg.split_group > 1 and num_splits > 1 and triton.cdiv(num_splits, chunks) >= cfg.split_group
            and (kv_dtype not in FP8_DTYPES or cfg.fp8_words))


def whole_groups(row_splits: int, chunks: int, cfg: DecodeConfig = DECODE_CONFIG) -> list[int]:
    """The groups of a row's splits that lie wholly in one of its `chunks` programs (as _whole_group decides):
    those the split kernel merges itself, where the plan has groups."""
    per, size = triton.cdiv(row_splits, chunks), cfg.split_group
    groups = []
    for g in range(triton.cdiv(row_splits, size)):
        first, last = g * size, min(g * size + size, row_splits) - 1
        program_first = first // per * per                  # of the program walking the group's first split
        if last <= min(program_first + per, row_splits) - 1:
            groups.append(g)
    return groups


def row_split_len(seq_len: int, num_splits: int, cfg: DecodeConfig = DECODE_CONFIG) -> int:
    """The split length of a row of seq_len tokens (as _row_split_len computes it in the kernels)."""
    per = max(triton.cdiv(seq_len, num_splits), cfg.min_split)
    return triton.cdiv(per, cfg.block_n) * cfg.block_n


# A decode step's rope and cache write run in the decode attention kernel (ops.rope_attention):
# COBATCH_FUSED_ROPE=0 launches the rope kernel before it instead, for comparisons.
FUSED_ROPE = os.environ.get("COBATCH_FUSED_ROPE", "1") != "0"


@dataclass(frozen=True, slots=True)
class DecodeRope:
    """What a decode step's attention needs to do the rope kernel's work itself (ops.rope_kv_write): q arrives
    unrotated, and k, v are this step's rows, still to be rotated (k) and written at meta.slot_mapping."""
    k: torch.Tensor              # [N, Hk, D], a strided view is fine (head dims contiguous)
    v: torch.Tensor              # [N, Hk, D]
    positions: torch.Tensor      # [N]
    cos_sin: torch.Tensor        # float32 [max_pos, D]: cos | sin, every dim rotating
    neox: bool
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None     # (q weight, k weight, eps): qwen3's

    @staticmethod
    def fits(q: torch.Tensor, cos_sin: torch.Tensor) -> bool:
        """Only heads whose dims all rotate (the kernel rotates whole heads)."""
        return cos_sin.shape[1] == q.shape[-1] and cos_sin.dtype == torch.float32 and cos_sin.stride(-1) == 1


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                           scale: float, out: torch.Tensor | None = None,
                           cfg: DecodeConfig = DECODE_CONFIG, window: int = 0, softcap: float = 0.0,
                           rope: DecodeRope | None = None, out_order: int = NATURAL) -> torch.Tensor:
    """paged_attention_ref for a decode step (one row per sequence), each row's columns in out_order's order
    (operand_order; head_dim a multiple of 32). Graph-safe: the grid depends only on
    q's shape, the heads and meta.max_seq_len; no host syncs. With cfg.pdl the kernels are launched as
    programmatic dependents and read meta.seq_lens and meta.block_tables before waiting for the previous
    kernel, so that kernel must not be the one writing them (q and the caches may come from it).
    rope: q unrotated, and this step's k and v still to rotate and write (ops.rope_kv_write then this, in one
    launch less)."""
    n_rows, n_heads, head_dim = q.shape
    n_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    assert meta.max_query_len == 1 and n_rows == meta.num_seqs and n_heads % n_kv_heads == 0
    assert q.stride(-1) == 1 and meta.block_tables.stride(-1) == 1
    if rope is not None:
        assert DecodeRope.fits(q, rope.cos_sin) and rope.k.stride(-1) == 1 and rope.v.stride(-1) == 1
        assert rope.k.shape == rope.v.shape == (n_rows, n_kv_heads, head_dim)
        q_weight, k_weight, eps = rope.qk_norm or (q, q, 0.0)       # (unused without q/k norms)
        assert rope.qk_norm is None or (q_weight.is_contiguous() and k_weight.is_contiguous())
        new_rows = (rope.k, rope.v, rope.positions, rope.cos_sin, meta.slot_mapping, q_weight, k_weight)
        new_strides = (rope.k.stride(0), rope.k.stride(1), rope.v.stride(0), rope.v.stride(1), rope.cos_sin.stride(0))
    else:
        new_rows, new_strides, eps = (q, q, meta.seq_lens, q, meta.seq_lens, q, q), (0, 0, 0, 0, 0), 0.0  # unused
    out = torch.empty_like(q) if out is None else out
    if n_rows == 0:
        return out
    group = n_heads // n_kv_heads
    num_splits, chunks = plan_decode_splits(n_rows, n_kv_heads, meta.max_seq_len, device_sms(q), cfg)
    block_d = next_pow2(head_dim)
    groups = plan_has_groups(num_splits, chunks, cfg, k_cache.dtype)
    words = words_mode(k_cache, head_dim, cfg.fp8_words)
    if num_splits > 1:
        part_acc = torch.empty(n_rows, n_heads, num_splits, block_d, device=q.device, dtype=torch.float32)
        part_ml = torch.empty(n_rows, n_heads, num_splits, 2, device=q.device, dtype=torch.float32)
    else:
        part_acc = part_ml = out   # unused
    launch = pdl_launch(q) if cfg.pdl else {"PDL": False}   # the PDL constexpr and the launch option
    _decode_split_kernel[(n_rows, n_kv_heads, chunks)](
        q, kernel_view(k_cache), kernel_view(v_cache), meta.block_tables, meta.seq_lens, out, part_acc, part_ml,
        *new_rows,
        q.stride(0), q.stride(1), meta.block_tables.stride(0), *_cache_strides(k_cache, v_cache),
        out.stride(0), out.stride(1), *new_strides, scale * LOG2E, eps, num_splits, window, softcap,
        GROUP=group, HEAD_D=head_dim, PAGE=page, BLOCK_G=max(16, next_pow2(group)), BLOCK_D=block_d,
        BLOCK_N=cfg.block_n, MIN_SPLIT=cfg.min_split, SPLIT_GROUP=cfg.split_group, GROUPS=groups,
        SINGLE_SPLIT=num_splits == 1,
        DOT_F32=dot_in_f32(k_cache.dtype), SOFTCAP=softcap > 0, WINDOWED=window > 0, OPERAND=operand_dtype(q, k_cache),
        ROPE=rope is not None, NEOX=rope is not None and rope.neox,
        QK_NORM=rope is not None and rope.qk_norm is not None, FP8_WORDS=words, ORDER=out_order,
        num_warps=cfg.num_warps, num_stages=cfg.fp8_num_stages if words else cfg.num_stages,
        maxnreg=decode_register_cap(num_splits, k_cache.dtype, head_dim, cfg), **launch)
    if num_splits > 1:
        _decode_reduce_kernel[(n_rows, n_heads)](
            part_acc, part_ml, meta.seq_lens, out, out.stride(0), out.stride(1), num_splits, chunks, window,
            HEAD_D=head_dim, BLOCK_D=block_d, MIN_SPLIT=cfg.min_split, BLOCK_N=cfg.block_n,
            BLOCK_GROUPS=next_pow2(triton.cdiv(num_splits, cfg.split_group)), SPLIT_GROUP=cfg.split_group,
            GROUPS=groups, ORDER=out_order, num_warps=4, **launch)
    return out


# --- Triton: prefill (causal flash attention of a chunk against the paged prefix plus itself) --------------

@dataclass(frozen=True, slots=True)
class PrefillConfig:
    block_m: int = 64            # query rows per program
    block_n: int = 64            # keys per tile
    num_warps: int = 4
    num_stages: int = 2
    # As DecodeConfig.fp8_words, and off: with 64 query rows Triton reads the byte tiles without single-byte loads,
    # and the words' path takes 212 registers where the bytes' take 168 (sm_90). H100, a 2048-token prompt: 135 us
    # as bytes, 154 as words (bench/results/kernels_attention_fp8_words.json).
    fp8_words: bool = False


PREFILL_CONFIG = PrefillConfig()


@jit
def _prefill_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, seq_lens_ptr, query_start_ptr, out_ptr, work_ptr,
                    q_row_stride, q_head_stride, bt_stride, cache_block_stride, cache_slot_stride,
                    cache_head_stride, out_row_stride, out_head_stride, qk_scale, window, softcap,
                    GROUP: tl.constexpr, HEAD_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_F32: tl.constexpr, WINDOWED: tl.constexpr,
                    SOFTCAP: tl.constexpr, OPERAND: tl.constexpr, FP8_WORDS: tl.constexpr = 0,
                    ORDER: tl.constexpr = 0, WORK_LIST: tl.constexpr = False):
    """Program (q_head, seq, query tile). Row i of the chunk sits at position seq_len - q_len + i and sees
    keys 0..position; the keys come from the cache (the chunk's own K/V are already written there).
    Tiles go last-first: the longest programs start first and the short ones fill the tail, and the heads
    of one tile, which share K/V through L2, run together. WORK_LIST: program (q_head, item) takes the
    (sequence, tile) packed in work_ptr[item] (prefill_work: the heaviest first), and an item of -1 reads and
    writes nothing: a step's programs are its tiles, not every sequence times its longest chunk's tiles."""
    head = tl.program_id(0)
    if WORK_LIST:
        packed = tl.load(work_ptr + tl.program_id(1))
        seq = (tl.maximum(packed, 0) >> 16).to(tl.int64)
        tile = tl.maximum(packed, 0) & 0xFFFF
    else:
        seq = tl.program_id(1).to(tl.int64)
        tile = tl.num_programs(2) - 1 - tl.program_id(2)
    kv_head = head // GROUP
    row0 = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - row0
    if WORK_LIST:
        q_len = tl.where(packed >= 0, q_len, 0)      # an item past the list: no rows, so no keys and no stores
    seq_len = tl.load(seq_lens_ptr + seq)

    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    r_mask = r < q_len
    pos = seq_len - q_len + r
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_D
    rows = (row0 + r).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * q_row_stride + head * q_head_stride + d[None, :],
                mask=r_mask[:, None] & d_mask[None, :], other=0.0).to(OPERAND)

    # Keys up to the tile's last row; tiles wholly at or below its first row need no causal mask.
    last_r = tl.minimum(tile * BLOCK_M + BLOCK_M, q_len) - 1
    kv_end = tl.maximum(tl.where(tile * BLOCK_M < q_len, seq_len - q_len + last_r + 1, 0), 0)
    full_end = tl.maximum(tl.minimum((seq_len - q_len + tile * BLOCK_M + 1) // BLOCK_N * BLOCK_N, kv_end), 0)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = bt_ptr + seq * bt_stride
    if WINDOWED:
        # Sliding window: row r sees keys (pos - window, pos]. Every tile is masked, from the tile holding the
        # first row's first visible key; a later row may see none of an early tile's keys (EMPTY_ROWS).
        first = tl.maximum(seq_len - q_len + tile * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
        for n0 in range(first, kv_end, BLOCK_N):
            toks = n0 + tl.arange(0, BLOCK_N)
            tok_mask = toks < kv_end
            k, v = _gather_kv_tile(kc_ptr, vc_ptr, _tile_pages(bt_row, toks, kv_end, PAGE), toks, tok_mask, kv_head,
                                   d, cache_block_stride, cache_slot_stride, cache_head_stride, PAGE=PAGE,
                                   HEAD_D=HEAD_D, OPERAND=OPERAND, FP8_WORDS=FP8_WORDS)
            valid = (toks[None, :] <= pos[:, None]) & (toks[None, :] > pos[:, None] - window) & tok_mask[None, :]
            m, l, acc = _online_softmax_step(q, k, v, m, l, acc, qk_scale, valid, DOT_F32=DOT_F32, EMPTY_ROWS=True,
                                             softcap=softcap, SOFTCAP=SOFTCAP)
    else:
        all_keys = tl.full([BLOCK_M, BLOCK_N], 1, tl.int1)
        for n0 in range(0, full_end, BLOCK_N):
            toks = n0 + tl.arange(0, BLOCK_N)
            k, v = _gather_kv_tile(kc_ptr, vc_ptr, _tile_pages(bt_row, toks, kv_end, PAGE), toks, toks < kv_end,
                                   kv_head, d, cache_block_stride, cache_slot_stride, cache_head_stride,
                                   PAGE=PAGE, HEAD_D=HEAD_D, OPERAND=OPERAND, FP8_WORDS=FP8_WORDS)
            m, l, acc = _online_softmax_step(q, k, v, m, l, acc, qk_scale, all_keys, DOT_F32=DOT_F32,
                                             softcap=softcap, SOFTCAP=SOFTCAP)
        for n0 in range(full_end, kv_end, BLOCK_N):
            toks = n0 + tl.arange(0, BLOCK_N)
            tok_mask = toks < kv_end
            k, v = _gather_kv_tile(kc_ptr, vc_ptr, _tile_pages(bt_row, toks, kv_end, PAGE), toks, tok_mask, kv_head,
                                   d, cache_block_stride, cache_slot_stride, cache_head_stride, PAGE=PAGE,
                                   HEAD_D=HEAD_D, OPERAND=OPERAND, FP8_WORDS=FP8_WORDS)
            valid = (toks[None, :] <= pos[:, None]) & tok_mask[None, :]
            m, l, acc = _online_softmax_step(q, k, v, m, l, acc, qk_scale, valid, DOT_F32=DOT_F32,
                                             softcap=softcap, SOFTCAP=SOFTCAP)

    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * out_row_stride + head * out_head_stride + ordered_columns(d, ORDER)[None, :],
             out.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                            scale: float, out: torch.Tensor | None = None,
                            cfg: PrefillConfig = PREFILL_CONFIG, window: int = 0, softcap: float = 0.0,
                            out_order: int = NATURAL) -> torch.Tensor:
    """paged_attention_ref for chunks of several tokens per sequence (any q_len, 1 included). Rows past
    query_start[-1] stay zero when `out` is allocated here and untouched when it is passed in. out_order: each
    row's columns in operand_order's order (head_dim a multiple of 32)."""
    n_rows, n_heads, head_dim = q.shape
    n_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    assert n_heads % n_kv_heads == 0 and q.stride(-1) == 1 and meta.block_tables.stride(-1) == 1
    out = torch.zeros_like(q) if out is None else out
    if n_rows == 0 or meta.num_seqs == 0:
        return out
    work = meta.prefill_work
    if work is not None:
        grid = (n_heads, work.shape[0], 1)
    else:
        grid, work = (n_heads, meta.num_seqs, triton.cdiv(max(meta.max_query_len, 1), cfg.block_m)), meta.seq_lens
    _prefill_kernel[grid](
        q, kernel_view(k_cache), kernel_view(v_cache), meta.block_tables, meta.seq_lens, meta.query_start, out, work,
        q.stride(0), q.stride(1), meta.block_tables.stride(0), *_cache_strides(k_cache, v_cache),
        out.stride(0), out.stride(1), scale * LOG2E, window, softcap,
        GROUP=n_heads // n_kv_heads, HEAD_D=head_dim, PAGE=page, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_D=next_pow2(head_dim), DOT_F32=dot_in_f32(k_cache.dtype), WINDOWED=window > 0, SOFTCAP=softcap > 0,
        OPERAND=operand_dtype(q, k_cache), FP8_WORDS=words_mode(k_cache, head_dim, cfg.fp8_words), ORDER=out_order,
        WORK_LIST=meta.prefill_work is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def prefill_work(query_start: list[int], seq_lens: list[int], items: int | None = None,
                 cfg: PrefillConfig = PREFILL_CONFIG) -> list[int]:
    """The prefill kernel's work list (AttentionMetadata.prefill_work) for sequences whose rows start at
    query_start and whose lengths are seq_lens: a (sequence, query tile of cfg.block_m rows) pair for each tile,
    packed sequence << 16 | tile, the tiles with the most keys first, then -1 up to `items` entries (a graph's
    fixed grid). A sequence without rows has no tile."""
    tiles = []
    for s, (start, end, seq_len) in enumerate(zip(query_start, query_start[1:], seq_lens)):
        q_len = end - start
        for t in range(-(-q_len // cfg.block_m)):
            keys = seq_len - q_len + min((t + 1) * cfg.block_m, q_len)      # the tile's last row's keys
            tiles.append((-keys, s, t))
    assert len(seq_lens) < 1 << 15 and all(t < 1 << 16 for _, _, t in tiles)
    work = [s << 16 | t for _, s, t in sorted(tiles)]
    if items is not None:
        assert len(work) <= items, (len(work), items)
        work += [-1] * (items - len(work))
    return work


def prefill_work_items(max_rows: int, max_seqs: int, cfg: PrefillConfig = PREFILL_CONFIG) -> int:
    """The most entries prefill_work gives a step of up to max_rows rows over up to max_seqs sequences: each
    sequence's tiles, at most one partial tile a sequence beyond the rows' whole tiles."""
    return max_rows // cfg.block_m + max_seqs


# writes_order: attention's output rows in the column order of the GEMM they go to (o's), so that it launches no
# x_operands (bench/results/decode_ordered_operands_ab.md; COBATCH_ORDERED_ATTENTION=0: x_operands puts o's x in order)
ORDERED_OUTPUT = os.environ.get("COBATCH_ORDERED_ATTENTION", "1") != "0"


def writes_order(head_dim: int) -> bool:
    """Whether the kernels store each row in an operand_order: heads of whole 32-column tiles, ORDERED_OUTPUT on."""
    return ORDERED_OUTPUT and head_dim % 32 == 0


def is_decode_step(q: torch.Tensor, meta: AttentionMetadata) -> bool:
    """One row per sequence: the decode kernel's step (any other runs the prefill kernel)."""
    return meta.max_query_len == 1 and q.shape[0] == meta.num_seqs


def fuses_rope(q: torch.Tensor, meta: AttentionMetadata, cos_sin: torch.Tensor) -> bool:
    """Whether a step's rope and cache write run in the decode kernel (DecodeRope): a decode step whose heads
    rotate whole, unless COBATCH_FUSED_ROPE=0 (FUSED_ROPE, read at each call)."""
    return FUSED_ROPE and is_decode_step(q, meta) and DecodeRope.fits(q, cos_sin)


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                           scale: float, out: torch.Tensor | None = None, window: int = 0,
                           softcap: float = 0.0, out_dtype: torch.dtype | None = None,
                           rope: DecodeRope | None = None, out_order: int = NATURAL) -> torch.Tensor:
    """out_dtype: the output's dtype where `out` is not given (default q's). rope: a decode step's rotation and
    cache write, done by the decode kernel (paged_decode_attention). out_order: each row's columns in
    operand_order's order, in whole 256-row tiles where `out` is allocated here (head_dim a multiple of 32)."""
    decode = is_decode_step(q, meta)
    n_rows, n_heads, head_dim = q.shape
    assert rope is None or decode
    assert out_order == NATURAL or head_dim % 32 == 0, "a head's columns are put in order within the head"
    if out is None and (out_order != NATURAL or out_dtype not in (None, q.dtype)):
        out = operand_buffer(n_rows, n_heads * head_dim, out_dtype or q.dtype, q.device, out_order).view(q.shape)
        if not decode:
            out.zero_()                                 # prefill leaves rows past the chunks zero
    if decode:
        return paged_decode_attention(q, k_cache, v_cache, meta, scale, out, cfg=DECODE_CONFIG,
                                      window=window, softcap=softcap, rope=rope, out_order=out_order)
    return paged_prefill_attention(q, k_cache, v_cache, meta, scale, out, window=window, softcap=softcap,
                                   out_order=out_order)
