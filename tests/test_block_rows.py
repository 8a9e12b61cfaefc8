"""The cached int32 block-id rows of block tables (cache_service.control.block_rows and
BlockManager.block_ids): always exactly the table, through growth, copy-on-write, cancelled
and rolled-back writes, forks, frees, evictions, lost workers and snapshots."""

from __future__ import annotations

import random

import numpy as np
import pytest

from cache_service.control.block_manager import (
    BlockManager,
    BlockManagerConfig,
    CacheError,
    InvalidRequest,
    PhysicalBlock,
    PoolExhausted,
    SequenceLost,
    SequenceNotFound,
)
from cache_service.control.block_rows import BlockRow

BS = 4
L = 3


def manager(workers: dict[str, int] | None = None) -> BlockManager:
    bm = BlockManager(BlockManagerConfig(block_size=BS, num_layers=L, layout_fingerprint="fp"))
    for w, n in (workers or {"w0": 64}).items():
        bm.add_worker(w, n)
    return bm


def table_ids(bm: BlockManager, seq_id: str) -> list[int]:
    return [b.index for b in bm._seqs[seq_id].table]


def check_ids(bm: BlockManager, tenant: str, seq_id: str) -> None:
    """block_ids agrees with the table, for every prefix length."""
    table = bm._seqs[seq_id].table
    workers = {b.worker_id for b in table}
    for k in {0, len(table) // 2, len(table)}:
        got = bm.block_ids(tenant, seq_id, k)
        if len(workers) != 1:
            assert got is None
            continue
        worker, ids = got
        assert worker == next(iter(workers))
        assert ids.readonly and ids.itemsize == 4
        arr = np.frombuffer(ids, dtype=np.int32)  # what the coordinator reads: no copy
        assert not arr.flags.writeable
        assert arr.tolist() == ids.tolist() == [b.index for b in table[:k]]


def write(bm: BlockManager, tenant: str, seq_id: str, tokens: list[int]) -> None:
    bm.prepare_write(tenant, seq_id, None, tokens)
    bm.commit_write(tenant, seq_id, None, len(tokens))


# -- BlockRow --------------------------------------------------------------------------


def test_row_mirrors_and_extends_its_table() -> None:
    table = [PhysicalBlock("a", i) for i in (5, 3, 9)]
    row = BlockRow(table)
    assert (row.n, row.worker, row.mixed) == (3, "a", False)
    assert row.ids(3).tolist() == [5, 3, 9]
    snapshot = row.ids(3)
    for i in range(100):  # past the buffer's capacity: it is replaced by a bigger copy
        table.append(PhysicalBlock("a", 100 + i))
        assert row.matches(table)
        row.extend(table)
    assert row.ids(103).tolist() == [5, 3, 9, *range(100, 200)]
    assert snapshot.tolist() == [5, 3, 9]  # earlier views are untouched snapshots
    with pytest.raises(TypeError):
        snapshot[0] = 1  # read only
    with pytest.raises(ValueError):
        row.ids(104)


def test_row_notices_another_worker_and_refuses_changed_tables() -> None:
    table = [PhysicalBlock("a", 1), PhysicalBlock("a", 2)]
    row = BlockRow(table)
    table.append(PhysicalBlock("b", 7))
    row.extend(table)
    assert row.mixed
    empty = BlockRow([])
    assert (empty.worker, empty.mixed, empty.n) == (None, False, 0)

    table = [PhysicalBlock("a", 1), PhysicalBlock("a", 2)]
    row = BlockRow(table)
    assert not row.matches(list(table))  # another list object
    table[-1] = PhysicalBlock("a", 8)  # the last mirrored entry replaced behind its back
    assert not row.matches(table)
    table[-1] = PhysicalBlock("a", 2)
    del table[1:]  # shorter than mirrored
    assert not row.matches(table)


# -- BlockManager.block_ids: every way a table changes --------------------------------------


def test_ids_follow_growth_one_token_at_a_time() -> None:
    bm = manager()
    s = bm.create_sequence("t").seq_id
    for token in range(30):
        for layer in range(L):
            bm.prepare_write("t", s, layer, [token])
            bm.commit_write("t", s, layer, 1)
        check_ids(bm, "t", s)
    assert len(table_ids(bm, s)) == 8


def test_copy_on_write_of_a_forked_partial_block_is_seen() -> None:
    bm = manager()
    parent = bm.create_sequence("t").seq_id
    write(bm, "t", parent, list(range(6)))  # the second block holds 2 of 4 tokens
    check_ids(bm, "t", parent)
    before = bm.block_ids("t", parent, 2)[1]  # cached row of the parent
    child = bm.fork("t", parent)
    assert bm.block_ids("t", child, 2)[1].tolist() == before.tolist()
    # The child's next write copies the shared last block (copy-on-write).
    plan = bm.prepare_write("t", child, None, [100])
    assert plan.copies
    bm.commit_write("t", child, None, 1)
    check_ids(bm, "t", child)
    check_ids(bm, "t", parent)
    assert table_ids(bm, child)[1] != table_ids(bm, parent)[1]
    assert bm.block_ids("t", child, 2)[1].tolist()[1] == plan.copies[0].dst
    assert before.tolist() == table_ids(bm, parent)  # the parent's snapshot is unchanged
    # And the parent, still sharing nothing now, grows in place.
    write(bm, "t", parent, [6, 7, 8])
    check_ids(bm, "t", parent)


def test_cancelled_writes_and_regrowth() -> None:
    bm = manager()
    s = bm.create_sequence("t").seq_id
    write(bm, "t", s, list(range(5)))
    bm.block_ids("t", s, 2)  # row built
    bm.prepare_write("t", s, 0, list(range(5, 14)))  # reserves 3 more blocks
    check_ids(bm, "t", s)
    bm.cancel_write("t", s)  # ... and drops them
    check_ids(bm, "t", s)
    assert len(table_ids(bm, s)) == 2
    with pytest.raises(InvalidRequest):
        bm.block_ids("t", s, 3)
    # Another sequence takes blocks in between, so the regrown table differs.
    other = bm.create_sequence("t").seq_id
    write(bm, "t", other, list(range(50, 58)))
    write(bm, "t", s, list(range(5, 14)))
    check_ids(bm, "t", s)
    check_ids(bm, "t", other)


def test_a_failed_batch_rolls_back_and_the_ids_follow() -> None:
    bm = manager({"w0": 6})
    a = bm.create_sequence("t").seq_id
    b = bm.create_sequence("t").seq_id
    write(bm, "t", a, [1, 2, 3])
    write(bm, "t", b, [4, 5, 6])
    bm.block_ids("t", a, 1)
    bm.block_ids("t", b, 1)
    with pytest.raises(PoolExhausted):
        # a grows by 2 blocks, then b cannot get its 5: both are put back.
        bm.prepare_writes("t", None, [(a, list(range(10, 15))), (b, list(range(20, 40)))])
    check_ids(bm, "t", a)
    check_ids(bm, "t", b)
    assert len(table_ids(bm, a)) == 1


def test_free_evict_and_reuse_never_show_an_old_table() -> None:
    bm = manager({"w0": 4})
    a = bm.create_sequence("t", list(range(8))).seq_id
    write(bm, "t", a, list(range(8)))  # two full blocks, published (cached when freed)
    old = bm.block_ids("t", a, 2)[1].tolist()
    bm.free("t", a)
    with pytest.raises(SequenceNotFound):
        bm.block_ids("t", a, 0)
    # New sequences evict the cached blocks and reuse them in another order.
    b = bm.create_sequence("t").seq_id
    write(bm, "t", b, list(range(100, 116)))  # four blocks: every block of the pool
    check_ids(bm, "t", b)
    assert sorted(table_ids(bm, b)) == sorted({*old, *table_ids(bm, b)})
    assert bm.stats().evictions >= 2


def test_adopted_prefixes_share_blocks_and_diverge_correctly() -> None:
    bm = manager()
    a = bm.create_sequence("t", list(range(12))).seq_id
    write(bm, "t", a, list(range(12)))
    b = bm.create_sequence("t", [*range(8), 99, 98]).seq_id  # adopts two blocks
    check_ids(bm, "t", b)
    write(bm, "t", b, [99, 98])
    check_ids(bm, "t", b)
    assert table_ids(bm, b)[:2] == table_ids(bm, a)[:2]
    assert table_ids(bm, b)[2] != table_ids(bm, a)[2]


def test_spread_and_lost_sequences() -> None:
    bm = manager({"w0": 2, "w1": 2})
    s = bm.create_sequence("t").seq_id
    write(bm, "t", s, list(range(16)))  # 4 blocks: both pools
    assert {b.worker_id for b in bm._seqs[s].table} == {"w0", "w1"}
    assert bm.block_ids("t", s, 4) is None
    check_ids(bm, "t", s)
    bm.lose_worker("w0")
    with pytest.raises(SequenceLost):
        bm.block_ids("t", s, 1)
    with pytest.raises(SequenceNotFound):
        bm.block_ids("other-tenant", s, 1)


def test_snapshots_and_the_durable_wrapper(tmp_path) -> None:
    from cache_service.engine.recovery import DurableBlockManager
    from cache_service.engine.store import MetadataStore, StoreConfig

    bm = manager()
    s = bm.create_sequence("t").seq_id
    write(bm, "t", s, list(range(9)))
    bm.block_ids("t", s, 3)
    copy = BlockManager.from_records(bm.to_records())
    assert copy._seqs[s].row is None  # a cache, not state
    check_ids(copy, "t", s)
    assert copy._seqs[s] == bm._seqs[s]  # the row takes no part in comparisons
    store = MetadataStore(StoreConfig(str(tmp_path / "meta.db")))
    store.begin_generation()
    try:
        durable = DurableBlockManager(manager(), store)
        durable.add_worker("w1", 8, epoch="e")
        d = durable.create_sequence("t")
        durable.prepare_write("t", d.seq_id, None, [1, 2, 3, 4, 5])
        assert durable.block_ids("t", d.seq_id, 2)[1].tolist() == table_ids(
            durable.manager, d.seq_id
        )
    finally:
        store.close()


@pytest.mark.parametrize("seed", range(12))
def test_random_operations_keep_every_row_exact(seed: int) -> None:
    """Random creates (sharing prefixes), forks, writes (some failing for lack of room),
    cancels, frees and evictions; after every step each live sequence's ids are its
    table's."""
    rng = random.Random(seed)
    bm = manager({"w0": 24} if seed % 2 else {"w0": 14, "w1": 14})
    live: list[str] = []
    prompts = [list(range(k)) for k in (0, 3, 8, 13)]
    for _ in range(150):
        op = rng.random()
        try:
            if op < 0.15 or not live:
                prompt = rng.choice(prompts)
                s = bm.create_sequence("t", prompt or None).seq_id
                live.append(s)
                if prompt:
                    info = bm.sequence_info("t", s)
                    rest = prompt[min(info.written) :]
                    if rest:
                        write(bm, "t", s, rest)
            elif op < 0.25:
                live.append(bm.fork("t", rng.choice(live)))
            elif op < 0.6:
                s = rng.choice(live)
                n = rng.choice([1, 1, 1, 2, 5])
                start = min(bm.sequence_info("t", s).written)
                tokens = [1000 + start + i for i in range(n)]
                layer = rng.choice([None, 0, 1, 2])
                if layer is not None:
                    # keep the layers' lengths equal: write every layer
                    for lay in range(L):
                        bm.prepare_write("t", s, lay, tokens)
                        bm.commit_write("t", s, lay, n)
                else:
                    write(bm, "t", s, tokens)
            elif op < 0.7:
                batch = rng.sample(live, min(len(live), 3))
                bm.prepare_writes(
                    "t",
                    None,
                    [(s, [7] * rng.choice([1, 6, 30])) for s in batch],
                )
                for s in batch:
                    bm.cancel_write("t", s)
            elif op < 0.8:
                s = rng.choice(live)
                bm.prepare_write("t", s, 0, [5] * rng.choice([1, 4, 9]))
                bm.cancel_write("t", s)
            elif op < 0.92:
                s = live.pop(rng.randrange(len(live)))
                bm.free("t", s)
            else:
                bm.evict(rng.choice([None, 1, 3]))
        except CacheError:
            pass  # out of room, quota...: the call changed nothing
        bm.take_released()
        for s in live:
            check_ids(bm, "t", s)
    bm.check_integrity()
    stats = bm.stats()
    assert stats.cow_copies and stats.evictions  # the run did exercise both


def test_integrity_check_catches_a_row_that_differs_from_its_table() -> None:
    bm = manager()
    s = bm.create_sequence("t").seq_id
    write(bm, "t", s, list(range(9)))
    bm.block_ids("t", s, 3)
    bm.check_integrity()
    row = bm._seqs[s].row
    row._buf[1] = 63  # corrupt the cache behind the manager's back
    with pytest.raises(CacheError, match="cached block-id row differs"):
        bm.check_integrity()
