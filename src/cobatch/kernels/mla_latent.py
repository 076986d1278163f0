"""MLA's step prologue (DeepSeek): this step's latent rows into the cache, and the queries' rope dims rotated.

From the q | kv_a projection a step needs three things before MLA attention (mla_attention.py): the latent c_kv
RMS-normed, the rope key rotated, both written as the row's cache entry [c_kv | k_rope], and each head's query rope
dims rotated. Done as separate ops that is two contiguous copies, the norm, two more copies, the rope kernel, a
concatenation and the latent write; here one launch on CUDA, the same ops' references on the CPU.
"""

from __future__ import annotations

import torch

from cobatch.kernels.fp8_cache import kernel_view, to_cache
from cobatch.kernels.mla_attention import latent_write_ref
from cobatch.kernels.norm import rms_norm_ref
from cobatch.kernels.rope import rope_ref, rotary_halves, rotated
from cobatch.kernels.triton_support import gdc_launch_dependents, gdc_wait, jit, next_pow2, pdl_launch, tl, triton


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
                       q_out_head_stride, n_heads, eps, RANK: tl.constexpr, HALF: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, NEOX: tl.constexpr, PDL: tl.constexpr):
    """Program (row, part): part 0 the row's cache entry, parts 1.. BLOCK_H heads' q rope dims each."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    if PDL:  # launched as a programmatic dependent: let the next kernel launch, wait for the previous one
        gdc_launch_dependents()
        gdc_wait()
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
    tl.store(entry + r, to_cache(c_kv, cache_ptr), mask=r_mask & keep)
    tl.store(entry + RANK + off1, to_cache(k1r, cache_ptr), mask=keep)
    tl.store(entry + RANK + off2, to_cache(k2r, cache_ptr), mask=keep)


Q_HEADS_PER_PROGRAM = 16


def mla_latent_triton(q_rope: torch.Tensor, kv_a: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                      positions: torch.Tensor, cos_sin: torch.Tensor, neox: bool, cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> torch.Tensor:
    """mla_latent_ref in one launch; q_rope and kv_a may be strided views with contiguous last dims."""
    n_rows, n_heads, rope_dim = q_rope.shape
    rank = kv_a.shape[1] - rope_dim
    width = cache.shape[-1]
    assert width == kv_a.shape[1] and cos_sin.shape[1] == rope_dim and cos_sin.dtype == torch.float32
    assert q_rope.stride(-1) == 1 and kv_a.stride(-1) == 1 and cos_sin.stride(-1) == 1 and norm_weight.is_contiguous()
    assert rope_dim & (rope_dim - 1) == 0 and cache.stride(-1) == 1 and cache.stride(0) == cache.shape[1] * width
    out = torch.empty(n_rows, n_heads, rope_dim, dtype=q_rope.dtype, device=q_rope.device)
    if n_rows == 0:
        return out
    block_h = min(next_pow2(n_heads), Q_HEADS_PER_PROGRAM)
    _mla_latent_kernel[(n_rows, 1 + triton.cdiv(n_heads, block_h))](
        q_rope, kv_a, norm_weight, positions, cos_sin, kernel_view(cache), slot_mapping, out,
        q_rope.stride(0), q_rope.stride(1), kv_a.stride(0), cos_sin.stride(0), cache.stride(1), out.stride(0),
        out.stride(1), n_heads, eps, RANK=rank, HALF=rope_dim // 2, BLOCK_R=next_pow2(rank), BLOCK_H=block_h,
        NEOX=neox, **pdl_launch(q_rope), num_warps=4)
    return out
