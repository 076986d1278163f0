"""A slot's KV state as a file (llama.cpp's /slots/{id}?action=save|restore), and erasing it from the cache.

What is saved is a token sequence and the KV blocks of its full blocks, taken from the prefix cache (a finished
request's blocks stay there until evicted). Restoring puts the blocks back into the pool as cached prefix blocks
under their chain hashes, so the next request that continues those tokens skips their prefill (usage
cached_tokens). The split into export (engine thread) and write (any thread) keeps file I/O out of the engine
thread; so does the split into read/check (any thread) and import (engine thread).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cobatch.engine.kv_cache import BlockManager, KVPool, chain_hash
from cobatch.engine.kv_store import (KVFileError, block_bytes, block_nbytes, load_block, new_header, read_record,
                                     write_record)


@dataclass(slots=True)
class SlotState:
    tokens: list[int]        # the tokens whose K/V the blocks hold (whole blocks)
    payload: bytes | memoryview


def export_slot(blocks: BlockManager, pool: KVPool, tokens: list[int]) -> SlotState:
    """The cached blocks of the longest cached prefix of `tokens` (engine thread)."""
    matched = blocks.match_prefix(tokens)
    try:
        payload = b"".join(block_bytes(pool, bid) for bid in matched)
    finally:
        blocks.release(matched)
    return SlotState(tokens[:len(matched) * blocks.block_size], payload)


def write_slot(path: Path, state: SlotState, identity: str, pool: KVPool) -> int:
    n_blocks = len(state.payload) // block_nbytes(pool)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_record(path, new_header("slot", identity, pool, state.tokens, n_blocks), state.payload, durable=True)


def read_slot(path: Path, identity: str, pool: KVPool, block_size: int) -> SlotState:
    """Raises KVFileError for a file of another model or layout, or a corrupt one."""
    header, payload = read_record(path, "slot", identity, pool)
    tokens = header["tokens"]
    if not isinstance(tokens, list) or len(tokens) != header["n_blocks"] * block_size \
            or not all(isinstance(t, int) for t in tokens):
        raise KVFileError("its tokens do not fill its blocks")
    return SlotState(tokens, payload)


def import_slot(blocks: BlockManager, pool: KVPool, state: SlotState) -> int:
    """Put the blocks into the pool as cached prefix blocks (engine thread); returns the tokens restored (fewer when
    the pool has no free block left for the rest)."""
    bs, size = blocks.block_size, block_nbytes(pool)
    held, prev = [], None       # references held until the end, so that loading one block cannot evict another
    try:
        for i in range(len(state.tokens) // bs):
            tokens = tuple(state.tokens[i * bs:(i + 1) * bs])
            h = chain_hash(prev, tokens)
            bid = blocks.lookup(h, tokens)
            if bid is not None:
                blocks.take(bid)                    # already cached
            else:
                got = blocks.allocate(1)
                if got is None:
                    break
                bid = got[0]
                load_block(pool, bid, state.payload[i * size:(i + 1) * size])
                blocks.register_full_block(bid, prev, tokens)
            held.append(bid)
            prev = h
        return len(held) * bs
    finally:
        blocks.release(held)


def erase_slot(blocks: BlockManager, tokens: list[int]) -> int:
    """Drop the unused cached blocks of `tokens`' prefix from the pool; returns the tokens whose blocks went."""
    bs, prev, erased = blocks.block_size, None, 0
    for start in range(0, len(tokens) - bs + 1, bs):
        chunk = tuple(tokens[start:start + bs])
        h = chain_hash(prev, chunk)
        bid = blocks.lookup(h, chunk)
        if bid is None:
            break
        erased += bs if blocks.forget(bid) else 0
        prev = h
    return erased
