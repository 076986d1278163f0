"""Multi-head latent attention (DeepSeek's MLA) over a paged cache of latents, in the absorbed form.

Each cached token is one row of kv_lora_rank + rope values: the normalized latent c_kv, then the rotated rope
key k_rope, shared by all heads (a cache of one "head"). A head's key is k_nope = W_UK c_kv beside k_rope, its
value W_UV c_kv; with W_UK folded into the query (q_latent = W_UK^T q_nope, models/deepseek.py) a score is
q_latent . c_kv + q_rope . k_rope, the dot of [q_latent | q_rope] with the cached row as it is, and the output
before W_UV is the softmax-weighted sum of the rows' c_kv part. So attention reads each cached row once per
step for all heads, as multi-query attention with one K head of the full row whose V is its first
kv_lora_rank values; W_UV is applied to the [heads, kv_lora_rank] result by the caller.
"""

from __future__ import annotations

import torch

from cobatch.batch import AttentionMetadata
from cobatch.kernels.kv_write import to_cache_dtype


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
    starts, lens = meta.query_start.tolist(), meta.seq_lens.tolist()
    for s, ctx in enumerate(lens):
        a, b = starts[s], starts[s + 1]
        q_len = b - a
        if q_len == 0 or ctx == 0:
            continue
        blocks = meta.block_tables[s, : (ctx + block_size - 1) // block_size].long()
        rows = cache[blocks].reshape(-1, width)[:ctx].float()               # [L_ctx, width], read once
        scores = torch.einsum("qhw,kw->hqk", q[a:b].float(), rows) * scale  # every head against the same rows
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device)
        hidden = torch.arange(ctx, device=q.device)[None, :] > q_pos[:, None]
        scores.masked_fill_(hidden, float("-inf"))
        out[a:b] = torch.einsum("hqk,kr->qhr", scores.softmax(-1), rows[:, :kv_lora_rank])
    return out
