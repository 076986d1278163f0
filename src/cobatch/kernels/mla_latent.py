"""MLA's step prologue (DeepSeek): this step's latent rows into the cache, and the queries' rope dims rotated.

From the q | kv_a projection a step needs three things before MLA attention (mla_attention.py): the latent c_kv
RMS-normed, the rope key rotated, both written as the row's cache entry [c_kv | k_rope], and each head's query rope
dims rotated. Done as separate ops that is two contiguous copies, the norm, two more copies, the rope kernel, a
concatenation and the latent write; here one launch on CUDA, the same ops' references on the CPU.

The same launch can absorb W_UK into the queries too (q_latent = q_nope W_UK per head, a cuBLAS batched product
otherwise): programs past the rows' own take a block of 16 rows, a head and 128 latent columns each, one dot over
the head's nope dims, so a row's q_latent has the same bits in any batch (cuBLAS picks its algorithm by the shape).
"""

from __future__ import annotations

import os

import torch

from cobatch.kernels.mla_attention import latent_write_ref
from cobatch.kernels.norm import rms_norm_ref
from cobatch.kernels.rope import rope_ref, rotary_halves, rotated
from cobatch.kernels.triton_support import (dot_in_f32, gdc_launch_dependents, gdc_wait, jit, next_pow2,
                                             pdl_launch, tl, triton)


def mla_latent_ref(q_rope: torch.Tensor, kv_a: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                   positions: torch.Tensor, cos_sin: torch.Tensor, neox: bool, cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> torch.Tensor:
    """q_rope [N, H, R]: the queries' rope dims, unrotated; kv_a [N, kv_lora_rank + R]: the latent, then the rope
    key, unrotated. Writes [rms_norm(c_kv) | rotated k_rope] into the latent cache at the rows' slots (-1: skip)
    and returns the rotated q_rope [N, H, R]."""
    rank = kv_a.shape[1] - q_rope.shape[2]
    c_kv, _ = rms_norm_ref(kv_a[:, :rank], norm_weight, eps)
    q_rot, k_rot = rope_ref(q_rope, kv_a[:, None, rank:], positions, cos_sin, neox)
    latent_write_ref(torch.cat([c_kv, k_rot[:, 0]], dim=-1), cache, slot_mapping)
    return q_rot


# --- Triton -------------------------------------------------------------------------------------------

@jit
def _mla_latent_kernel(q_ptr, kv_ptr, w_ptr, pos_ptr, cs_ptr, cache_ptr, slot_ptr, q_out_ptr,
                       q_row_stride, q_head_stride, kv_row_stride, cs_stride, cache_slot_stride, q_out_row_stride,
                       q_out_head_stride, n_heads, eps, qn_ptr, k_up_ptr, ql_ptr, qn_row_stride, qn_head_stride,
                       ql_row_stride, ql_head_stride, n_rows, RANK: tl.constexpr, HALF: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, NEOX: tl.constexpr, PDL: tl.constexpr,
                       PARTS: tl.constexpr = 2, ABSORB: tl.constexpr = False, NOPE: tl.constexpr = 128,
                       BLOCK_NOPE: tl.constexpr = 128, ROWS: tl.constexpr = 16, COLS: tl.constexpr = 128,
                       DOT_F32: tl.constexpr = False):
    """Program pid < n_rows PARTS: (row, part), part 0 the row's cache entry, parts 1.. BLOCK_H heads' q rope dims
    each. ABSORB: programs past those, q_latent of ROWS rows x one head x COLS latent columns each (_absorb)."""
    pid = tl.program_id(0)
    if PDL:  # launched as a programmatic dependent: let the next kernel launch, wait for the previous one
        gdc_launch_dependents()
        gdc_wait()
    if ABSORB:
        if pid >= n_rows * PARTS:
            _absorb(qn_ptr, k_up_ptr, ql_ptr, pid - n_rows * PARTS, n_rows, n_heads, qn_row_stride, qn_head_stride,
                    ql_row_stride, ql_head_stride, NOPE, BLOCK_NOPE, RANK, ROWS, COLS, DOT_F32)
            return
    row = (pid // PARTS).to(tl.int64)
    part = pid % PARTS
    i = tl.arange(0, HALF)
    off1, off2 = rotary_halves(i, HALF, NEOX)
    cs_row = cs_ptr + tl.load(pos_ptr + row) * cs_stride
    cos = tl.load(cs_row + i)
    sin = tl.load(cs_row + HALF + i)
    if part > 0:
        heads = (part - 1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = (heads < n_heads)[:, None]
        src = q_ptr + row * q_row_stride + heads[:, None] * q_head_stride
        x1 = tl.load(src + off1[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + off2[None, :], mask=mask, other=0.0).to(tl.float32)
        dst = q_out_ptr + row * q_out_row_stride + heads[:, None] * q_out_head_stride
        tl.store(dst + off1[None, :], rotated(x1, x2, cos[None, :], -sin[None, :]).to(q_out_ptr.dtype.element_ty),
                 mask=mask)
        tl.store(dst + off2[None, :], rotated(x2, x1, cos[None, :], sin[None, :]).to(q_out_ptr.dtype.element_ty),
                 mask=mask)
        return
    slot = tl.load(slot_ptr + row)
    keep = slot >= 0
    kv_row = kv_ptr + row * kv_row_stride
    r = tl.arange(0, BLOCK_R)
    r_mask = r < RANK
    c = tl.load(kv_row + r, mask=r_mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(c * c, axis=0) / RANK + eps)
    w = tl.load(w_ptr + r, mask=r_mask, other=0.0).to(tl.float32)
    c_kv = (c * rstd * w).to(kv_ptr.dtype.element_ty)          # rounded as the norm's output, then cached
    k1 = tl.load(kv_row + RANK + off1).to(tl.float32)
    k2 = tl.load(kv_row + RANK + off2).to(tl.float32)
    k1r = rotated(k1, k2, cos, -sin).to(kv_ptr.dtype.element_ty)
    k2r = rotated(k2, k1, cos, sin).to(kv_ptr.dtype.element_ty)
    entry = cache_ptr + slot * cache_slot_stride
    tl.store(entry + r, c_kv.to(cache_ptr.dtype.element_ty), mask=r_mask & keep)
    tl.store(entry + RANK + off1, k1r.to(cache_ptr.dtype.element_ty), mask=keep)
    tl.store(entry + RANK + off2, k2r.to(cache_ptr.dtype.element_ty), mask=keep)


ABSORB_ROWS = 16       # a program's rows of W_UK's product: the dot's least M, the same for every batch
ABSORB_COLS = 128      # and its latent columns
# W_UK's product in this launch (ops.mla_latent) for steps of up to ABSORB_MAX_ROWS rows (decode steps) where
# COBATCH_MLA_ABSORB_IN_PROLOGUE=1; off until whole steps on the GPU weigh it (bench/plan_ab.py --switch
# mla_latent.ABSORB_IN_PROLOGUE=0,1). Wider steps (prefill chunks) keep the batched product: a program's 16 rows
# re-read its head's W_UK block.
ABSORB_IN_PROLOGUE = os.environ.get("COBATCH_MLA_ABSORB_IN_PROLOGUE", "0") == "1"
ABSORB_MAX_ROWS = 256


@jit
def _absorb(qn_ptr, k_up_ptr, ql_ptr, a, n_rows, n_heads, qn_row_stride, qn_head_stride, ql_row_stride,
            ql_head_stride, NOPE: tl.constexpr, BLOCK_NOPE: tl.constexpr, RANK: tl.constexpr, ROWS: tl.constexpr,
            COLS: tl.constexpr, DOT_F32: tl.constexpr):
    """Absorb program a: q_latent[rows, head, cols] = q_nope[rows, head] @ W_UK[head][:, cols] (k_up [H, NOPE,
    RANK] contiguous), ROWS rows and COLS columns, one dot over the nope dims."""
    col_blocks = tl.cdiv(RANK, COLS)
    head = (a // col_blocks) % n_heads
    rows = (a // (col_blocks * n_heads)) * ROWS + tl.arange(0, ROWS)
    cols = (a % col_blocks) * COLS + tl.arange(0, COLS)
    d = tl.arange(0, BLOCK_NOPE)
    row_ok, col_ok, d_ok = rows < n_rows, cols < RANK, d < NOPE
    q = tl.load(qn_ptr + rows.to(tl.int64)[:, None] * qn_row_stride + head * qn_head_stride + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    w = tl.load(k_up_ptr + (head * NOPE + d[:, None]).to(tl.int64) * RANK + cols[None, :],
                mask=d_ok[:, None] & col_ok[None, :], other=0.0)
    if DOT_F32:
        acc = tl.dot(q.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    else:
        acc = tl.dot(q, w)
    tl.store(ql_ptr + rows.to(tl.int64)[:, None] * ql_row_stride + head * ql_head_stride + cols[None, :],
             acc.to(ql_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


Q_HEADS_PER_PROGRAM = 16


def mla_latent_triton(q_rope: torch.Tensor, kv_a: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                      positions: torch.Tensor, cos_sin: torch.Tensor, neox: bool, cache: torch.Tensor,
                      slot_mapping: torch.Tensor, q_nope: torch.Tensor | None = None,
                      k_up: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """mla_latent_ref in one launch; q_rope and kv_a may be strided views with contiguous last dims. With q_nope
    [N, H, nope] and k_up (W_UK, [H, nope, kv_lora_rank] contiguous) the same launch also returns q_latent =
    einsum("nhd,hdr->nhr", q_nope, k_up) (else None)."""
    n_rows, n_heads, rope_dim = q_rope.shape
    rank = kv_a.shape[1] - rope_dim
    width = cache.shape[-1]
    assert width == kv_a.shape[1] and cos_sin.shape[1] == rope_dim and cos_sin.dtype == torch.float32
    assert q_rope.stride(-1) == 1 and kv_a.stride(-1) == 1 and cos_sin.stride(-1) == 1 and norm_weight.is_contiguous()
    assert rope_dim & (rope_dim - 1) == 0 and cache.stride(-1) == 1 and cache.stride(0) == cache.shape[1] * width
    out = torch.empty(n_rows, n_heads, rope_dim, dtype=q_rope.dtype, device=q_rope.device)
    absorb = q_nope is not None
    q_latent = None
    if absorb:
        nope = q_nope.shape[2]
        assert q_nope.stride(-1) == 1 and k_up.is_contiguous() and k_up.shape == (n_heads, nope, rank)
        q_latent = torch.empty(n_rows, n_heads, rank, dtype=q_nope.dtype, device=q_nope.device)
    if n_rows == 0:
        return out, q_latent
    block_h = min(next_pow2(n_heads), Q_HEADS_PER_PROGRAM)
    parts = 1 + triton.cdiv(n_heads, block_h)
    absorb_programs = (triton.cdiv(n_rows, ABSORB_ROWS) * n_heads * triton.cdiv(rank, ABSORB_COLS)) if absorb else 0
    qn, kup, ql = (q_nope, k_up, q_latent) if absorb else (out, out, out)        # (unused without the absorb)
    _mla_latent_kernel[(n_rows * parts + absorb_programs,)](
        q_rope, kv_a, norm_weight, positions, cos_sin, cache, slot_mapping, out,
        q_rope.stride(0), q_rope.stride(1), kv_a.stride(0), cos_sin.stride(0), cache.stride(1), out.stride(0),
        out.stride(1), n_heads, eps, qn, kup, ql, qn.stride(0), qn.stride(1), ql.stride(0), ql.stride(1), n_rows,
        RANK=rank, HALF=rope_dim // 2, BLOCK_R=next_pow2(rank), BLOCK_H=block_h, NEOX=neox, PARTS=parts,
        ABSORB=absorb, NOPE=q_nope.shape[2] if absorb else 128,
        BLOCK_NOPE=max(16, next_pow2(q_nope.shape[2])) if absorb else 128, ROWS=ABSORB_ROWS, COLS=ABSORB_COLS,
        DOT_F32=absorb and dot_in_f32(q_nope.dtype), **pdl_launch(q_rope), num_warps=4)
    return out, q_latent
