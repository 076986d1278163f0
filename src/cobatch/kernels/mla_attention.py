"""Multi-head latent attention (DeepSeek's MLA) over a paged cache of latents, in the absorbed form.

Each cached token is one row of kv_lora_rank + rope values: the normalized latent c_kv, then the rotated rope
key k_rope, shared by all heads (a cache of one "head": 576 values in DeepSeek, where Llama-3-8B keeps 2,048). A
head's key is k_nope = W_UK c_kv beside k_rope, its value W_UV c_kv; with W_UK folded into the query
(q_latent = W_UK^T q_nope, models/deepseek.py) a score is q_latent . c_kv + q_rope . k_rope, the dot of
[q_latent | q_rope] with the cached row as it is, and the output before W_UV is the softmax-weighted sum of the
rows' c_kv part. So attention reads each cached row once per step for all heads, as multi-query attention with
one K head of the full row whose V is its first kv_lora_rank values; W_UV is applied to the [heads, kv_lora_rank]
result by the caller.

The decode kernel (mla_decode_attention, as FlashMLA does) splits the context as the GQA decode kernel does
(attention.py: the same split plan, partials and reduce kernel, so a row's bits depend on its own length only),
reads each latent tile once for a block of heads, and computes a tile's scores as two dots (latent, rope) so that
nothing is padded to a power of two past kv_lora_rank.

The prefill kernel (mla_prefill_attention: chunks of several rows, and steps that mix them with decode rows) runs
the same absorbed form: a program takes a tile of a chunk's rows times a block of heads as one block of query
rows, so each latent tile it reads serves all of them, and masks causally as the GQA prefill kernel does. No
host sync, and nothing of [heads, rows, context] is ever materialized (the torch reference's scores are).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from cobatch.batch import AttentionMetadata
from cobatch.kernels.attention import (DECODE_CONFIG, LOG2E, PREFILL_CONFIG, DecodeConfig, _decode_reduce_kernel,
                                       _load_rows, _program_chunk, _softmax_fold, _store_partial, _tile_pages,
                                       hidden_keys, operand_dtype, plan_decode_splits, reference_sequences)
from cobatch.kernels import mla_decode_cuda
from cobatch.kernels.fp8_cache import kernel_view, words_mode
from cobatch.kernels.kv_write import to_cache_dtype
from cobatch.kernels.triton_support import (device_sms, dot_in_f32, gdc_launch_dependents, gdc_wait, jit,
                                             next_pow2, pdl_launch, tl, triton)


def latent_write_ref(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """latent: [N, L] rows (c_kv | k_rope) into cache [num_blocks, block_size, 1, L] at their slots (-1: skip)."""
    keep = slot_mapping >= 0
    cache.view(-1, cache.shape[-1])[slot_mapping[keep].long()] = to_cache_dtype(latent[keep], cache.dtype)


def mla_attention_ref(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                      kv_lora_rank: int) -> torch.Tensor:
    """q: [N, H, L] absorbed queries (q_latent | q_rope); cache [num_blocks, block_size, 1, L] with this step's
    rows written -> [N, H, kv_lora_rank] float32 (the latent output, W_UV still to apply).

    Row i of sequence s sits at position seq_len - q_len + i and sees the rows 0..that position (causal, as
    paged_attention_ref). Rows past query_start[-1] (padding) come out as zeros."""
    n_rows, n_heads, width = q.shape
    block_size = cache.shape[1]
    out = torch.zeros(n_rows, n_heads, kv_lora_rank, dtype=torch.float32, device=q.device)
    for a, b, ctx, blocks in reference_sequences(meta, block_size):
        rows = cache[blocks].reshape(-1, width)[:ctx].float()               # [L_ctx, width], read once
        scores = torch.einsum("qhw,kw->hqk", q[a:b].float(), rows) * scale  # every head against the same rows
        scores.masked_fill_(hidden_keys(ctx, b - a, q.device), float("-inf"))
        out[a:b] = torch.einsum("hqk,kr->qhr", scores.softmax(-1), rows[:, :kv_lora_rank])
    return out


@jit
def _mla_decode_split_kernel(q_ptr, q_rope_ptr, cache_ptr, bt_ptr, seq_lens_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
                             q_row_stride, q_head_stride, q_rope_row_stride, q_rope_head_stride, bt_stride,
                             cache_block_stride, cache_slot_stride,
                             out_row_stride, out_head_stride, qk_scale, num_splits,
                             N_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, LAT: tl.constexpr, ROPE: tl.constexpr,
                             BLOCK_R: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                             MIN_SPLIT: tl.constexpr, SINGLE_SPLIT: tl.constexpr, PDL: tl.constexpr,
                             DOT_F32: tl.constexpr, OPERAND: tl.constexpr, FP8_WORDS: tl.constexpr = 0):
    """Program (head block, seq, chunk): BLOCK_H query heads over a chunk of the row's splits, reading each
    latent tile once for all of them. Each split's partial (max, sum, acc) is computed from scratch over its own
    tiles and stored for _decode_reduce_kernel, laid out [seq, head, split] as the GQA kernel's. The head blocks
    of a row's chunk are neighbours in the grid (axis 0), so where there are several (DeepSeek-V2/V3's 128
    heads: 8) they run together and all but the first find the row's latent tiles in L2."""
    seq = tl.program_id(1).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)
    split_len, _, _, start, end = _program_chunk(seq_len, num_splits, MIN_SPLIT, BLOCK_N)
    bt_row = bt_ptr + seq * bt_stride
    page = _tile_pages(bt_row, start + tl.arange(0, BLOCK_N), end, PAGE)
    if PDL:
        gdc_wait()                     # q and this step's latent come from the previous kernels

    heads = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < N_HEADS
    c = tl.arange(0, LAT)
    r = tl.arange(0, BLOCK_R)
    r_mask = r < ROPE
    q_rows = q_ptr + seq * q_row_stride + heads[:, None] * q_head_stride
    q_lat = tl.load(q_rows + c[None, :], mask=h_mask[:, None], other=0.0).to(OPERAND)
    q_rope_rows = q_rope_ptr + seq * q_rope_row_stride + heads[:, None] * q_rope_head_stride
    q_rope = tl.load(q_rope_rows + r[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0).to(OPERAND)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, LAT], tl.float32)
    part_row = (seq * N_HEADS + heads) * num_splits
    for tok0 in range(start, end, BLOCK_N):
        toks = tok0 + tl.arange(0, BLOCK_N)
        tok_mask = toks < end
        rows = cache_ptr + page * cache_block_stride + (toks % PAGE) * cache_slot_stride
        lat = _load_rows(rows, c, tok_mask, LAT, OPERAND, FP8_WORDS)
        rope = _load_rows(rows + LAT, r, tok_mask, ROPE, OPERAND, FP8_WORDS)
        page = _tile_pages(bt_row, toks + BLOCK_N, end, PAGE)      # the next tile's, carried
        if DOT_F32:
            s = tl.dot(q_lat.to(tl.float32), tl.trans(lat.to(tl.float32)), input_precision="ieee")
            s = tl.dot(q_rope.to(tl.float32), tl.trans(rope.to(tl.float32)), s, input_precision="ieee")
        else:
            s = tl.dot(q_rope, tl.trans(rope), tl.dot(q_lat, tl.trans(lat)))
        m, l, acc = _softmax_fold(s * qk_scale, lat, m, l, acc, tok_mask[None, :], DOT_F32=DOT_F32)
        if not SINGLE_SPLIT:
            split_done = ((tok0 + BLOCK_N) % split_len == 0) | (tok0 + BLOCK_N >= end)
            _store_partial(part_acc_ptr, part_ml_ptr, part_row + tok0 // split_len, m, l, acc, c,
                           h_mask & split_done, h_mask[:, None] & split_done, LAT)
            m = tl.where(split_done, float("-inf"), m)   # the next split starts from scratch
    if PDL:
        gdc_launch_dependents()
    if SINGLE_SPLIT:
        out = acc / tl.where(l > 0, l, 1.0)[:, None]      # an empty context (padded row) comes out as zeros
        tl.store(out_ptr + seq * out_row_stride + heads[:, None] * out_head_stride + c[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None])


# The GQA decode kernel's split plan, with 8 warps (a [16 heads, 512] float32 accumulator per program), 3 stages
# (two 64-row latent tiles, 72 KB each, in flight) and half the programs per SM. H200, DeepSeek-V2-Lite's heads,
# of copy against the GQA config with 8 warps: 64 x 8192 0.45 -> 0.57, 64 x 512 0.24 -> 0.30, 8 x 8192 0.31 ->
# 0.36, B = 1 the same; 4 warps or 32-row tiles lost (bench/kernels_attention.py --mla --sweep,
# bench/results/kernels_mla_attention_sweep.json).
MLA_DECODE_CONFIG = replace(DECODE_CONFIG, num_warps=8, num_stages=3, programs_per_sm=2)

# The split kernel in CUDA C++ (mla_decode_cuda.py: a producer warp's ring of cached rows, wgmma products) where it
# supports the call (COBATCH_MLA_CUDA=0: the Triton kernel always), on a split plan of one program an SM. Whole
# DeepSeek-V2-Lite steps (8 layers, Q4_K_M, H100) ran as fast or faster at every batch and context measured: B = 8
# at 8192 1.81 -> 1.69 ms, B = 64 at 512 3.09 -> 3.00 (bench/results/mla_cuda_ab.md).
MLA_CUDA = os.environ.get("COBATCH_MLA_CUDA", "1") != "0"
MLA_CUDA_PLAN = replace(MLA_DECODE_CONFIG, programs_per_sm=1)
# With an fp8 cache its ring of 8 e4m3 segments leaves room for two programs an SM: H200, 64 x 8192 128 us against
# 180 at one program an SM with 20 segments (bench/results/kernels_mla_attention_cuda_h200.json)
MLA_CUDA_FP8_PLAN = replace(MLA_DECODE_CONFIG, programs_per_sm=2)


def query_parts(q: torch.Tensor, q_rope: torch.Tensor | None, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(latent, rope) parts of the absorbed queries: q [N, H, L] whole, or q [N, H, kv_lora_rank] with q_rope
    [N, H, R] beside it (the kernels read the two apart, so the caller need not concatenate them)."""
    return (q[..., :kv_lora_rank], q[..., kv_lora_rank:]) if q_rope is None else (q, q_rope)


def mla_decode_attention(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                         kv_lora_rank: int, out: torch.Tensor | None = None, cfg: DecodeConfig | None = None,
                         block_h: int = 16, q_rope: torch.Tensor | None = None, cuda: bool | None = None,
                         cuda_cfg: mla_decode_cuda.MlaCudaConfig = mla_decode_cuda.MLA_CUDA_CONFIG) -> torch.Tensor:
    """mla_attention_ref for a decode step (one row per sequence), in q's dtype; graph-safe as
    paged_decode_attention is: the grid depends only on q's shape and meta.max_seq_len. cache may be
    [num_blocks, block_size, 1, width] (the KV pool's one-head layout) or [num_blocks, block_size, width].
    kv_lora_rank must be a power of two (512 in every DeepSeek model); the rope part is padded to one. q_rope:
    the queries' rope part apart (query_parts). cuda: the CUDA C++ split kernel (cuda_cfg) where it supports the
    call (default: MLA_CUDA). cfg: the split plan (default: the kernel's own, MLA_CUDA_PLAN or MLA_DECODE_CONFIG)."""
    q, q_rope = query_parts(q, q_rope, kv_lora_rank)
    n_rows, n_heads, _ = q.shape
    cuda = MLA_CUDA if cuda is None else cuda
    cache = cache.flatten(2) if cache.dim() == 4 else cache
    rope = q_rope.shape[2]
    assert meta.max_query_len == 1 and n_rows == meta.num_seqs and cache.shape[2] == kv_lora_rank + rope
    assert kv_lora_rank == next_pow2(kv_lora_rank) and 0 < rope, "kv_lora_rank a power of two, then the rope part"
    assert q.shape[2] == kv_lora_rank and q.stride(-1) == 1 and q_rope.stride(-1) == 1
    assert cache.stride(-1) == 1 and meta.block_tables.stride(-1) == 1
    out = torch.empty(n_rows, n_heads, kv_lora_rank, dtype=q.dtype, device=q.device) if out is None else out
    if n_rows == 0:
        return out
    block_h = min(block_h, max(16, next_pow2(n_heads)))
    head_blocks = triton.cdiv(n_heads, block_h)
    cuda = (cuda and block_h == mla_decode_cuda.HEADS and out.dtype == q.dtype and out.stride(-1) == 1
            and mla_decode_cuda.supports(q, q_rope, cache, (cfg or MLA_CUDA_PLAN).block_n, cuda_cfg, meta))
    cfg = cfg or ((MLA_CUDA_FP8_PLAN if cache.dtype == mla_decode_cuda.FP8 else MLA_CUDA_PLAN) if cuda
                  else MLA_DECODE_CONFIG)
    # one KV head per head block: the split plan the GQA kernel makes for n_kv_heads = head_blocks
    num_splits, chunks = plan_decode_splits(n_rows, head_blocks, meta.max_seq_len, device_sms(q), cfg)
    if num_splits > 1:
        part_acc = torch.empty(n_rows, n_heads, num_splits, kv_lora_rank, device=q.device, dtype=torch.float32)
        part_ml = torch.empty(n_rows, n_heads, num_splits, 2, device=q.device, dtype=torch.float32)
    else:
        part_acc = part_ml = out   # unused
    launch = pdl_launch(q) if cfg.pdl else {"PDL": False}
    if cuda:
        mla_decode_cuda.launch_split(q, q_rope, cache, meta.block_tables, meta.seq_lens, scale * LOG2E, num_splits,
                                     chunks, cfg.min_split, out, part_acc, part_ml, launch["PDL"], cuda_cfg)
    else:
        _split_kernel_triton(q, q_rope, cache, meta, scale, kv_lora_rank, out, part_acc, part_ml, num_splits, chunks,
                             head_blocks, block_h, cfg, launch)
    if num_splits > 1:
        _decode_reduce_kernel[(n_rows, n_heads)](
            part_acc, part_ml, meta.seq_lens, out, out.stride(0), out.stride(1), num_splits, chunks, 0,
            HEAD_D=kv_lora_rank, BLOCK_D=kv_lora_rank, MIN_SPLIT=cfg.min_split, BLOCK_N=cfg.block_n,
            BLOCK_GROUPS=next_pow2(triton.cdiv(num_splits, cfg.split_group)), SPLIT_GROUP=cfg.split_group,
            GROUPS=False, num_warps=4, **launch)
    return out


def _split_kernel_triton(q, q_rope, cache, meta, scale, kv_lora_rank, out, part_acc, part_ml, num_splits, chunks,
                         head_blocks, block_h, cfg, launch) -> None:
    """The Triton split kernel of mla_decode_attention (its arguments as there)."""
    n_rows, n_heads, _ = q.shape
    page, rope = cache.shape[1], q_rope.shape[2]
    _mla_decode_split_kernel[(head_blocks, n_rows, chunks)](
        q, q_rope, kernel_view(cache), meta.block_tables, meta.seq_lens, out, part_acc, part_ml,
        q.stride(0), q.stride(1), q_rope.stride(0), q_rope.stride(1), meta.block_tables.stride(0), cache.stride(0),
        cache.stride(1),
        out.stride(0), out.stride(1), scale * LOG2E, num_splits,
        N_HEADS=n_heads, BLOCK_H=block_h, LAT=kv_lora_rank, ROPE=rope, BLOCK_R=max(16, next_pow2(rope)), PAGE=page,
        BLOCK_N=cfg.block_n, MIN_SPLIT=cfg.min_split, SINGLE_SPLIT=num_splits == 1, DOT_F32=dot_in_f32(cache.dtype),
        OPERAND=operand_dtype(q, cache), FP8_WORDS=words_mode(cache, cache.shape[2], cfg.fp8_words),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch)


@dataclass(frozen=True, slots=True)
class MlaPrefillConfig:
    """rows: query rows of a program (a tile of a chunk's tokens times a block of heads, heads fastest), block_n:
    cached rows per tile. 32 x 576 query values and a [32, 512] f32 accumulator keep 8 warps within their
    registers at DeepSeek's latent width (not yet tuned on the GPU)."""
    rows: int = 32
    block_h: int = 16
    block_n: int = 32
    num_warps: int = 8
    num_stages: int = 2
    fp8_words: bool = DECODE_CONFIG.fp8_words    # an fp8 cache's rows loaded as 32-bit words (attention._load_rows)


MLA_PREFILL_CONFIG = MlaPrefillConfig()


@jit
def _mla_prefill_kernel(q_ptr, q_rope_ptr, cache_ptr, bt_ptr, seq_lens_ptr, query_start_ptr, out_ptr, work_ptr,
                        q_row_stride, q_head_stride, q_rope_row_stride, q_rope_head_stride, bt_stride,
                        cache_block_stride, cache_slot_stride,
                        out_row_stride, out_head_stride, qk_scale,
                        N_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, LAT: tl.constexpr,
                        ROPE: tl.constexpr, BLOCK_R: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                        DOT_F32: tl.constexpr, OPERAND: tl.constexpr, FP8_WORDS: tl.constexpr = 0,
                        WORK_SUBS: tl.constexpr = 0):
    """Program (head block, seq, token tile): BLOCK_T rows of the sequence's chunk x BLOCK_H heads as one block of
    query rows (token-major), against each cached row once. Row t of the chunk sits at position seq_len - q_len + t
    and sees the rows 0..that position; tiles go last-first as in attention._prefill_kernel. WORK_SUBS > 0: program
    (head block, item, sub) takes token tile sub (last-first) of the WORK_SUBS in the (sequence, tile) packed in
    work_ptr[item] (attention.prefill_work, whose tiles hold WORK_SUBS of ours), and an item of -1 reads and writes
    nothing: a step's programs are its tiles, not every sequence times its longest chunk's tiles."""
    if WORK_SUBS > 0:
        packed = tl.load(work_ptr + tl.program_id(1))
        seq = (tl.maximum(packed, 0) >> 16).to(tl.int64)
        tile = (tl.maximum(packed, 0) & 0xFFFF) * WORK_SUBS + WORK_SUBS - 1 - tl.program_id(2)
    else:
        seq = tl.program_id(1).to(tl.int64)
        tile = tl.num_programs(2) - 1 - tl.program_id(2)
    row0 = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - row0
    if WORK_SUBS > 0:
        q_len = tl.where(packed >= 0, q_len, 0)      # an item past the list: no rows, so no keys and no stores
    seq_len = tl.load(seq_lens_ptr + seq)

    i = tl.arange(0, BLOCK_T * BLOCK_H)
    t = tile * BLOCK_T + i // BLOCK_H
    heads = tl.program_id(0) * BLOCK_H + i % BLOCK_H
    q_mask = (t < q_len) & (heads < N_HEADS)
    pos = seq_len - q_len + t
    c = tl.arange(0, LAT)
    r = tl.arange(0, BLOCK_R)
    r_mask = r < ROPE
    q_rows = q_ptr + (row0 + t).to(tl.int64) * q_row_stride + heads * q_head_stride
    q_lat = tl.load(q_rows[:, None] + c[None, :], mask=q_mask[:, None], other=0.0).to(OPERAND)
    q_rope_rows = q_rope_ptr + (row0 + t).to(tl.int64) * q_rope_row_stride + heads * q_rope_head_stride
    q_rope = tl.load(q_rope_rows[:, None] + r[None, :], mask=q_mask[:, None] & r_mask[None, :],
                     other=0.0).to(OPERAND)

    # cached rows up to the tile's last token (every row sees row 0, so no row's max stays -inf)
    last_t = tl.minimum(tile * BLOCK_T + BLOCK_T, q_len) - 1
    kv_end = tl.maximum(tl.where(tile * BLOCK_T < q_len, seq_len - q_len + last_t + 1, 0), 0)
    m = tl.full([BLOCK_T * BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_T * BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_T * BLOCK_H, LAT], tl.float32)
    bt_row = bt_ptr + seq * bt_stride
    for n0 in range(0, kv_end, BLOCK_N):
        toks = n0 + tl.arange(0, BLOCK_N)
        tok_mask = toks < kv_end
        cached = cache_ptr + _tile_pages(bt_row, toks, kv_end, PAGE) * cache_block_stride \
            + (toks % PAGE) * cache_slot_stride
        lat = _load_rows(cached, c, tok_mask, LAT, OPERAND, FP8_WORDS)
        rope = _load_rows(cached + LAT, r, tok_mask, ROPE, OPERAND, FP8_WORDS)
        if DOT_F32:
            s = tl.dot(q_lat.to(tl.float32), tl.trans(lat.to(tl.float32)), input_precision="ieee")
            s = tl.dot(q_rope.to(tl.float32), tl.trans(rope.to(tl.float32)), s, input_precision="ieee")
        else:
            s = tl.dot(q_rope, tl.trans(rope), tl.dot(q_lat, tl.trans(lat)))
        valid = (toks[None, :] <= pos[:, None]) & tok_mask[None, :]
        m, l, acc = _softmax_fold(s * qk_scale, lat, m, l, acc, valid, DOT_F32=DOT_F32)
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    out_rows = out_ptr + (row0 + t).to(tl.int64) * out_row_stride + heads * out_head_stride
    tl.store(out_rows[:, None] + c[None, :], out.to(out_ptr.dtype.element_ty), mask=q_mask[:, None])


def mla_prefill_attention(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                          kv_lora_rank: int, out: torch.Tensor | None = None,
                          cfg: MlaPrefillConfig = MLA_PREFILL_CONFIG, q_rope: torch.Tensor | None = None,
                          work_rows: int = PREFILL_CONFIG.block_m) -> torch.Tensor:
    """mla_attention_ref for any step (chunks of several rows, decode rows among them), in q's dtype. Rows past
    query_start[-1] stay zero when `out` is allocated here. kv_lora_rank a power of two, as for the decode kernel.
    q_rope: the queries' rope part apart (query_parts). With meta.prefill_work (attention.prefill_work, tiles of
    work_rows rows), the programs are the step's tiles only."""
    q, q_rope = query_parts(q, q_rope, kv_lora_rank)
    n_rows, n_heads, _ = q.shape
    cache = cache.flatten(2) if cache.dim() == 4 else cache
    page, rope = cache.shape[1], q_rope.shape[2]
    assert cache.shape[2] == kv_lora_rank + rope and q.shape[2] == kv_lora_rank
    assert q.stride(-1) == 1 and q_rope.stride(-1) == 1 and cache.stride(-1) == 1
    assert kv_lora_rank == next_pow2(kv_lora_rank) and 0 < rope, "kv_lora_rank a power of two, then the rope part"
    assert meta.block_tables.stride(-1) == 1
    out = torch.zeros(n_rows, n_heads, kv_lora_rank, dtype=q.dtype, device=q.device) if out is None else out
    if n_rows == 0 or meta.num_seqs == 0:
        return out
    block_h = min(cfg.block_h, next_pow2(n_heads), cfg.rows)
    block_t = cfg.rows // block_h
    work, subs = meta.prefill_work, 0
    if work is not None:
        assert work_rows % block_t == 0, "a work list's tile holds whole token tiles of ours"
        subs = work_rows // block_t
        grid = (triton.cdiv(n_heads, block_h), work.shape[0], subs)
    else:
        grid, work = (triton.cdiv(n_heads, block_h), meta.num_seqs,
                      triton.cdiv(max(meta.max_query_len, 1), block_t)), meta.seq_lens
    _mla_prefill_kernel[grid](
        q, q_rope, kernel_view(cache), meta.block_tables, meta.seq_lens, meta.query_start, out, work,
        q.stride(0), q.stride(1), q_rope.stride(0), q_rope.stride(1), meta.block_tables.stride(0), cache.stride(0),
        cache.stride(1),
        out.stride(0), out.stride(1), scale * LOG2E,
        N_HEADS=n_heads, BLOCK_H=block_h, BLOCK_T=block_t, LAT=kv_lora_rank, ROPE=rope,
        BLOCK_R=max(16, next_pow2(rope)), PAGE=page, BLOCK_N=cfg.block_n, DOT_F32=dot_in_f32(cache.dtype),
        OPERAND=operand_dtype(q, cache), FP8_WORDS=words_mode(cache, cache.shape[2], cfg.fp8_words),
        WORK_SUBS=subs, num_warps=cfg.num_warps if kv_lora_rank > 256 else 4, num_stages=cfg.num_stages)
    return out
