"""The paged KV cache: fixed-size blocks in one pool, per-sequence block tables, and a prefix cache.

The pool tensors live on the device; everything else here is host-side bookkeeping. A block that is
full and whose tokens are known gets a hash chained from its predecessor's, so a new prompt that shares
a prefix (same system prompt, same conversation so far) finds those blocks and skips their prefill.
Freed blocks that carry a hash stay findable until the allocator needs them (LRU eviction). With a spill
(engine/disk_cache.py) an evicted block is written to disk first, and a prefix lookup that misses in the pool
looks there; the chain hash is stable across processes (blake2b, not Python's hash) so that files written by
one server process are found by the next.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

import torch

from cobatch.config import ModelConfig


class KVPool:
    """K and V tensors per layer, [num_blocks, block_size, n_kv_heads, head_dim], as the model's config lays a
    token's entry out (ModelConfig.kv_cache_heads). MLA (DeepSeek) keeps one tensor per layer of one "head"
    of latent | rope key, and no V tensors (`v` is empty)."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str):
        heads, k_width, v_width = cfg.kv_cache_heads
        self.k = [torch.zeros((num_blocks, block_size, heads, k_width), dtype=dtype, device=device)
                  for _ in range(cfg.n_layers)]
        self.v = [torch.zeros((num_blocks, block_size, heads, v_width), dtype=dtype, device=device)
                  for _ in range(cfg.n_layers)] if v_width else []
        self.num_blocks, self.block_size = num_blocks, block_size

    @staticmethod
    def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, gqa_equivalent: bool = False) -> int:
        """KV bytes one token takes over all layers; gqa_equivalent: were full K and V heads cached instead
        (what MLA saves)."""
        heads, k_width, v_width = cfg.gqa_equivalent_kv_heads if gqa_equivalent else cfg.kv_cache_heads
        return cfg.n_layers * heads * (k_width + v_width) * torch.empty(0, dtype=dtype).element_size()

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        return block_size * KVPool.bytes_per_token(cfg, dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self.k[0].dtype

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


def chain_hash(prev: int | None, tokens: tuple[int, ...]) -> int:
    """A full block's hash, chained from its predecessor's: it names the whole prefix up to the block's end."""
    data = (prev if prev is not None else (1 << 64) - 1).to_bytes(8, "little") + array("q", tokens).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & ((1 << 63) - 1)


def prefix_root(tag: bytes) -> int:
    """Where the chains of a sequence whose KV is computed otherwise than the base model's start (a LoRA adapter's:
    `tag` its fingerprint), in place of None: the same tokens then find only blocks computed the same way. The -1
    that leads its made-up "tokens" is no token id, so no block's hash is a root."""
    return chain_hash(None, (-1, *tag))


def salted_root(root: int | None, salt: str) -> int:
    """The chains' root of a request with vLLM's cache_salt, from the root it would have without (None: the base
    model's): requests share blocks only with requests of the same salt (and adapter)."""
    return prefix_root(b"salt" + (root or 0).to_bytes(8, "little") + salt.encode())


class BlockSpill(Protocol):
    """Where evicted hashed blocks go and come back from (engine/disk_cache.DiskPrefixCache)."""

    def save(self, block_id: int, block_hash: int, tokens: tuple[int, ...]) -> None: ...

    def load_into(self, block_id: int, block_hash: int, tokens: tuple[int, ...]) -> bool: ...


@dataclass(slots=True)
class _Block:
    ref: int = 0
    hash: int | None = None
    tokens: tuple[int, ...] | None = None   # kept to rule out hash collisions


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, spill: BlockSpill | None = None):
        self.block_size = block_size
        self.spill = spill
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
        return chain_hash(prev, tokens)

    def lookup(self, block_hash: int, tokens: tuple[int, ...]) -> int | None:
        """The pool block holding these tokens under this chain hash, if any (no reference taken)."""
        bid = self.by_hash.get(block_hash)
        return bid if bid is not None and self.blocks[bid].tokens == tokens else None

    def match_prefix(self, token_ids: list[int], root: int | None = None) -> list[int]:
        """Blocks holding the longest cached prefix of full blocks; takes a reference on each. root: where the
        chain starts (prefix_root; None for the base model's KV).

        The last token is never covered: its forward pass must run to produce the next token's logits.
        """
        matched, prev = [], root
        bs = self.block_size
        for start in range(0, len(token_ids) - 1 - bs + 1, bs):
            tokens = tuple(token_ids[start:start + bs])
            h = self._chain(prev, tokens)
            bid = self.lookup(h, tokens)
            if bid is not None:
                self.take(bid)       # now, so that a disk read below cannot evict it
            elif self.spill is None or (bid := self._read_back(h, tokens)) is None:
                break
            matched.append(bid)
            prev = h
        return matched

    def _read_back(self, block_hash: int, tokens: tuple[int, ...]) -> int | None:
        """A fresh block (one reference) filled from the spill, or None where the spill lacks it or no block is free."""
        got = self.allocate(1)
        if got is None:
            return None
        bid = got[0]
        if not self.spill.load_into(bid, block_hash, tokens):
            self.release(got)
            return None
        block = self.blocks[bid]
        block.hash, block.tokens = block_hash, tokens
        self.by_hash[block_hash] = bid
        return bid

    def take(self, bid: int) -> None:
        """One more reference on a block (out of the LRU while referenced)."""
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
                if self.spill is not None:
                    self.spill.save(bid, block.hash, block.tokens)
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

    def forget(self, bid: int) -> bool:
        """Drop an unused cached block from the prefix cache (not spilled); False if it is in use or not cached."""
        block = self.blocks[bid]
        if block.ref or bid not in self.cached:
            return False
        del self.cached[bid]
        if self.by_hash.get(block.hash) == bid:
            del self.by_hash[block.hash]
        block.hash = block.tokens = None
        self.free.append(bid)
        return True

    def spill_all(self) -> int:
        """Hand every findable block to the spill (at shutdown: what is still in the pool survives the restart)."""
        if self.spill is None:
            return 0
        for h, bid in list(self.by_hash.items()):
            self.spill.save(bid, h, self.blocks[bid].tokens)
        return len(self.by_hash)
