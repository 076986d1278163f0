"""Block allocator and prefix cache bookkeeping (host-side, no model)."""

from cobatch.engine.kv_cache import BlockManager


def test_allocate_and_release_returns_blocks():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = bm.allocate(3)
    assert len(set(a)) == 3 and bm.num_free == 1
    assert bm.allocate(2) is None            # not enough: nothing taken
    assert bm.num_free == 1
    bm.release(a)
    assert bm.num_free == 4


def test_prefix_match_needs_full_blocks_and_leaves_last_token():
    bm = BlockManager(num_blocks=8, block_size=2)
    blocks = bm.allocate(3)
    prev = None
    tokens = [5, 6, 7, 8, 9, 10]
    for i, b in enumerate(blocks):
        prev = bm.register_full_block(b, prev, tuple(tokens[2 * i:2 * i + 2]))
    bm.release(blocks)
    # Same 6 tokens: only 2 blocks may match, the last token must still be computed.
    assert bm.match_prefix(tokens) == blocks[:2]
    # A prompt diverging inside block 1 matches only block 0.
    bm2 = bm.match_prefix([5, 6, 7, 99, 9, 10, 11])
    assert bm2 == blocks[:1]


def test_prefix_chain_depends_on_predecessor():
    bm = BlockManager(num_blocks=8, block_size=2)
    b = bm.allocate(2)
    h0 = bm.register_full_block(b[0], None, (1, 2))
    bm.register_full_block(b[1], h0, (3, 4))
    bm.release(b)
    # Block (3, 4) preceded by a different block must not match.
    assert bm.match_prefix([9, 9, 3, 4, 5]) == []


def test_lru_eviction_of_cached_blocks():
    bm = BlockManager(num_blocks=2, block_size=1)
    b = bm.allocate(2)
    h = bm.register_full_block(b[0], None, (1,))
    bm.register_full_block(b[1], h, (2,))
    bm.release(b)
    assert bm.num_free == 2                   # cached blocks still count as free
    fresh = bm.allocate(1)                    # evicts the least recently used (the tail, released first)
    assert fresh == [b[1]]
    assert bm.match_prefix([1, 2, 3]) == [b[0]]
    assert bm.match_prefix([1, 2, 3]) == [b[0]]   # shared: second reference
    assert bm.blocks[b[0]].ref == 2
