"""Greedy tokens: each row's first index of its largest logit, a NaN counting as -inf (what the sampler picks for
a row at temperature 0).

torch's way is two launches over the whole [B, V] float32 logits, nan_to_num then argmax; on the H200 they took
29 us at B = 1 and 54 us at B = 64 of a Llama-3-8B step (128256 columns; bench/results/decode.json's breakdown):
argmax reduces a long row in few blocks. Here a row is cut into chunks of CHUNK columns, one program a chunk
(its first index of the chunk's max), and one program a row then picks the first chunk holding the row's max:
the same token, bit for bit, since the max and first-index rules are exact. Measured alone (bench/greedy.py,
bench/results/greedy.json, H100): B = 1 29.0 -> 5.8 us, B = 64 61.2 -> 14.4, B = 256 144.8 -> 46.4.
"""

from __future__ import annotations

import math

import torch

from cobatch.kernels.triton_support import jit, next_pow2, tl, triton

CHUNK = 4096        # columns a program scans (32 programs a row at Llama-3's vocabulary)
BLOCK = 1024        # columns a program loads at once


def greedy_tokens_ref(logits: torch.Tensor) -> torch.Tensor:
    """int64 [B]: argmax of each row, NaN as -inf (+inf wins; a row of -inf or NaN gives 0)."""
    return torch.nan_to_num(logits.float(), nan=-math.inf, posinf=math.inf, neginf=-math.inf).argmax(dim=-1)


@jit
def _chunk_max_kernel(logits_ptr, max_ptr, index_ptr, n_cols, row_stride, n_chunks,
                      CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, chunk): the chunk's largest value (NaN as -inf) and the first column holding it."""
    row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    start = chunk * CHUNK
    best = float("-inf")
    best_col = start
    for offset in tl.static_range(0, CHUNK, BLOCK):
        cols = start + offset + tl.arange(0, BLOCK)
        x = tl.load(logits_ptr + row * row_stride + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        # tl.max skips NaNs (its propagate_nan is off) and a NaN equals nothing, so a NaN is never chosen
        block_best = tl.max(x, axis=0)
        # the first column of the block holding its max (argmax's own tie rule is not relied on)
        block_col = tl.min(tl.where(x == block_best, cols, n_cols + CHUNK), axis=0)
        # strictly larger: an equal value further on never displaces an earlier column
        take = block_best > best
        best_col = tl.where(take, block_col, best_col)
        best = tl.where(take, block_best, best)
    tl.store(max_ptr + row * n_chunks + chunk, best)
    tl.store(index_ptr + row * n_chunks + chunk, best_col)


@jit
def _row_pick_kernel(max_ptr, index_ptr, out_ptr, n_chunks, CHUNKS: tl.constexpr):
    """Program row: the column of the first chunk whose max is the row's."""
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, CHUNKS)
    mask = chunks < n_chunks
    best = tl.load(max_ptr + row * n_chunks + chunks, mask=mask, other=float("-inf"))
    cols = tl.load(index_ptr + row * n_chunks + chunks, mask=mask, other=0)
    row_best = tl.max(best, axis=0)
    # chunks are in column order, so the smallest column among the chunks at the max is the first
    big = tl.max(cols, axis=0) + 1
    tl.store(out_ptr + row, tl.min(tl.where(mask & (best == row_best), cols, big), axis=0).to(tl.int64))


def greedy_tokens_triton(logits: torch.Tensor) -> torch.Tensor:
    """greedy_tokens_ref's result from a [B, V] tensor (any float dtype, rows contiguous), in two launches."""
    assert logits.dim() == 2 and logits.stride(-1) == 1
    rows, n_cols = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    if n_cols == 0:
        raise ValueError("greedy tokens of rows without columns")
    n_chunks = triton.cdiv(n_cols, CHUNK)
    best = torch.empty(rows, n_chunks, dtype=torch.float32, device=logits.device)
    index = torch.empty(rows, n_chunks, dtype=torch.int32, device=logits.device)
    _chunk_max_kernel[(rows, n_chunks)](logits, best, index, n_cols, logits.stride(0), n_chunks,
                                        CHUNK=CHUNK, BLOCK=min(BLOCK, CHUNK), num_warps=4)
    _row_pick_kernel[(rows,)](best, index, out, n_chunks, CHUNKS=max(2, next_pow2(n_chunks)), num_warps=1)
    return out
