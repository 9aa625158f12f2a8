"""BlockPool: ref counts, the prefix-cache hash map, and least-recently-freed eviction."""

import pytest

from llmserve.core.block_pool import BlockPool


def free_ids(pool: BlockPool) -> list[int]:
    """Block ids in the free queue, front (next to be taken) first."""
    return list(pool.free_queue)


def test_rejects_an_empty_pool():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_starts_with_every_block_free_in_id_order():
    pool = BlockPool(4)
    assert free_ids(pool) == [0, 1, 2, 3]
    assert pool.num_free_blocks == 4
    assert pool.usage == 0.0
    assert all(b.ref_cnt == 0 and b.block_hash is None for b in pool.blocks)


def test_new_blocks_come_from_the_front_with_one_reference():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert free_ids(pool) == [3]
    assert pool.usage == 0.75


def test_taking_more_blocks_than_free_raises_and_takes_nothing():
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="only 2 free"):
        pool.get_new_blocks(3)
    assert pool.num_free_blocks == 2
    assert all(b.ref_cnt == 0 for b in pool.blocks)


def test_freed_blocks_join_the_back_of_the_queue_in_order():
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    pool.free_blocks([c, a])
    assert free_ids(pool) == [3, 2, 0]
    pool.free_blocks([b])
    assert free_ids(pool) == [3, 2, 0, 1]
    assert all(blk.ref_cnt == 0 for blk in pool.blocks)


def test_a_shared_block_is_free_only_after_its_last_reference_goes():
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and block.block_id not in pool.free_queue
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and block.block_id in pool.free_queue


def test_freeing_a_free_block_is_an_error():
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(RuntimeError, match="freed more times"):
        pool.free_blocks([block])


def test_touch_revives_a_free_cached_block_without_evicting_it():
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, 1234)
    pool.free_blocks([block])
    assert pool.get_cached_block(1234) is block  # free but still cached

    pool.touch([block])
    assert block.ref_cnt == 1
    assert block.block_id not in pool.free_queue
    assert block.block_hash == 1234 and pool.num_evictions == 0


def test_cache_block_maps_hash_to_block_once():
    pool = BlockPool(3)
    first, second = pool.get_new_blocks(2)
    pool.cache_block(first, 7)
    pool.cache_block(second, 7)  # identical content already cached: stays private
    assert pool.get_cached_block(7) is first
    assert second.block_hash is None

    pool.cache_block(first, 8)  # a cached block keeps its hash
    assert first.block_hash == 7
    assert pool.get_cached_block(8) is None


def test_free_cached_blocks_are_evicted_only_when_taken_least_recently_freed_first():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    for block, block_hash in zip(blocks, [10, 11, 12, 13], strict=True):
        pool.cache_block(block, block_hash)
    pool.free_blocks([blocks[2], blocks[0], blocks[3], blocks[1]])
    assert len(pool.cached) == 4 and pool.num_evictions == 0

    (taken,) = pool.get_new_blocks(1)
    assert taken is blocks[2]
    assert taken.block_hash is None and pool.get_cached_block(12) is None
    assert pool.num_evictions == 1

    taken = pool.get_new_blocks(2)
    assert taken == [blocks[0], blocks[3]]
    assert sorted(pool.cached) == [11]
    assert pool.num_evictions == 3


def test_a_revived_block_leaves_the_eviction_order():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    for block, block_hash in zip(blocks, [1, 2, 3], strict=True):
        pool.cache_block(block, block_hash)
    pool.free_blocks(blocks)
    pool.touch([blocks[0]])  # a prefix hit on the least recently freed block
    assert [b.block_id for b in pool.get_new_blocks(2)] == [1, 2]
    assert pool.get_cached_block(1) is blocks[0]


def test_caching_disabled_never_caches():
    pool = BlockPool(2, enable_caching=False)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, 5)
    assert block.block_hash is None
    assert pool.get_cached_block(5) is None and pool.cached == {}


def test_reset_prefix_cache_forgets_every_hash():
    pool = BlockPool(2)
    in_use, freed = pool.get_new_blocks(2)
    pool.cache_block(in_use, 1)
    pool.cache_block(freed, 2)
    pool.free_blocks([freed])
    pool.reset_prefix_cache()
    assert pool.cached == {}
    assert in_use.block_hash is None and freed.block_hash is None
    assert in_use.ref_cnt == 1 and free_ids(pool) == [freed.block_id]
