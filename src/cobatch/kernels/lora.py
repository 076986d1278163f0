"""Each row's LoRA delta, y += s (x A^T) B^T through the row's own adapter, in two launches (shrink, expand).

The adapters of one projection sit in fixed-shape slot matrices (models/lora.py): A_all [W, in] and B_all [out, W],
W = parts x capacity x rank, column c belonging to slot (c // rank) % capacity + 1. A step's rows name their slots
(0: the base model, no delta).

- **Shrink**: u = (x @ A_all^T), each row keeping only its own slot's columns, times that slot's scale, rounded to
  the slots' dtype. A grid of (16-row block, column block, K split); the splits' partial sums are added by the last
  program of each tile to arrive, in split order (no float atomics).
- **Expand**: y += u @ B_all^T, in place, rows of slot 0 not written at all (unchanged bit for bit).

Every row block is computed the same way whatever the step's row count, and K is split by the shapes alone, so a
row's delta is bitwise the same in a step of 1 row or of 256 (batch invariant), decode graphs and prefill alike.
The launches replace the torch form (two cuBLAS GEMMs and a row-scale product, with cuBLAS's own split-K
launches at decode's skinny shapes), which `lora_delta_ref` keeps as the reference.
"""

from __future__ import annotations

import torch

from cobatch.kernels.scratch import DeviceScratch
from cobatch.kernels.triton_support import (dot_in_f32, gdc_launch_dependents, gdc_wait, jit, pdl_launch,
                                            split_k_total, tl, triton)

BLOCK_ROWS = 16     # a row block: the MMA's smallest M
SHRINK_COLS = 64    # columns of the slot matrices a shrink program takes
SHRINK_K = 128      # K columns a shrink program's loop step loads
SPLIT_K_COLS = 512  # K columns per split: a 4096-wide input runs 8 splits a tile, a 14336-wide one 28
EXPAND_OUT = 64     # output columns an expand program writes
EXPAND_ROW_BLOCKS = 4   # row blocks an expand program walks (its B tile re-read from L1 / L2)

# the shrink's split partial sums and arrival counters (every counter back at 0 when a launch ends)
_PARTIAL = DeviceScratch(torch.float32)
_COUNT = DeviceScratch(torch.int32, zeroed=True)


def lora_delta_ref(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, row_slots: torch.Tensor,
                   slot_scale: torch.Tensor, capacity: int, rank: int) -> torch.Tensor:
    """float32 [n, out]: each row's x A^T B^T through its own slot's columns, times the slot's scale (the
    intermediate rounded to a's dtype, as the kernels store it); rows of slot 0 get zeros."""
    col_slot = torch.arange(a.shape[0], device=a.device) // rank % capacity + 1
    t = x.to(a.dtype).float() @ a.float().T
    keep = col_slot[None, :] == row_slots[:, None]
    u = torch.where(keep, t * slot_scale.float()[row_slots][:, None], torch.zeros_like(t)).to(a.dtype)
    return u.float() @ b.float().T


def _splits(in_features: int) -> int:
    return triton.cdiv(in_features, SPLIT_K_COLS)


def reserve_scratch(device: torch.device, max_rows: int, width: int, in_features: int) -> None:
    """Grow the shrink's split buffers for steps of up to max_rows rows (at load: never in a graph capture)."""
    row_blocks, col_blocks = triton.cdiv(max_rows, BLOCK_ROWS), triton.cdiv(width, SHRINK_COLS)
    tiles = row_blocks * col_blocks
    _PARTIAL.reserve(device, tiles * _splits(in_features) * BLOCK_ROWS * SHRINK_COLS)
    _COUNT.reserve(device, tiles)


@jit
def _add_dot(acc, a, b, DOT_F32: tl.constexpr):
    """acc + a @ b^T (b's rows are the output's columns), in IEEE f32 where DOT_F32 (the interpreter)."""
    if DOT_F32:
        out = acc + tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
    else:
        out = acc + tl.dot(a, tl.trans(b))
    return out


@jit
def _shrink_kernel(x_ptr, a_ptr, u_ptr, partial_ptr, count_ptr, slots_ptr, scale_ptr, n_rows, in_features, width,
                   x_stride, CAPACITY: tl.constexpr, RANK: tl.constexpr, BN: tl.constexpr, BC: tl.constexpr,
                   BK: tl.constexpr, K_SPLIT: tl.constexpr, SPLITS: tl.constexpr, DOT_F32: tl.constexpr,
                   PDL: tl.constexpr):
    pid_m, pid_c, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    rows = pid_m * BN + tl.arange(0, BN)
    cols = pid_c * BC + tl.arange(0, BC)
    row_ok, col_ok = rows < n_rows, cols < width
    ks = tl.arange(0, BK)
    acc = tl.zeros([BN, BC], dtype=tl.float32)
    for k0 in range(pid_k * K_SPLIT, pid_k * K_SPLIT + K_SPLIT, BK):     # a contiguous K range per split
        k = k0 + ks
        k_ok = k < in_features
        xk = tl.load(x_ptr + rows.to(tl.int64)[:, None] * x_stride + k[None, :],
                     mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(a_ptr.dtype.element_ty)
        ak = tl.load(a_ptr + cols.to(tl.int64)[:, None] * in_features + k[None, :],
                     mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = _add_dot(acc, xk, ak, DOT_F32)
    if SPLITS == 1:
        _store_u(acc, u_ptr, slots_ptr, scale_ptr, rows, cols, row_ok, col_ok, width, CAPACITY, RANK)
    else:
        tile = pid_m * tl.num_programs(1) + pid_c
        offs = tl.arange(0, BN)[:, None] * BC + tl.arange(0, BC)[None, :]
        last, total = split_k_total(acc, partial_ptr, count_ptr, tile, pid_k, offs, SPLITS, BN * BC)
        if last:
            _store_u(total, u_ptr, slots_ptr, scale_ptr, rows, cols, row_ok, col_ok, width, CAPACITY, RANK)


@jit
def _store_u(acc, u_ptr, slots_ptr, scale_ptr, rows, cols, row_ok, col_ok, width, CAPACITY: tl.constexpr,
             RANK: tl.constexpr):
    """Each row's own slot's columns of acc, times the slot's scale (other columns 0), rounded to u's dtype."""
    slot = tl.load(slots_ptr + rows, mask=row_ok, other=0)
    scale = tl.load(scale_ptr + slot, mask=row_ok, other=0.0).to(tl.float32)
    col_slot = cols // RANK % CAPACITY + 1
    keep = col_slot[None, :] == slot[:, None]
    u = tl.where(keep, acc * scale[:, None], 0.0)
    tl.store(u_ptr + rows.to(tl.int64)[:, None] * width + cols[None, :], u.to(u_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@jit
def _expand_kernel(u_ptr, b_ptr, y_ptr, slots_ptr, n_rows, out_features, width, y_stride, BN: tl.constexpr,
                   BO: tl.constexpr, BC: tl.constexpr, ROW_BLOCKS: tl.constexpr, DOT_F32: tl.constexpr,
                   PDL: tl.constexpr):
    pid_o, pid_m = tl.program_id(0), tl.program_id(1)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    outs = pid_o * BO + tl.arange(0, BO)
    out_ok = outs < out_features
    cs = tl.arange(0, BC)
    for rb in range(pid_m * ROW_BLOCKS, pid_m * ROW_BLOCKS + ROW_BLOCKS):
        rows = rb * BN + tl.arange(0, BN)
        row_ok = rows < n_rows
        slot = tl.load(slots_ptr + rows, mask=row_ok, other=0)
        acc = tl.zeros([BN, BO], dtype=tl.float32)
        for c0 in range(0, width, BC):
            c = c0 + cs
            c_ok = c < width
            uk = tl.load(u_ptr + rows.to(tl.int64)[:, None] * width + c[None, :],
                         mask=row_ok[:, None] & c_ok[None, :], other=0.0)
            bk = tl.load(b_ptr + outs.to(tl.int64)[:, None] * width + c[None, :],
                         mask=out_ok[:, None] & c_ok[None, :], other=0.0)
            acc = _add_dot(acc, uk, bk, DOT_F32)
        ptrs = y_ptr + rows.to(tl.int64)[:, None] * y_stride + outs[None, :]
        mask = (row_ok & (slot != 0))[:, None] & out_ok[None, :]       # base rows: not written
        y = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptrs, (y + acc).to(y_ptr.dtype.element_ty), mask=mask)


def lora_add_triton(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, y: torch.Tensor, row_slots: torch.Tensor,
                    slot_scale: torch.Tensor, capacity: int, rank: int) -> torch.Tensor:
    """y [n, out] += lora_delta_ref's delta, in place, rounded once into y's dtype; rows of slot 0 untouched.
    x [n, in] (unit column stride), a [W, in] and b [out, W] contiguous, row_slots [>= n] int, slot_scale
    [capacity + 1]. Grow the split buffers with reserve_scratch before a CUDA-graph capture."""
    n, in_features = x.shape
    width, out_features = a.shape[0], b.shape[0]
    assert x.stride(-1) == 1 and y.stride(-1) == 1 and a.is_contiguous() and b.is_contiguous()
    assert a.shape[1] == in_features and b.shape[1] == width and y.shape == (n, out_features)
    if n == 0:
        return y
    u = torch.empty(n, width, dtype=a.dtype, device=x.device)
    row_blocks = triton.cdiv(n, BLOCK_ROWS)
    splits = _splits(in_features)
    grid = (row_blocks, triton.cdiv(width, SHRINK_COLS), splits)
    partial = _PARTIAL.get(x.device, grid[0] * grid[1] * splits * BLOCK_ROWS * SHRINK_COLS)
    count = _COUNT.get(x.device, grid[0] * grid[1])
    dot_f32 = dot_in_f32(a.dtype)
    _shrink_kernel[grid](x, a, u, partial, count, row_slots, slot_scale, n, in_features, width, x.stride(0),
                         CAPACITY=capacity, RANK=rank, BN=BLOCK_ROWS, BC=SHRINK_COLS, BK=SHRINK_K,
                         K_SPLIT=SPLIT_K_COLS, SPLITS=splits, DOT_F32=dot_f32, num_warps=4, **pdl_launch(x))
    _expand_kernel[(triton.cdiv(out_features, EXPAND_OUT), triton.cdiv(row_blocks, EXPAND_ROW_BLOCKS))](
        u, b, y, row_slots, n, out_features, width, y.stride(0), BN=BLOCK_ROWS, BO=EXPAND_OUT, BC=SHRINK_COLS,
        ROW_BLOCKS=EXPAND_ROW_BLOCKS, DOT_F32=dot_f32, num_warps=4, **pdl_launch(x))
    return y
