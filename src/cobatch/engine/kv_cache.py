"""The paged KV cache: fixed-size blocks in one pool, per-sequence block tables, and a prefix cache.

The pool tensors live on the device; everything else here is host-side bookkeeping. A block that is
full and whose tokens are known gets a hash chained from its predecessor's, so a new prompt that shares
a prefix (same system prompt, same conversation so far) finds those blocks and skips their prefill.
Freed blocks that carry a hash stay findable until the allocator needs them (LRU eviction).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from cobatch.config import ModelConfig


class KVPool:
    """K and V tensors per layer, [num_blocks, block_size, n_kv_heads, head_dim]."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str):
        shape = (num_blocks, block_size, cfg.n_kv_heads, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.num_blocks, self.block_size = num_blocks, block_size

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        return 2 * cfg.n_layers * block_size * cfg.n_kv_heads * cfg.head_dim * itemsize

    @property
    def dtype(self) -> torch.dtype:
        return self.k[0].dtype

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


@dataclass(slots=True)
class _Block:
    ref: int = 0
    hash: int | None = None
    tokens: tuple[int, ...] | None = None   # kept to rule out hash collisions


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.blocks = [_Block() for _ in range(num_blocks)]
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))   # never-hashed blocks, stack
        self.cached: OrderedDict[int, None] = OrderedDict()           # ref 0 but findable; LRU first
        self.by_hash: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self.free) + len(self.cached)

    @property
    def num_used(self) -> int:
        return len(self.blocks) - self.num_free

    def _chain(self, prev: int | None, tokens: tuple[int, ...]) -> int:
        return hash((prev, tokens))

    def match_prefix(self, token_ids: list[int]) -> list[int]:
        """Blocks holding the longest cached prefix of full blocks; takes a reference on each.

        The last token is never covered: its forward pass must run to produce the next token's logits.
        """
        matched, prev = [], None
        bs = self.block_size
        for start in range(0, len(token_ids) - 1 - bs + 1, bs):
            tokens = tuple(token_ids[start:start + bs])
            h = self._chain(prev, tokens)
            bid = self.by_hash.get(h)
            if bid is None or self.blocks[bid].tokens != tokens:
                break
            matched.append(bid)
            prev = h
        for bid in matched:
            self._take(bid)
        return matched

    def _take(self, bid: int) -> None:
        block = self.blocks[bid]
        if block.ref == 0:
            self.cached.pop(bid, None)
        block.ref += 1

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks, evicting least recently used cached blocks if needed; None if not enough."""
        if n > self.num_free:
            return None
        out = []
        for _ in range(n):
            if self.free:
                bid = self.free.pop()
            else:
                bid, _ = self.cached.popitem(last=False)
                block = self.blocks[bid]
                if self.by_hash.get(block.hash) == bid:
                    del self.by_hash[block.hash]
                block.hash = block.tokens = None
            self.blocks[bid].ref = 1
            out.append(bid)
        return out

    def register_full_block(self, bid: int, prev_hash: int | None, tokens: tuple[int, ...]) -> int:
        """Make a block that just became full findable; returns its chain hash."""
        h = self._chain(prev_hash, tokens)
        block = self.blocks[bid]
        if block.hash is None:
            block.hash, block.tokens = h, tokens
            self.by_hash.setdefault(h, bid)
        return h

    def release(self, block_ids: list[int]) -> None:
        # Release tail first so that, under LRU, a prefix's later blocks go before its earlier ones.
        for bid in reversed(block_ids):
            block = self.blocks[bid]
            block.ref -= 1
            assert block.ref >= 0
            if block.ref == 0:
                if block.hash is not None and self.by_hash.get(block.hash) == bid:
                    self.cached[bid] = None
                else:
                    block.hash = block.tokens = None
                    self.free.append(bid)
