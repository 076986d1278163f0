"""W_UV applied to MLA's latent output (DeepSeek): out[n, h V + j] = sum_r W_UV[h, j, r] latent[n, h, r].

In the absorbed form (models/deepseek.py) attention returns each head's output in the latent space, and W_UV takes
it to the head's value dims before o. As torch's batched product that is a cuBLAS launch a layer, which cannot be a
programmatic dependent, and whose result o's kernels then convert (bf16 to their f16) and reorder as they load it.
Here a decode step's rows go through one Triton launch instead: each program loads its block of W_UV before it
waits for attention (weights are never written), and stores o's operand as o's kernels read it, in their dtype
and column order (PackedWeight.operand_dtype, operand_order). A row's sums have the same bits in any batch (tiles of
a fixed BLOCK_N rows). COBATCH_MLA_VALUE_KERNEL=1 turns it on (off until timed in whole steps); the torch
reference is value_up_ref.

Where a step's rows split their context, attention can leave its split partials unmerged (attention.SplitPartials)
and this kernel merge each row as it loads it, with the reduce kernel's own code (_merged_row) and the rounding of
its store, so the step spares the reduce's launch and its round trip of the merged rows through memory
(COBATCH_MLA_VALUE_MERGE=0 keeps the reduce launch).
"""

from __future__ import annotations

import os

import torch

from cobatch.kernels.attention import SplitPartials, _merged_row, _row_merge_span
from cobatch.kernels.operand_order import ordered_columns
from cobatch.kernels.triton_support import dot_in_f32, gdc_launch_dependents, gdc_wait, jit, pdl_launch, tl, triton

ENABLED = os.environ.get("COBATCH_MLA_VALUE_KERNEL", "0") == "1"
MERGES = os.environ.get("COBATCH_MLA_VALUE_MERGE", "1") != "0"     # merge split partials as it loads them
MAX_ROWS = 64          # decode steps; a prefill chunk's rows would re-read W_UV once per BLOCK_N of them
BLOCK_N = 16           # rows a program (fixed: a row's bits do not depend on the step's)
BLOCK_V = 32           # value dims a program


def value_up_ref(latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """latent [N, H, R], W_UV [H, V, R] -> [N, H V] float32."""
    return torch.einsum("nhr,hvr->nhv", latent.float(), w_uv.float()).reshape(latent.shape[0], -1)


def takes(latent: torch.Tensor | SplitPartials, w_uv: torch.Tensor) -> bool:
    """Does the kernel take this product? (ENABLED, a decode step's rows, shapes it tiles)"""
    rank, v = w_uv.shape[2], w_uv.shape[1]
    if isinstance(latent, SplitPartials):
        return ENABLED and MERGES and latent.part_acc.is_cuda and shapes_fit(latent.shape[0], rank, v, w_uv)
    return ENABLED and latent.is_cuda and latent.stride(-1) == 1 and shapes_fit(latent.shape[0], rank, v, w_uv)


def shapes_fit(rows: int, rank: int, v: int, w_uv: torch.Tensor) -> bool:
    return rows <= MAX_ROWS and rank & (rank - 1) == 0 and rank >= 16 and v % BLOCK_V == 0 and w_uv.is_contiguous()


def merges(rows: int, w_uv: torch.Tensor, device: torch.device) -> bool:
    """Should attention leave a step's split partials to this kernel (mla_decode_attention's merge=False)?"""
    return ENABLED and MERGES and device.type == "cuda" and shapes_fit(rows, w_uv.shape[2], w_uv.shape[1], w_uv)


@jit
def _value_up_kernel(lat_ptr, w_ptr, out_ptr, n_rows, lat_row_stride, lat_head_stride, out_row_stride,
                     part_acc_ptr, part_ml_ptr, seq_lens_ptr, num_splits, chunks,
                     RANK: tl.constexpr, V: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_N: tl.constexpr,
                     ORDER: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr, MERGE: tl.constexpr,
                     MIN_SPLIT: tl.constexpr, SPLIT_BLOCK_N: tl.constexpr, BLOCK_GROUPS: tl.constexpr,
                     SPLIT_GROUP: tl.constexpr):
    """Program (head, value block, row tile): the tile's rows times the head's BLOCK_V rows of W_UV. MERGE: the
    rows are merged from their split partials (SplitPartials; lat_ptr only gives the merged rows' dtype)."""
    head = tl.program_id(0)
    v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    r = tl.arange(0, RANK)
    w = tl.load(w_ptr + (head * V + v)[:, None].to(tl.int64) * RANK + r[None, :])
    if PDL:     # the weights are loaded: now let the next kernel launch, and wait for attention's output
        gdc_launch_dependents()
        gdc_wait()
    tile0 = tl.program_id(2) * BLOCK_N
    rows = tile0 + tl.arange(0, BLOCK_N)
    mask = rows < n_rows
    if MERGE:
        x = tl.zeros([BLOCK_N, RANK], lat_ptr.dtype.element_ty)
        for i in range(0, tl.minimum(BLOCK_N, n_rows - tile0)):
            row = (tile0 + i).to(tl.int64)
            first_valid, n_valid, per_program = _row_merge_span(tl.load(seq_lens_ptr + row), num_splits, chunks, 0,
                                                                MIN_SPLIT, SPLIT_BLOCK_N)
            merged = _merged_row(part_acc_ptr, part_ml_ptr, (row * tl.num_programs(0) + head) * num_splits,
                                 first_valid, n_valid, per_program, HEAD_D=RANK, BLOCK_D=RANK,
                                 BLOCK_GROUPS=BLOCK_GROUPS, SPLIT_GROUP=SPLIT_GROUP, GROUPS=False)
            # rounded as the reduce kernel stores it
            x = tl.where((tl.arange(0, BLOCK_N) == i)[:, None], merged.to(lat_ptr.dtype.element_ty)[None, :], x)
    else:
        x = tl.load(lat_ptr + rows[:, None].to(tl.int64) * lat_row_stride + head * lat_head_stride + r[None, :],
                    mask=mask[:, None], other=0.0)
    if DOT_F32:     # the interpreter (triton_support.dot_in_f32)
        acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)))
    else:
        acc = tl.dot(x.to(w.dtype), tl.trans(w))
    cols = ordered_columns(head * V + v, ORDER)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * out_row_stride + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask[:, None])


def value_up(latent: torch.Tensor | SplitPartials, w_uv: torch.Tensor, out_dtype: torch.dtype,
             order: int) -> torch.Tensor:
    """value_up_ref in one launch: [N, H V] in out_dtype, its columns in `order` (operand_order's). latent: the
    merged rows, or a step's SplitPartials to merge."""
    n, heads, rank = latent.shape
    v = w_uv.shape[1]
    assert w_uv.shape == (heads, v, rank) and w_uv.is_contiguous() and v % BLOCK_V == 0
    split = latent if isinstance(latent, SplitPartials) else None
    device = split.part_acc.device if split else latent.device
    out = torch.empty(n, heads * v, dtype=out_dtype, device=device)
    if n == 0:
        return out
    if split:
        # the merged rows' dtype travels as a pointer's element type (nothing is read through it)
        lat = torch.empty(1, dtype=split.dtype, device=device)
        strides = (0, 0)
        merge = (split.part_acc, split.part_ml, split.seq_lens, split.num_splits, split.chunks)
        plan = dict(MIN_SPLIT=split.cfg.min_split, SPLIT_BLOCK_N=split.cfg.block_n, BLOCK_GROUPS=split.block_groups,
                    SPLIT_GROUP=split.cfg.split_group)
    else:
        assert latent.stride(-1) == 1
        lat, strides = latent, (latent.stride(0), latent.stride(1))
        merge = (lat, lat, lat, 1, 1)          # unused
        plan = dict(MIN_SPLIT=1, SPLIT_BLOCK_N=1, BLOCK_GROUPS=1, SPLIT_GROUP=1)
    _value_up_kernel[(heads, v // BLOCK_V, triton.cdiv(n, BLOCK_N))](
        lat, w_uv, out, n, *strides, out.stride(0), *merge, RANK=rank, V=v, BLOCK_V=BLOCK_V,
        BLOCK_N=BLOCK_N, ORDER=order, DOT_F32=dot_in_f32(w_uv.dtype), MERGE=split is not None, **plan,
        **pdl_launch(w_uv), num_warps=4)
    return out
