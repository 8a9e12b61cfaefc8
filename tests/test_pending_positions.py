"""Positions reserved ahead of their tokens (a multi-step step lease): `prepare_writes`'
`ahead`, `fill_pending`, `commit_steps`, and their write-ahead log records
(cache_service/control/write_path.py, repeated_writes.py, engine/recovery.py).

The coordinator's use of them (one StepLease planning several decode steps, its report
naming their tokens) is tested against a real server in test_step_leases.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cache_service.control.block_manager import BlockManager, BlockManagerConfig
from cache_service.control.sequence import PENDING_TOKEN
from cache_service.control.types import SeqRef
from cache_service.engine.recovery import DurableBlockManager, cancel_unfinished_writes, recover
from cache_service.engine.store import MetadataStore, StoreConfig
from cache_service.errors import InvalidRequest, PoolExhausted

BS = 4
LAYERS = 3
CONFIG = BlockManagerConfig(block_size=BS, num_layers=LAYERS, layout_fingerprint="fp")


def make(blocks: int = 16) -> BlockManager:
    m = BlockManager(CONFIG)
    m.add_worker("w0", blocks)
    return m


def written_seq(m: BlockManager, prompt: list[int]) -> str:
    seq_id = m.create_sequence("t", prompt).seq_id
    m.prepare_write("t", seq_id, None, prompt)
    m.commit_write("t", seq_id, None, len(prompt))
    return seq_id


def reserve(m, seq_ids: list[str], first: list[int], steps: int):
    """A step's positions and its `steps - 1` later ones reserved, and their snapshot (as
    the coordinator takes it, once it read the block ids)."""
    writes = [(s, [t]) for s, t in zip(seq_ids, first, strict=True)]
    plans = m.prepare_writes("t", 0, writes, steps - 1)
    for s, plan in zip(seq_ids, plans, strict=True):
        m.block_ids("t", s, -(-(plan.start + len(plan.slots)) // BS))
    return plans, m.snapshot_writes("t", seq_ids, plans, ragged=True)


def test_positions_ahead_get_slots_now_and_tokens_at_the_commit() -> None:
    m = make()
    a, b = written_seq(m, [1, 2, 3]), written_seq(m, [4, 5, 6, 7, 8])
    plans, snapshot = reserve(m, [a, b], [10, 20], steps=4)
    # One slot per step and sequence, the table grown for all of them at once.
    assert [p.start for p in plans] == [3, 5] and all(len(p.slots) == 4 for p in plans)
    assert len({slot for p in plans for slot in p.slots}) == 8
    assert m._seqs[a].tokens == [1, 2, 3, 10] + [PENDING_TOKEN] * 3
    # Read back, the sequence holds no pending token (they are no tokens yet).
    assert m.sequence_info("t", a).token_ids == (1, 2, 3, 10)
    m.check_integrity()

    # Two steps complete, the third on layers 0 and 2 only: their tokens named, then the
    # commit, then the fourth step's position given back.
    m.fill_pending("t", [(a, 4, [11, 12]), (b, 6, [21, 22])])
    m.commit_steps(snapshot, 2, [0, 2])
    assert m.written_lengths("t", a) == (6, 5, 6)
    m.cancel_write("t", a)
    m.cancel_write("t", b)
    assert m.sequence_info("t", a).token_ids == (1, 2, 3, 10, 11, 12)
    assert m.sequence_info("t", b).token_ids == (4, 5, 6, 7, 8, 20, 21, 22)
    assert m.written_lengths("t", b) == (8, 7, 8)
    m.check_integrity()


def test_a_block_filled_by_the_steps_is_shared_with_their_tokens() -> None:
    m = make()
    a = written_seq(m, [1, 2, 3])
    _, snapshot = reserve(m, [a], [4], steps=3)
    m.fill_pending("t", [(a, 4, [5, 6])])
    m.commit_steps(snapshot, 3, [])
    # The first block [1, 2, 3, 4] is full and written everywhere: published with the
    # named tokens, so a new sequence with that prompt finds it cached.
    assert m.create_sequence("t", [1, 2, 3, 4, 5]).num_cached_tokens == 4
    m.check_integrity()


def test_bad_uses_are_refused_and_change_nothing() -> None:
    m = make(blocks=4)
    a = written_seq(m, [1, 2, 3])
    written_seq(m, [9] * 8)  # one block left
    before = m.to_records()
    with pytest.raises(InvalidRequest, match="ahead must be"):
        m.prepare_writes("t", 0, [(a, [4])], -1)
    # All or nothing: no room for every step's positions reserves none.
    with pytest.raises(PoolExhausted):
        m.prepare_writes("t", 0, [(a, [4])], 8)
    with pytest.raises(InvalidRequest, match="more than any sequence can hold"):
        m.prepare_writes("t", 0, [(a, [4])], 100)
    assert m.to_records() == before

    _, snapshot = reserve(m, [a], [4], steps=3)
    # Positions ahead only at the end of a sequence (layer 1 is behind layer 0 now).
    with pytest.raises(InvalidRequest, match="positions reserved past"):
        m.prepare_writes("t", 1, [(a, [4])], 2)
    held = m.to_records()
    with pytest.raises(InvalidRequest, match=r"not\s+all pending"):
        m.fill_pending("t", [(a, 3, [4, 5])])  # position 3 holds a known token
    with pytest.raises(InvalidRequest, match="outside"):
        m.fill_pending("t", [(a, 4, [5, 6, 7])])
    with pytest.raises(InvalidRequest, match="appears twice"):
        m.fill_pending("t", [(a, 4, [5]), (a, 5, [6])])
    with pytest.raises(InvalidRequest):
        m.fill_pending("t", [(a, 4, [-5])])
    with pytest.raises(InvalidRequest, match="pass the"):
        m.commit_steps(snapshot, 3, [0])  # four positions of the three reserved
    with pytest.raises(InvalidRequest, match="distinct"):
        m.commit_steps(snapshot, 1, [0, 0])
    assert m.to_records() == held
    m.commit_steps(snapshot, 1, [])
    with pytest.raises(InvalidRequest, match="no longer stands"):
        m.commit_steps(snapshot, 1, [])  # committed already
    m.cancel_write("t", a)
    assert m.sequence_info("t", a).token_ids == (1, 2, 3, 4)
    m.check_integrity()


def opened_store(path: Path) -> MetadataStore:
    store = MetadataStore(StoreConfig(str(path)))
    store.begin_generation()
    return store


def logged_sequence(path: Path) -> tuple[MetadataStore, DurableBlockManager, str]:
    """A logged control plane holding one sequence of 3 tokens written on every layer."""
    store = opened_store(path)
    d = DurableBlockManager(BlockManager(CONFIG), store)
    d.add_worker("w0", 16, epoch="e")
    a = d.create_sequence("t", [1, 2, 3]).seq_id
    d.prepare_write("t", a, None, [1, 2, 3])
    d.commit_write("t", a, None, 3)
    return store, d, a


def test_the_log_replays_a_multi_step_lease(tmp_path: Path) -> None:
    store, d, a = logged_sequence(tmp_path / "m.db")
    _, snapshot = reserve(d, [a], [4], steps=4)
    d.fill_pending("t", [(a, 4, [5, 6])])
    d.commit_steps(snapshot, 2, [1])
    d.cancel_write("t", a)
    expected = d.manager.to_records()
    store.close()

    store = opened_store(tmp_path / "m.db")
    result = recover(store, CONFIG)
    assert result.manager.to_records() == expected
    assert result.manager.sequence_info("t", a).token_ids == (1, 2, 3, 4, 5, 6)
    assert result.manager.written_lengths("t", a) == (5, 6, 5)
    result.manager.check_integrity()
    store.close()


def test_a_crash_inside_a_lease_recovers_without_pending_positions(tmp_path: Path) -> None:
    store, d, a = logged_sequence(tmp_path / "m.db")
    d.prepare_writes("t", 0, [(a, [4])], 5)  # the lease's client never reported
    store.close()

    store = opened_store(tmp_path / "m.db")
    result = recover(store, CONFIG)
    durable = DurableBlockManager.from_recovery(result, store)
    # Recovery cancels reservations never committed: the pending positions go with them.
    assert cancel_unfinished_writes(durable) == [SeqRef("t", a)]
    assert durable.manager._seqs[a].tokens == [1, 2, 3]
    durable.manager.check_integrity()
    store.close()
