"""The KV block pool: allocation, reference counts, the prefix cache and its eviction order."""

from __future__ import annotations

import pytest

from pagedkern.engine.block_pool import BlockPool, chain_hash


def test_allocate_and_free_keep_the_books():
    pool = BlockPool(8, 4)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert sorted(a + b) == list(range(8)) and pool.num_free == 0
    assert pool.allocate(1) is None
    pool.check_invariants([a, b])
    pool.free(a)
    assert pool.num_free == 3
    pool.check_invariants([b])
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free(a)


def test_chained_hashes_identify_whole_prefixes():
    pool = BlockPool(4, 2)
    h1 = pool.block_hashes([1, 2, 3, 4, 5])
    assert len(h1) == 2  # the partial third block has no hash
    h2 = pool.block_hashes([9, 9, 3, 4])
    assert h1[1] != h2[1]  # same block tokens, different prefix
    assert pool.block_hashes([1, 2, 3, 4], h1[:1]) == h1
    assert chain_hash(None, [1, 2]) == h1[0]


def test_extending_hashes_block_by_block_equals_hashing_the_whole_sequence():
    pool = BlockPool(4, 3)
    tokens = [(7 * i) % 11 for i in range(20)]
    hashes: list[bytes] = []
    pool.extend_hashes(hashes, tokens[:4])  # one full block, one id left over
    pool.extend_hashes(hashes, tokens[3:9])  # the next two blocks
    pool.extend_hashes(hashes, tokens[9:20])  # three more, two ids left over
    assert hashes == pool.block_hashes(tokens) and len(hashes) == 6


def test_prefix_hits_survive_release_until_evicted():
    pool = BlockPool(4, 2)
    tokens = [5, 6, 7, 8]
    hashes = pool.block_hashes(tokens)
    blocks = pool.allocate(2)
    for block_id, h in zip(blocks, hashes):
        pool.register(block_id, h)
    pool.free(blocks)  # free, but still cached
    assert pool.lookup_prefix(hashes, 2) == blocks
    pool.acquire(blocks[:1])
    assert pool.num_free == 3
    pool.check_invariants([blocks[:1]])
    pool.free(blocks[:1])
    taken = pool.allocate(4)  # evicts everything
    assert sorted(taken) == [0, 1, 2, 3]
    assert pool.lookup_prefix(hashes, 2) == []
    pool.check_invariants([taken])


def test_eviction_order_uncached_first_then_tail_blocks_first():
    pool = BlockPool(6, 1)
    seq = pool.allocate(3)
    for block_id, h in zip(seq, pool.block_hashes([1, 2, 3])):
        pool.register(block_id, h)
    scratch = pool.allocate(2)
    pool.free(seq)
    pool.free(scratch)
    order = pool.allocate(6)
    # never-cached blocks (the scratch ones and the one never used) are evicted first; then the
    # cached sequence from its last block back, so its shareable prefix lives longest
    assert set(order[:3]) == set(scratch) | {5}
    assert order[3:] == [seq[2], seq[1], seq[0]]


def test_prefix_caching_off_never_hits():
    pool = BlockPool(4, 2, enable_prefix_caching=False)
    blocks = pool.allocate(1)
    h = pool.block_hashes([1, 2])
    pool.register(blocks[0], h[0])
    assert pool.lookup_prefix(h, 1) == []


def test_invariant_check_catches_a_leak():
    pool = BlockPool(4, 2)
    table = pool.allocate(2)
    with pytest.raises(AssertionError, match="ref_count"):
        pool.check_invariants([table[:1]])
