"""W_UV applied to MLA's latent output (DeepSeek): out[n, h V + j] = sum_r W_UV[h, j, r] latent[n, h, r].

In the absorbed form (models/deepseek.py) attention returns each head's output in the latent space, and W_UV takes
it to the head's value dims before o. As torch's batched product that is a cuBLAS launch a layer, which cannot be a
programmatic dependent, and whose result o's kernels then convert (bf16 to their f16) and reorder as they load it.
Here a decode step's rows go through one Triton launch instead: each program loads its block of W_UV before it
waits for attention (weights are never written), and stores o's operand as o's kernels read it, in their dtype
and column order (PackedWeight.operand_dtype, operand_order). A row's sums have the same bits in any batch (tiles of
a fixed BLOCK_N rows). On by default for steps of up to MAX_ROWS rows: 8 layers of DeepSeek-V2-Lite at
B = 1 / 4 / 8, 0.635 / 0.905 / 1.155 -> 0.61 / 0.88 / 1.14 ms a step (H100, bench/results/mla_value_ab.md);
COBATCH_MLA_VALUE_KERNEL=0 gives the product back to torch. The torch reference is value_up_ref.
"""

from __future__ import annotations

import os

import torch

from cobatch.kernels.operand_order import ordered_columns
from cobatch.kernels.triton_support import dot_in_f32, gdc_launch_dependents, gdc_wait, jit, pdl_launch, tl, triton

ENABLED = os.environ.get("COBATCH_MLA_VALUE_KERNEL", "1") != "0"
BLOCK_N = 16           # rows a program (fixed: a row's bits do not depend on the step's)
# Decode steps of up to one BLOCK_N tile of rows, which read W_UV once (timed in whole steps at 1-8 rows:
# mla_value_ab.md). Wider steps read it again per tile: level at 16 rows, 0.01-0.03 ms a step slower at 32 and 64
# (same file), so they keep torch's product.
MAX_ROWS = BLOCK_N
BLOCK_V = 32           # value dims a program


def value_up_ref(latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """latent [N, H, R], W_UV [H, V, R] -> [N, H V] float32."""
    return torch.einsum("nhr,hvr->nhv", latent.float(), w_uv.float()).reshape(latent.shape[0], -1)


def takes(latent: torch.Tensor, w_uv: torch.Tensor) -> bool:
    """Does the kernel take this product? (ENABLED, a decode step's rows, shapes it tiles)"""
    rank, v = w_uv.shape[2], w_uv.shape[1]
    return (ENABLED and latent.is_cuda and latent.shape[0] <= MAX_ROWS and rank & (rank - 1) == 0 and rank >= 16
            and v % BLOCK_V == 0 and w_uv.is_contiguous() and latent.stride(-1) == 1)


@jit
def _value_up_kernel(lat_ptr, w_ptr, out_ptr, n_rows, lat_row_stride, lat_head_stride, out_row_stride,
                     RANK: tl.constexpr, V: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_N: tl.constexpr,
                     ORDER: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr):
    """Program (head, value block, row tile): the tile's rows times the head's BLOCK_V rows of W_UV."""
    head = tl.program_id(0)
    v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    r = tl.arange(0, RANK)
    w = tl.load(w_ptr + (head * V + v)[:, None].to(tl.int64) * RANK + r[None, :])
    if PDL:     # the weights are loaded: now let the next kernel launch, and wait for attention's output
        gdc_launch_dependents()
        gdc_wait()
    rows = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = rows < n_rows
    x = tl.load(lat_ptr + rows[:, None].to(tl.int64) * lat_row_stride + head * lat_head_stride + r[None, :],
                mask=mask[:, None], other=0.0)
    if DOT_F32:     # the interpreter (triton_support.dot_in_f32)
        acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)))
    else:
        acc = tl.dot(x.to(w.dtype), tl.trans(w))
    cols = ordered_columns(head * V + v, ORDER)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * out_row_stride + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask[:, None])


def value_up(latent: torch.Tensor, w_uv: torch.Tensor, out_dtype: torch.dtype, order: int) -> torch.Tensor:
    """value_up_ref in one launch: [N, H V] in out_dtype, its columns in `order` (operand_order's)."""
    n, heads, rank = latent.shape
    v = w_uv.shape[1]
    assert w_uv.shape == (heads, v, rank) and w_uv.is_contiguous() and v % BLOCK_V == 0 and latent.stride(-1) == 1
    out = torch.empty(n, heads * v, dtype=out_dtype, device=latent.device)
    if n == 0:
        return out
    _value_up_kernel[(heads, v // BLOCK_V, triton.cdiv(n, BLOCK_N))](
        latent, w_uv, out, n, latent.stride(0), latent.stride(1), out.stride(0), RANK=rank, V=v, BLOCK_V=BLOCK_V,
        BLOCK_N=BLOCK_N, ORDER=order, DOT_F32=dot_in_f32(w_uv.dtype), **pdl_launch(latent), num_warps=4)
    return out
