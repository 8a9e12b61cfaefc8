"""Unit tests of one worker's block bookkeeping (cache_service/control/block_pool.py)."""

from __future__ import annotations

import pytest

from cache_service.control.block_pool import BlockPool
from cache_service.errors import InvalidRequest, PoolExhausted


def test_new_pool_hands_out_blocks_in_order_and_reuses_freed_first() -> None:
    pool = BlockPool("w", 4)
    assert [pool.take() for _ in range(3)] == [(0, False), (1, False), (2, False)]
    assert (pool.num_used, pool.num_free, pool.num_cached) == (3, 1, 0)
    pool.decref(1, keep_cached=False)
    # The free list is a stack: the block freed last comes back first.
    assert pool.take() == (1, False)
    assert pool.take() == (3, False)
    with pytest.raises(PoolExhausted, match="all 4 blocks in use"):
        pool.take()


def test_cached_free_blocks_are_evicted_least_recently_released_first() -> None:
    pool = BlockPool("w", 3)
    for _ in range(3):
        pool.take()
    pool.decref(2, keep_cached=True)
    pool.decref(0, keep_cached=True)
    pool.decref(1, keep_cached=False)
    assert (pool.num_used, pool.num_cached, pool.num_free, pool.available) == (0, 2, 1, 3)
    assert pool.cached_order() == [2, 0]
    # Free blocks go before any cached-free one is evicted.
    assert pool.take() == (1, False)
    assert pool.take() == (2, True)
    assert pool.take() == (0, True)


def test_adopting_a_cached_block_takes_it_off_the_lru() -> None:
    pool = BlockPool("w", 2)
    pool.take()
    pool.take()
    pool.decref(0, keep_cached=True)
    pool.decref(1, keep_cached=True)
    pool.incref(0)
    assert pool.refcount(0) == 1 and not pool.is_cached(0)
    assert pool.cached_order() == [1]
    pool.decref(0, keep_cached=True)
    # Released again, it is now the most recently used.
    assert pool.cached_order() == [1, 0]
    assert pool.evict_next() == 1
    assert pool.free_order() == [1]


def test_refcounting_errors_change_nothing() -> None:
    pool = BlockPool("w", 2)
    with pytest.raises(InvalidRequest, match="block 0 is free"):
        pool.incref(0)
    with pytest.raises(InvalidRequest, match="no reference"):
        pool.decref(1, keep_cached=False)
    assert (pool.num_free, pool.num_used, pool.refcounts()) == (2, 0, [0, 0])


def test_shared_block_returns_only_when_the_last_reference_goes() -> None:
    pool = BlockPool("w", 1)
    pool.take()
    pool.incref(0)
    pool.decref(0, keep_cached=False)
    assert (pool.num_used, pool.num_free) == (1, 0)
    pool.decref(0, keep_cached=False)
    assert (pool.num_used, pool.num_free) == (0, 1)


@pytest.mark.parametrize("size", [0, -1, 1.5, "3", True])
def test_bad_pool_size_is_rejected(size: object) -> None:
    with pytest.raises(InvalidRequest, match="num_blocks"):
        BlockPool("w", size)  # type: ignore[arg-type]


def test_restore_round_trips_and_rejects_overlaps() -> None:
    pool = BlockPool("w", 4)
    for _ in range(4):
        pool.take()
    pool.decref(3, keep_cached=True)
    pool.decref(1, keep_cached=False)
    copy = BlockPool.restore("w", 4, pool.refcounts(), pool.free_order(), pool.cached_order())
    assert (copy.refcounts(), copy.free_order(), copy.cached_order()) == (
        [1, 0, 1, 0],
        [1],
        [3],
    )
    assert copy.num_used == 2
    with pytest.raises(InvalidRequest, match="do not partition"):
        BlockPool.restore("w", 4, [1, 0, 1, 0], [1, 3], [3])
    with pytest.raises(InvalidRequest, match="reference counts"):
        BlockPool.restore("w", 4, [1, 0, 1], [1], [3])
