"""Recovery = checkpoint + verified replay gives back exactly the logged control plane."""

from __future__ import annotations

import itertools
import random
import sqlite3
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_service.control.block_manager import BlockManager, BlockManagerConfig
from cache_service.control.types import SeqRef
from cache_service.engine.recovery import DurableBlockManager, RecoveryError, recover
from cache_service.engine.store import MetadataStore, StoreConfig, StoreError
from cache_service.errors import InvalidRequest, SequenceNotFound
from tests.store_workload import CONFIG, Workload

pytestmark = pytest.mark.timeout(120)

_counter = itertools.count()


def _fresh_path(root: Path) -> Path:
    return root / f"store-{next(_counter)}.db"


def _open(path: Path, checkpoint_every: int = 1000, sync: str = "NORMAL") -> MetadataStore:
    store = MetadataStore(
        StoreConfig(str(path), synchronous=sync, checkpoint_every=checkpoint_every)  # type: ignore[arg-type]
    )
    store.begin_generation()
    return store


def _recover(path: Path, config: BlockManagerConfig = CONFIG, checkpoint_every: int = 1000):
    store = _open(path, checkpoint_every)
    return store, recover(store, config)


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    seed=st.integers(0, 2**32 - 1),
    steps=st.integers(1, 120),
    checkpoint_every=st.integers(1, 60),
    more=st.integers(0, 40),
    group=st.booleans(),
)
def test_recovered_manager_equals_the_original(
    tmp_path: Path, seed: int, steps: int, checkpoint_every: int, more: int, group: bool
) -> None:
    path = _fresh_path(tmp_path)
    store = _open(path, checkpoint_every)
    durable = DurableBlockManager(BlockManager(CONFIG), store, group_commit=group)
    work = Workload(durable, random.Random(seed))
    work.setup()
    for _ in range(steps):
        work.step()
        if work.rng.random() < 0.3:
            durable.flush()
    durable.flush()
    # Failed calls are never logged: the log holds exactly the successful mutations.
    assert store.last_lsn() == work.mutations
    expected = durable.manager.to_records()
    epochs, unfinished = durable.worker_epochs, durable.unfinished_copies
    store.close()

    store, result = _recover(path, checkpoint_every=checkpoint_every)
    assert result.generation == 2
    assert result.checkpoint_lsn + result.replayed == work.mutations
    assert result.manager.to_records() == expected
    result.manager.check_integrity()
    assert result.worker_epochs == epochs
    assert result.unfinished_copies == unfinished

    # Carry on from the recovered state in the same file, then recover again.
    durable = DurableBlockManager.from_recovery(result, store)
    work.m = durable
    for _ in range(more):
        work.step()
    expected = durable.manager.to_records()
    assert store.last_lsn() == work.mutations
    store.close()
    store, result = _recover(path)
    assert result.generation == 3
    assert result.manager.to_records() == expected
    store.close()


def test_replay_uses_the_logged_ids_and_stats_survive(tmp_path: Path) -> None:
    path = tmp_path / "m.db"
    store = _open(path)
    d = DurableBlockManager(BlockManager(CONFIG), store)
    d.add_worker("w0", 16, epoch="abc")
    a = d.create_sequence("acme", list(range(10)))
    plan = d.prepare_write("acme", a.seq_id, None, list(range(10)))
    d.commit_write("acme", a.seq_id, None, len(plan.slots))
    b = d.create_sequence("acme", list(range(10)))
    assert b.num_cached_tokens == 8  # two full blocks of 4 shared
    f = d.fork("acme", b.seq_id)
    stats = d.stats()
    store.close()

    store, result = _recover(path)
    m = result.manager
    assert m.sequence_info("acme", a.seq_id).written == (10, 10)
    assert m.sequence_info("acme", f).token_ids == tuple(range(8))
    assert m.stats() == stats
    assert result.worker_epochs == {"w0": "abc"}
    store.close()


def test_failed_calls_are_not_logged_and_a_broken_log_fails_closed(tmp_path: Path) -> None:
    store = _open(tmp_path / "m.db")
    d = DurableBlockManager(BlockManager(CONFIG), store)
    d.add_worker("w0", 4)
    with pytest.raises(InvalidRequest):
        d.add_worker("w0", 4)
    with pytest.raises(SequenceNotFound):
        d.prepare_write("acme", "nope", 0, [1])
    assert store.last_lsn() == 1

    def broken(*args: object, **kwargs: object) -> int:
        raise StoreError("disk full")

    store.append = broken  # type: ignore[method-assign]
    with pytest.raises(StoreError, match="could not log create_sequence: disk full"):
        d.create_sequence("acme", [1, 2, 3])
    with pytest.raises(StoreError, match="restart the coordinator"):
        d.create_sequence("acme", [1, 2, 3])
    with pytest.raises(AttributeError, match="only logged mutations"):
        _ = d._pools
    store.close()


def test_a_tampered_log_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "m.db"
    store = _open(path)
    d = DurableBlockManager(BlockManager(CONFIG), store)
    d.add_worker("w0", 16)
    s = d.create_sequence("acme", None)
    d.prepare_write("acme", s.seq_id, 0, [1, 2, 3])
    store.close()
    db = sqlite3.connect(path)
    db.execute('UPDATE log SET result = \'{"start":0,"slots":[],"copies":[]}\' WHERE lsn = 3')
    db.commit()
    db.close()
    store = _open(path)
    with pytest.raises(RecoveryError, match=r"log record 3 \(prepare_write"):
        recover(store, CONFIG)
    store.close()


def test_another_layout_is_refused_and_quotas_may_change(tmp_path: Path) -> None:
    path = tmp_path / "m.db"
    store = _open(path)
    d = DurableBlockManager(BlockManager(CONFIG), store)
    d.add_worker("w0", 16)
    d.create_sequence("acme", [1, 2, 3])
    store.close()
    store = _open(path)
    other = BlockManagerConfig(8, CONFIG.num_layers, CONFIG.layout_fingerprint)
    with pytest.raises(RecoveryError, match="block_size=4"):
        recover(store, other)
    with pytest.raises(RecoveryError, match="block_size=4"):
        DurableBlockManager(BlockManager(other), store)
    looser = BlockManagerConfig(4, CONFIG.num_layers, CONFIG.layout_fingerprint, None, None)
    result = recover(store, looser)
    assert result.manager.config == looser
    store.close()


def test_uncommitted_copy_on_write_is_reported_across_a_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "m.db"
    store = _open(path)
    d = DurableBlockManager(BlockManager(CONFIG), store)
    d.add_worker("w0", 16)
    a = d.create_sequence("acme", None)
    d.prepare_write("acme", a.seq_id, None, [1, 2])
    d.commit_write("acme", a.seq_id, None, 2)
    f = d.fork("acme", a.seq_id)
    plan = d.prepare_write("acme", f, None, [3])  # the shared partial block is copied
    assert plan.copies
    d.checkpoint()
    other = d.create_sequence("acme", None)  # logged after the checkpoint
    store.close()

    store, result = _recover(path)
    assert result.unfinished_copies == {SeqRef("acme", f): plan.copies}
    assert result.checkpoint_lsn > 0 and result.replayed == 1
    d = DurableBlockManager.from_recovery(result, store)
    d.commit_write("acme", f, None, 1)
    d.free("acme", other.seq_id)
    assert d.unfinished_copies == {}
    store.close()


def test_group_commit_loses_exactly_the_unflushed_tail(tmp_path: Path) -> None:
    path = tmp_path / "m.db"
    store = _open(path, checkpoint_every=15)
    durable = DurableBlockManager(BlockManager(CONFIG), store, group_commit=True)
    work = Workload(durable, random.Random(7))
    work.setup()
    for _ in range(60):
        work.step()
    flushed = durable.flush()
    assert flushed > 0 and store.pending == 0
    expected, lsn = durable.manager.to_records(), store.last_lsn()
    for _ in range(30):
        work.step()
    assert store.pending > 0
    store.close()  # a crash before the next flush: none of the tail was acknowledged

    store, result = _recover(path)
    assert result.checkpoint_lsn + result.replayed == lsn
    assert result.manager.to_records() == expected
    store.close()
