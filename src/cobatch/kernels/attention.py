"""Attention over the paged KV cache: each sequence's rows attend causally to its own context."""

from __future__ import annotations

import torch

from cobatch.batch import AttentionMetadata


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [N, Hq, D]; caches [num_blocks, block_size, Hk, D] (this step's K/V already written).

    Row i of sequence s sits at position seq_len - q_len + i and sees keys 0..that position.
    Rows past query_start[-1] (padding) come out as zeros.
    """
    n_rows, n_heads, head_dim = q.shape
    n_kv, block_size = k_cache.shape[2], k_cache.shape[1]
    group = n_heads // n_kv
    out = torch.zeros_like(q)
    starts, lens = meta.query_start.tolist(), meta.seq_lens.tolist()
    for s, ctx in enumerate(lens):
        a, b = starts[s], starts[s + 1]
        q_len = b - a
        if q_len == 0 or ctx == 0:
            continue
        blocks = meta.block_tables[s, : (ctx + block_size - 1) // block_size].long()
        k = k_cache[blocks].reshape(-1, n_kv, head_dim)[:ctx].float().transpose(0, 1)  # [Hk, L, D]
        v = v_cache[blocks].reshape(-1, n_kv, head_dim)[:ctx].float().transpose(0, 1)
        qh = q[a:b].float().view(q_len, n_kv, group, head_dim).permute(1, 2, 0, 3)      # [Hk, G, q, D]
        scores = torch.einsum("hgqd,hkd->hgqk", qh, k) * scale
        q_pos = torch.arange(ctx - q_len, ctx)
        scores.masked_fill_(torch.arange(ctx)[None, :] > q_pos[:, None], float("-inf"))
        o = torch.einsum("hgqk,hkd->hgqd", scores.softmax(-1), v)
        out[a:b] = o.permute(2, 0, 1, 3).reshape(q_len, n_heads, head_dim).to(q.dtype)
    return out
