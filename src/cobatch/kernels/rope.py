"""Rotary position embedding with one position per row (rows of a batch sit at unrelated positions).

Two layouts: NORM rotates adjacent pairs (x[2i], x[2i+1]) -- llama-arch GGUFs store Q/K permuted for it;
NEOX rotates halves (x[i], x[i + rot/2]) -- qwen2/qwen3. Only the first rot_dim dims of a head rotate.
"""

from __future__ import annotations

import math

import torch

from cobatch.kernels.fp8_cache import kernel_view, to_cache
from cobatch.kernels.kv_write import cache_slot_strides
from cobatch.kernels.triton_support import gdc_launch_dependents, gdc_wait, jit, next_pow2, pdl_launch, tl, triton


def rope_cos_sin(rot_dim: int, max_pos: int, theta: float, freq_factors: torch.Tensor | None = None,
                 linear_factor: float = 1.0, attn_factor: float = 1.0) -> torch.Tensor:
    """float32 [max_pos, rot_dim]: cos in [:, :rot_dim/2], sin in [:, rot_dim/2:], both times attn_factor
    (LongRoPE's scaling of the rotated q and k)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    if freq_factors is not None:        # llama3-style scaling ships as per-frequency divisors
        inv_freq = inv_freq / freq_factors.double()
    pos = torch.arange(max_pos, dtype=torch.float64) / linear_factor
    angles = torch.outer(pos, inv_freq)
    return (torch.cat([angles.cos(), angles.sin()], dim=-1) * attn_factor).float()


def llama3_freq_factors(rot_dim: int, theta: float, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_context: int) -> torch.Tensor:
    """The divisors llama3 rope scaling applies to each frequency (as HF / llama.cpp compute them)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    low_wavelen = original_context / low_freq_factor
    high_wavelen = original_context / high_freq_factor
    out = []
    for f in inv_freq.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float64)


def yarn_freq_factors(rot_dim: int, theta: float, factor: float, original_context: int, beta_fast: float = 32.0,
                      beta_slow: float = 1.0) -> torch.Tensor:
    """The divisors YaRN applies to each frequency (as llama.cpp's rope_yarn and HF compute them): frequencies
    that turn more than beta_fast times over the original context are kept, those that turn fewer than
    beta_slow times are divided by `factor`, with a linear ramp between."""
    def corr_dim(rotations: float) -> float:
        return rot_dim * math.log(original_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(corr_dim(beta_fast)), 0)
    high = min(math.ceil(corr_dim(beta_slow)), rot_dim - 1)
    ramp = ((torch.arange(rot_dim // 2, dtype=torch.float64) - low) / max(high - low, 0.001)).clamp(0, 1)
    keep = 1 - ramp                     # 1: extrapolate (keep the frequency), 0: interpolate (divide it)
    return 1.0 / (keep + (1 - keep) / factor)


def yarn_attn_factor(factor: float) -> float:
    """YaRN's scaling of the rotated q and k (HF's attention_factor, llama.cpp's mscale)."""
    return 1.0 + 0.1 * math.log(factor)


def rope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
             neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [N, Hq, D], k: [N, Hk, D], positions: int [N] -> rotated (q, k), same dtypes."""
    rot = cos_sin.shape[1]
    half = rot // 2
    cs = cos_sin[positions.long()]
    cos, sin = cs[:, None, :half], cs[:, None, half:]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xr = x[..., :rot].float()
        x1, x2 = (xr[..., :half], xr[..., half:]) if neox else (xr[..., 0::2], xr[..., 1::2])
        o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        out = torch.cat([o1, o2], -1) if neox else torch.stack([o1, o2], -1).flatten(-2)
        return torch.cat([out.to(x.dtype), x[..., rot:]], -1)

    return rotate(q), rotate(k)


# --- Triton -------------------------------------------------------------------------------------------

@jit
def rotated(x, partner, cos, signed_sin):
    """One rotated value in f32: x cos + partner (-sin for a pair's first dim, +sin for its second), as one
    fma, so the rope kernel and the decode attention that rotates its own q and new k
    (attention._decode_split_kernel) give the same bits."""
    return tl.fma(x, cos, partner * signed_sin)


@jit
def rotary_dims(d, HEAD_D: tl.constexpr, NEOX: tl.constexpr):
    """For each dim d of a head whose dims all rotate: (its cos/sin index, its pair partner, -1.0 for a pair's
    first dim and 1.0 for its second)."""
    half: tl.constexpr = HEAD_D // 2
    if NEOX:
        first = d < half
        return tl.where(first, d, d - half), tl.where(first, d + half, d - half), tl.where(first, -1.0, 1.0)
    return d // 2, d ^ 1, tl.where(d % 2 == 0, -1.0, 1.0)


@jit
def rotary_halves(i, HALF: tl.constexpr, NEOX: tl.constexpr):
    """The two dims of rope pairs i (< HALF): halves (NEOX) or adjacent pairs."""
    if NEOX:
        return i, i + HALF
    return 2 * i, 2 * i + 1


@jit
def _rotate_heads(x_ptr, row_off, head_stride, n_heads, cos, sin, off1, off2, half_mask, norm_ptr, eps,
                  BLOCK_H: tl.constexpr, QK_NORM: tl.constexpr, N_DIMS: tl.constexpr):
    """Rotate the first rot dims of every head of one row in place; returns the rotated halves (in x.dtype).
    QK_NORM (qwen3; full rotary only): each head is first RMS-normed with the weights at norm_ptr and rounded
    to x's dtype, as rms_norm then rope would."""
    heads = tl.arange(0, BLOCK_H)
    mask = (heads < n_heads)[:, None] & half_mask[None, :]
    base = x_ptr + row_off + heads[:, None] * head_stride
    x1 = tl.load(base + off1[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + off2[None, :], mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / N_DIMS + eps)[:, None]
        w1 = tl.load(norm_ptr + off1, mask=half_mask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(norm_ptr + off2, mask=half_mask, other=0.0).to(tl.float32)[None, :]
        x1 = (x1 * rstd * w1).to(x_ptr.dtype.element_ty).to(tl.float32)
        x2 = (x2 * rstd * w2).to(x_ptr.dtype.element_ty).to(tl.float32)
    o1 = rotated(x1, x2, cos[None, :], -sin[None, :])
    o2 = rotated(x2, x1, cos[None, :], sin[None, :])
    # Round once to the tensor's dtype, as the reference does; the cache then gets the same values.
    o1 = o1.to(x_ptr.dtype.element_ty)
    o2 = o2.to(x_ptr.dtype.element_ty)
    tl.store(base + off1[None, :], o1, mask=mask)
    tl.store(base + off2[None, :], o2, mask=mask)
    return o1, o2


@jit
def _rope_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cs_ptr, kc_ptr, vc_ptr, slot_ptr, qn_ptr, kn_ptr,
                 q_row_stride, q_head_stride, k_row_stride, k_head_stride, v_row_stride, v_head_stride,
                 cs_stride, cache_slot_stride, cache_head_stride, n_q_heads, n_kv_heads, head_dim, eps,
                 HALF: tl.constexpr, NEOX: tl.constexpr, WRITE_KV: tl.constexpr, QK_NORM: tl.constexpr,
                 BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
                 BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if PDL:  # launched as a programmatic dependent: let the next kernel launch, wait for the previous one
        gdc_launch_dependents()
        gdc_wait()
    pos = tl.load(pos_ptr + row).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    half_mask = i < HALF
    cos = tl.load(cs_ptr + pos * cs_stride + i, mask=half_mask, other=0.0)
    sin = tl.load(cs_ptr + pos * cs_stride + HALF + i, mask=half_mask, other=0.0)
    off1, off2 = rotary_halves(i, HALF, NEOX)
    # Program (row, part): parts 0..P-2 rotate BLOCK_HQ query heads each, the last part the KV heads (and
    # writes the cache). One program per row ran its heads one dependent memory trip after another.
    part = tl.program_id(1)
    if part < tl.num_programs(1) - 1:
        h0 = part * BLOCK_HQ
        _rotate_heads(q_ptr, row * q_row_stride + h0 * q_head_stride, q_head_stride, n_q_heads - h0, cos, sin,
                      off1, off2, half_mask, qn_ptr, eps, BLOCK_H=BLOCK_HQ, QK_NORM=QK_NORM, N_DIMS=2 * HALF)
        return
    k1, k2 = _rotate_heads(k_ptr, row * k_row_stride, k_head_stride, n_kv_heads, cos, sin, off1, off2,
                           half_mask, kn_ptr, eps, BLOCK_H=BLOCK_HK, QK_NORM=QK_NORM, N_DIMS=2 * HALF)
    if WRITE_KV:
        slot = tl.load(slot_ptr + row)
        heads = tl.arange(0, BLOCK_HK)
        keep = (heads < n_kv_heads) & (slot >= 0)
        dst = slot * cache_slot_stride + heads[:, None] * cache_head_stride
        rot_mask = keep[:, None] & half_mask[None, :]
        tl.store(kc_ptr + dst + off1[None, :], to_cache(k1, kc_ptr), mask=rot_mask)
        tl.store(kc_ptr + dst + off2[None, :], to_cache(k2, kc_ptr), mask=rot_mask)
        d = tl.arange(0, BLOCK_D)
        # Dims past the rotary part (partial rotary) go to the cache unrotated.
        tail = keep[:, None] & (d >= 2 * HALF)[None, :] & (d < head_dim)[None, :]
        k_tail = tl.load(k_ptr + row * k_row_stride + heads[:, None] * k_head_stride + d[None, :], mask=tail)
        tl.store(kc_ptr + dst + d[None, :], to_cache(k_tail, kc_ptr), mask=tail)
        full = keep[:, None] & (d < head_dim)[None, :]
        v = tl.load(v_ptr + row * v_row_stride + heads[:, None] * v_head_stride + d[None, :], mask=full)
        tl.store(vc_ptr + dst + d[None, :], to_cache(v, vc_ptr), mask=full)


Q_HEADS_PER_PROGRAM = 4


def fuses_qk_norm(rot_dim: int, head_dim: int) -> bool:
    """Can the rope kernel apply the per-head q/k norms? Only when every dim rotates: the norm scales the
    whole head, and the kernel touches only the rotated dims."""
    return rot_dim == head_dim


def rope_triton(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, neox: bool,
                kv_write: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """rope_ref, rotating q and k IN PLACE (they are returned). q, k may be strided views (e.g. of a fused
    qkv output) with contiguous head dims. kv_write = (v, k_cache, v_cache, slot_mapping) also writes the
    rotated k and v into the paged cache in the same launch (as kv_write_ref would, slot -1 skipped).
    qk_norm = (q_weight, k_weight, eps): RMS-norm each head first (qwen3), as rms_norm_ref would; full rotary
    only (see fuses_qk_norm)."""
    n_rows, n_q_heads, head_dim = q.shape
    n_kv_heads = k.shape[1]
    rot = cos_sin.shape[1]
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin.stride(-1) == 1 and rot % 2 == 0
    assert cos_sin.dtype == torch.float32 and rot <= head_dim
    if n_rows == 0:
        return q, k
    if kv_write is None:
        v, k_cache, v_cache, slots = k, k, k, positions
        cache_strides = (0, 0)
    else:
        v, k_cache, v_cache, slots = kv_write
        assert v.stride(-1) == 1 and v.shape == k.shape
        cache_strides = cache_slot_strides(k_cache, v_cache)
    if qk_norm is None:
        q_weight, k_weight, eps = cos_sin, cos_sin, 0.0
    else:
        q_weight, k_weight, eps = qk_norm
        assert fuses_qk_norm(rot, head_dim) and q_weight.is_contiguous() and k_weight.is_contiguous()
    block_hq = min(next_pow2(n_q_heads), Q_HEADS_PER_PROGRAM)
    _rope_kernel[(n_rows, triton.cdiv(n_q_heads, block_hq) + 1)](
        q, k, v, positions, cos_sin, kernel_view(k_cache), kernel_view(v_cache), slots, q_weight, k_weight,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin.stride(0), *cache_strides, n_q_heads, n_kv_heads, head_dim, eps,
        HALF=rot // 2, NEOX=neox, WRITE_KV=kv_write is not None, QK_NORM=qk_norm is not None,
        BLOCK_HQ=block_hq, BLOCK_HK=next_pow2(n_kv_heads), BLOCK_HALF=next_pow2(rot // 2),
        BLOCK_D=next_pow2(head_dim), **pdl_launch(q), num_warps=4)
    return q, k
