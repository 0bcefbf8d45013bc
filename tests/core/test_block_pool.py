"""Tests of jaxllm.core.block_pool.BlockPool."""

import pytest

from jaxllm.core.block_pool import BlockPool
from jaxllm.core.kv_cache_utils import hash_token_blocks


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def test_null_block_is_block_zero_and_reserved():
    pool = BlockPool(5)
    assert pool.null_block is pool.blocks[0] and pool.null_block.is_null
    assert not any(b.is_null for b in pool.blocks[1:])
    assert free_ids(pool) == [1, 2, 3, 4]
    assert pool.get_num_free_blocks() == 4 == pool.num_usable_blocks
    blocks = pool.get_new_blocks(4)
    assert [b.block_id for b in blocks] == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="only 0 are free"):
        pool.get_new_blocks(1)


def test_pool_needs_two_blocks():
    with pytest.raises(ValueError, match="at least 2"):
        BlockPool(1)


def test_get_new_blocks_sets_ref_count_and_usage():
    pool = BlockPool(9)
    assert pool.get_usage() == 0.0
    blocks = pool.get_new_blocks(2)
    assert [(b.block_id, b.ref_cnt) for b in blocks] == [(1, 1), (2, 1)]
    assert pool.get_num_free_blocks() == 6 and pool.get_usage() == 0.25
    with pytest.raises(ValueError):
        pool.get_new_blocks(7)
    assert pool.get_num_free_blocks() == 6  # a failed request takes nothing


def test_free_blocks_appends_in_given_order_when_ref_count_reaches_zero():
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)  # 1, 2, 3
    pool.touch([a[1]])  # block 2 now held twice
    pool.free_blocks(reversed(a))
    assert [b.ref_cnt for b in a] == [0, 1, 0]
    assert free_ids(pool) == [4, 5, 3, 1]
    pool.free_blocks([a[1]])
    assert free_ids(pool) == [4, 5, 3, 1, 2]
    assert pool.get_usage() == 0.0


def test_touch_pulls_free_block_out_of_queue():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(2)
    pool.free_blocks(blocks)
    assert free_ids(pool) == [3, 4, 1, 2]
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 1 and free_ids(pool) == [3, 4, 2]
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 2 and pool.get_num_free_blocks() == 3


def test_cache_full_blocks_and_lookup():
    pool = BlockPool(8)
    hashes = hash_token_blocks(list(range(12)), block_size=4)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, hashes, num_cached_blocks=0, num_full_blocks=2)
    assert [b.block_hash for b in blocks] == [hashes[0], hashes[1], None]
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    assert pool.get_cached_block(hashes[1]) is blocks[1]
    assert pool.get_cached_block(hashes[2]) is None
    pool.cache_full_blocks(blocks, hashes, num_cached_blocks=2, num_full_blocks=3)
    assert pool.get_cached_block(hashes[2]) is blocks[2]
    assert len(pool.cached_block_hash_to_block) == 3


def test_duplicate_content_keeps_first_cached_block():
    pool = BlockPool(8)
    hashes = hash_token_blocks([1, 2, 3, 4], block_size=4)
    first, second = pool.get_new_blocks(2)
    pool.cache_full_blocks([first], hashes, 0, 1)
    pool.cache_full_blocks([second], hashes, 0, 1)
    assert pool.get_cached_block(hashes[0]) is first
    assert second.block_hash is None


def test_free_cached_blocks_stay_cached_until_evicted_in_lru_order():
    pool = BlockPool(5)  # 4 usable blocks
    hashes = hash_token_blocks(list(range(16)), block_size=4)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(blocks, hashes, 0, 4)
    pool.free_blocks(reversed(blocks))  # tail first: evicted first
    assert free_ids(pool) == [4, 3, 2, 1]
    assert all(pool.get_cached_block(h) is b for h, b in zip(hashes, blocks))

    (reused,) = pool.get_new_blocks(1)
    assert reused is blocks[3] and reused.block_hash is None and reused.ref_cnt == 1
    assert pool.get_cached_block(hashes[3]) is None
    assert pool.get_cached_block(hashes[0]) is blocks[0]

    # A hit on a free block takes it out of the queue; freeing it again puts it at
    # the back, as the most recently used.
    pool.touch([blocks[2]])
    assert free_ids(pool) == [2, 1]
    pool.free_blocks([blocks[2]])
    assert free_ids(pool) == [2, 1, 3]
    evicted = pool.get_new_blocks(2)
    assert [b.block_id for b in evicted] == [2, 1]
    assert set(pool.cached_block_hash_to_block) == {hashes[2]}


def test_reset_prefix_cache_only_when_nothing_is_held():
    pool = BlockPool(4)
    hashes = hash_token_blocks(list(range(8)), block_size=4)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, hashes, 0, 2)
    assert pool.reset_prefix_cache() is False
    assert len(pool.cached_block_hash_to_block) == 2
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in pool.blocks)
    assert pool.get_num_free_blocks() == 3
