"""Write this step's K/V rows into the paged cache at their slots (slot -1: padded row, skip)."""

from __future__ import annotations

import torch

from cobatch.kernels.fp8_cache import FP8_MAX, kernel_view, to_cache
from cobatch.kernels.triton_support import jit, next_pow2, tl


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as the cache stores it. fp8 saturates at +-448, as the kernels' conversion (cvt.rn.satfinite) does,
    rather than turning into NaN."""
    if dtype == torch.float8_e4m3fn:
        x = x.clamp(-FP8_MAX, FP8_MAX)
    return x.to(dtype)


def kv_write_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """k, v: [N, Hk, D]; caches: [num_blocks, block_size, Hk, D]; slot = block * block_size + offset."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = to_cache_dtype(k[keep], k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = to_cache_dtype(v[keep], v_cache.dtype)


# --- Triton -------------------------------------------------------------------------------------------

def cache_slot_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int]:
    """(slot, head) strides of a [num_blocks, block_size, Hk, D] cache, whose flat slot index is
    block * block_size + offset: a block must be a contiguous run of slots."""
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    assert k_cache.stride(0) == k_cache.shape[1] * k_cache.stride(1), "a block must be a contiguous run of slots"
    return k_cache.stride(1), k_cache.stride(2)


@jit
def _kv_write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, k_row_stride, k_head_stride, v_row_stride,
                     v_head_stride, cache_slot_stride, cache_head_stride, n_kv_heads, head_dim,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = ((heads < n_kv_heads)[:, None] & (d < head_dim)[None, :]) & (slot >= 0)
    dst = slot * cache_slot_stride + heads[:, None] * cache_head_stride + d[None, :]
    k = tl.load(k_ptr + row * k_row_stride + heads[:, None] * k_head_stride + d[None, :], mask=mask)
    v = tl.load(v_ptr + row * v_row_stride + heads[:, None] * v_head_stride + d[None, :], mask=mask)
    tl.store(kc_ptr + dst, to_cache(k, kc_ptr), mask=mask)
    tl.store(vc_ptr + dst, to_cache(v, vc_ptr), mask=mask)


def kv_write_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """kv_write_ref in one launch; k, v may be strided views with contiguous head dims."""
    n_rows, n_kv_heads, head_dim = k.shape
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and v.shape == k.shape
    if n_rows == 0:
        return
    _kv_write_kernel[(n_rows,)](
        k, v, kernel_view(k_cache), kernel_view(v_cache), slot_mapping, k.stride(0), k.stride(1), v.stride(0),
        v.stride(1),
        *cache_slot_strides(k_cache, v_cache), n_kv_heads, head_dim,
        BLOCK_H=next_pow2(n_kv_heads), BLOCK_D=next_pow2(head_dim), num_warps=4)
