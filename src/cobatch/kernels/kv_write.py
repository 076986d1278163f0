"""Write this step's K/V rows into the paged cache at their slots (slot -1: padded row, skip)."""

from __future__ import annotations

import torch


def kv_write_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """k, v: [N, Hk, D]; caches: [num_blocks, block_size, Hk, D]; slot = block * block_size + offset."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep].to(v_cache.dtype)
