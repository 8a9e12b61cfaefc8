"""The control plane's undo, release reporting and per-tenant quotas, rule by rule.

- `prepare_writes`: a batch is all or nothing; a failing item puts every earlier one back
  exactly (`to_records()` equal, so free-list / LRU order, evicted index entries, homes and
  counters too), whatever the earlier items did (grow, copy-on-write, evict).
- `cancel_write`: releases the positions no layer wrote, and only those.
- `take_released`: lists every block that went free or was evicted for reuse, never a
  block that stays cached-free (still findable by the prefix index).
- `set_tenant_quota`: per-tenant limits over the config default, kept by snapshots.
- The durable wrapper logs the new calls and recovery replays them to the same state.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from cache_service.control.block_manager import (
    BlockCopy,
    BlockManager,
    BlockManagerConfig,
    CacheError,
    InvalidRequest,
    PhysicalBlock,
    PoolExhausted,
    QuotaExceeded,
    SeqRef,
    SequenceLost,
    SequenceNotFound,
    TenantQuota,
    WriteCursor,
)
from cache_service.engine.recovery import (
    DurableBlockManager,
    cancel_unfinished_writes,
    drop_unfinished_copies,
    recover,
)
from cache_service.engine.store import MetadataStore, StoreConfig
from tests.store_workload import CONFIG, OPS, TENANTS, Workload

BS = 4
LAYERS = 2


def make(workers: dict[str, int] | None = None, **config: Any) -> BlockManager:
    cfg = BlockManagerConfig(block_size=BS, num_layers=LAYERS, layout_fingerprint="fp", **config)
    m = BlockManager(cfg)
    for worker_id, size in ({"w0": 8} if workers is None else workers).items():
        m.add_worker(worker_id, size)
    return m


def fill(m: Any, tenant: str, seq_id: str, tokens: list[int]) -> None:
    m.prepare_write(tenant, seq_id, None, tokens)
    m.commit_write(tenant, seq_id, None, len(tokens))


def unchanged(m: BlockManager, call: Callable[[], object], error: type[CacheError]) -> str:
    before = m.to_records()
    released = m.take_released()
    with pytest.raises(error) as info:
        call()
    assert m.to_records() == before
    assert m.take_released() == {}, "a failed call reported blocks as released"
    m.check_integrity()
    m._released = released  # what was pending before stays pending
    return str(info.value)


# ---- prepare_writes ---------------------------------------------------------------------


def test_batch_plans_equal_sequential_prepares() -> None:
    twins = [make({"w0": 6, "w1": 6}), make({"w0": 6, "w1": 6})]
    ids = [[m.create_sequence("t").seq_id for _ in range(3)] for m in twins]
    for m, (a, b, _) in zip(twins, ids, strict=True):
        fill(m, "t", a, [1, 2, 3])
        fill(m, "t", b, [4])
    batch = [(ids[0][0], [5, 6]), (ids[0][1], list(range(9))), (ids[0][2], [7])]
    plans = twins[0].prepare_writes("t", 0, batch)
    one_by_one = [
        twins[1].prepare_write("t", ids[1][i], 0, tokens) for i, (_, tokens) in enumerate(batch)
    ]
    assert plans == one_by_one
    records = [m.to_records() for m in twins]
    for r in records:  # ids are random: compare everything else
        r["sequences"] = [{**s, "seq_id": None} for s in r["sequences"]]
    assert records[0] == records[1]


def test_a_failing_last_item_puts_back_growth_cow_and_evictions() -> None:
    m = make({"w0": 6, "w1": 3})
    # A cached-free prefix on w0 that the batch's growth will evict (LRU oldest first).
    donor = m.create_sequence("t").seq_id
    fill(m, "t", donor, list(range(100, 108)))
    m.free("t", donor)
    assert m.stats().workers["w0"].cached_free == 2
    # A fork sharing a partly filled block: its write needs a copy-on-write copy.
    a = m.create_sequence("t").seq_id
    fill(m, "t", a, [1, 2, 3, 4, 5, 6])
    fork = m.fork("t", a)
    big = m.create_sequence("t").seq_id
    last = m.create_sequence("t").seq_id
    m.take_released()
    before_stats = m.stats()
    msg = unchanged(
        m,
        lambda: m.prepare_writes(
            "t",
            None,
            [
                (fork, [7, 8, 9]),  # copy-on-write + growth
                (big, list(range(12))),  # takes the rest of w0 (evicting) and spills
                (last, list(range(30))),  # cannot fit
            ],
        ),
        PoolExhausted,
    )
    assert "write 3 of 3" in msg and repr(last) in msg and "reserved nothing" in msg
    assert m.stats() == before_stats
    # The evicted prefix is findable again (records equal: so is the LRU order).
    assert m.lookup("t", [*range(100, 108), 0]) == 8
    # The same batch without its last item goes through, and did all three things.
    plans = m.prepare_writes("t", None, [(fork, [7, 8, 9]), (big, list(range(12)))])
    assert plans[0].copies and {w for w, _ in plans[1].slots} == {"w0", "w1"}
    after = m.stats()
    assert after.cow_copies == before_stats.cow_copies + 1
    assert after.evictions > before_stats.evictions
    assert m.lookup("t", [*range(100, 108), 0]) < 8
    m.check_integrity()


def test_quota_not_found_and_token_mismatch_in_a_batch_change_nothing() -> None:
    m = make({"w0": 16}, tenant_quota_blocks=4)
    a = m.create_sequence("t").seq_id
    b = m.create_sequence("t").seq_id
    fill(m, "t", a, [1, 2, 3])
    m.prepare_write("t", b, 0, [9, 9])  # layer 0 reserved two positions on b
    m.commit_write("t", b, 0, 2)
    msg = unchanged(
        m, lambda: m.prepare_writes("t", 0, [(a, [4, 5, 6]), (b, list(range(20)))]), QuotaExceeded
    )
    assert "quota of 4" in msg and "write 2 of 2" in msg
    unchanged(m, lambda: m.prepare_writes("t", 0, [(a, [4]), ("nope", [1])]), SequenceNotFound)
    unchanged(m, lambda: m.prepare_writes("u", 0, [(a, [4])]), SequenceNotFound)
    unchanged(m, lambda: m.prepare_writes("t", 1, [(a, [4]), (b, [9, 8])]), InvalidRequest)
    unchanged(m, lambda: m.prepare_writes("t", 0, [(a, [4]), (a, [5])]), InvalidRequest)
    unchanged(m, lambda: m.prepare_writes("t", 0, []), InvalidRequest)
    unchanged(m, lambda: m.prepare_writes("t", 0, [(a,)]), InvalidRequest)  # type: ignore[list-item]
    assert len(m.prepare_writes("t", 1, [(a, [4]), (b, [9, 9])])) == 2


# ---- cancel_write -----------------------------------------------------------------------


def test_cancel_releases_only_unwritten_positions() -> None:
    m = make()
    a = m.create_sequence("t").seq_id
    fill(m, "t", a, [1, 2, 3, 4, 5])
    m.prepare_write("t", a, 0, [6, 7, 8, 9, 10])  # reserves up to position 9: block 2
    m.commit_write("t", a, 0, 2)  # layer 0 wrote positions 5, 6
    m.take_released()
    cancelled = m.cancel_write("t", a)
    assert (cancelled.start, cancelled.num_tokens) == (7, 3)
    assert cancelled.blocks == (PhysicalBlock("w0", 2),)
    assert m.take_released() == {"w0": [2]}
    info = m.sequence_info("t", a)
    assert info.token_ids == (1, 2, 3, 4, 5, 6, 7) and info.num_blocks == 2
    assert m.unfinished_writes() == []
    m.check_integrity()
    # Nothing left to release: a no-op.
    assert m.cancel_write("t", a).num_tokens == 0
    # Other tokens may now go where the cancelled ones were reserved.
    m.prepare_write("t", a, 0, [42])
    with pytest.raises(SequenceNotFound):
        m.cancel_write("u", a)


def test_cancel_of_a_shared_reservation_frees_nothing() -> None:
    m = make()
    a = m.create_sequence("t").seq_id
    m.prepare_write("t", a, None, [1, 2, 3, 4, 5, 6])  # reserved, nothing committed
    fork = m.fork("t", a)  # shares the reserved blocks
    m.take_released()
    assert m.unfinished_writes() == [SeqRef("t", a), SeqRef("t", fork)]
    assert len(m.cancel_write("t", a).blocks) == 2
    assert m.take_released() == {}  # the fork still holds both
    m.cancel_write("t", fork)
    assert m.take_released() == {"w0": [1, 0]}  # tail first, as free() releases
    m.check_integrity()


# ---- take_released ----------------------------------------------------------------------


def test_released_lists_free_and_evicted_blocks_never_cached_free_ones() -> None:
    m = make({"w0": 4, "w1": 4})
    a = m.create_sequence("t").seq_id
    fill(m, "t", a, list(range(6)))  # block 0 full (published), block 1 partial
    m.free("t", a)
    # Block 0 stays cached-free: findable, so not released; block 1 went free.
    assert m.take_released() == {"w0": [1]}
    assert m.lookup("t", [*range(4), 9]) == 4
    assert m.evict() == 1
    assert m.take_released() == {"w0": [0]}
    # Eviction to reuse a block at once reports it too (poisoned before the new write).
    b = m.create_sequence("t").seq_id
    fill(m, "t", b, list(range(8)))
    m.free("t", b)
    assert m.take_released() == {}
    c = m.create_sequence("t").seq_id
    fill(m, "t", c, list(range(50, 66)))  # needs all 4 blocks of w0... or w1
    d = m.create_sequence("t").seq_id
    fill(m, "t", d, list(range(70, 86)))
    released = m.take_released()
    assert sorted(released.get("w0", [])) == [0, 1], released
    # Releases pending on a worker that is then lost are dropped (its pool is gone); the
    # failed sequence's blocks on other workers are reported.
    m = make({"w0": 4, "w1": 4})
    s = m.create_sequence("t").seq_id
    m.prepare_write("t", s, 0, list(range(18)))  # w0 0-3, w1 0; layer 1 not written:
    m.commit_write("t", s, 0, 18)  # nothing published
    r = m.create_sequence("t").seq_id
    fill(m, "t", r, [1, 2])  # w1 block 1
    m.free("t", r)
    assert m.take_released() == {"w1": [1]}
    r = m.create_sequence("t").seq_id
    fill(m, "t", r, [1, 2])
    m.free("t", r)  # pending again when the worker goes
    assert m.lose_worker("w1") == [SeqRef("t", s)]
    assert m.take_released() == {"w0": [3, 2, 1, 0]}


# ---- quotas -----------------------------------------------------------------------------


def test_tenant_quota_overrides_the_default_and_survives_snapshots() -> None:
    m = make({"w0": 32}, tenant_quota_blocks=2, tenant_quota_sequences=3)
    m.set_tenant_quota("big", max_blocks=6)
    m.set_tenant_quota("few", max_sequences=1)
    assert m.tenant_quotas() == {"big": TenantQuota(6, None), "few": TenantQuota(None, 1)}
    big = m.create_sequence("big").seq_id
    fill(m, "big", big, list(range(24)))  # 6 blocks: over the default of 2
    msg = unchanged(m, lambda: fill(m, "big", big, [1]), QuotaExceeded)
    assert "'big' holds 6 blocks" in msg and "quota of 6" in msg
    m.create_sequence("big")
    m.create_sequence("big")
    unchanged(m, lambda: m.create_sequence("big"), QuotaExceeded)  # default: 3 sequences
    m.create_sequence("few")
    msg = unchanged(m, lambda: m.create_sequence("few"), QuotaExceeded)
    assert "'few' has 1 live sequences, its quota is 1" in msg
    other = m.create_sequence("other").seq_id
    unchanged(m, lambda: fill(m, "other", other, list(range(9))), QuotaExceeded)
    records = m.to_records()
    restored = BlockManager.from_records(json.loads(json.dumps(records)))
    assert restored.tenant_quotas() == m.tenant_quotas()
    assert restored.to_records() == records
    # Lowering below usage refuses growth but takes nothing away; None removes it.
    m.set_tenant_quota("big", max_blocks=1)
    assert m.sequence_info("big", big).num_blocks == 6
    m.set_tenant_quota("big")
    assert "big" not in m.tenant_quotas()
    for bad in ({"max_blocks": 0}, {"max_sequences": True}, {"max_blocks": 1.5}):
        unchanged(m, lambda bad=bad: m.set_tenant_quota("x", **bad), InvalidRequest)
    unchanged(m, lambda: m.set_tenant_quota(""), InvalidRequest)


def test_write_cursor_is_the_layer_start_and_reserved_tail() -> None:
    m = make()
    a = m.create_sequence("t").seq_id
    fill(m, "t", a, [1, 2, 3])
    m.prepare_write("t", a, 0, [4, 5])
    m.commit_write("t", a, 0, 2)
    assert m.write_cursor("t", a, 0) == WriteCursor(5, ())
    assert m.write_cursor("t", a, 1) == WriteCursor(3, (4, 5))
    with pytest.raises(InvalidRequest):
        m.write_cursor("t", a, None)
    m.lose_worker("w0")
    with pytest.raises(SequenceLost):
        m.write_cursor("t", a, 0)


# ---- durable log ------------------------------------------------------------------------


def _store(path: Path, checkpoint_every: int = 1000) -> MetadataStore:
    store = MetadataStore(
        StoreConfig(str(path), synchronous="NORMAL", checkpoint_every=checkpoint_every)
    )
    store.begin_generation()
    return store


@pytest.mark.parametrize("checkpoint_every", [1000, 3])
def test_new_calls_are_logged_and_replayed(tmp_path: Path, checkpoint_every: int) -> None:
    path = tmp_path / "s.db"
    cfg = BlockManagerConfig(block_size=BS, num_layers=LAYERS, layout_fingerprint="fp")
    store = _store(path, checkpoint_every)
    d = DurableBlockManager(BlockManager(cfg), store)
    d.add_worker("w0", 6, epoch="e0")
    d.set_tenant_quota("t", max_blocks=5)
    a = d.create_sequence("t").seq_id
    fill(d, "t", a, [1, 2, 3, 4, 5, 6])
    fork = d.fork("t", a)
    b = d.create_sequence("t").seq_id
    before = d.manager.to_records()
    with pytest.raises(QuotaExceeded):  # refused whole: nothing logged
        d.prepare_writes("t", None, [(fork, [7]), (b, list(range(20)))])
    assert d.manager.to_records() == before
    plans = d.prepare_writes("t", None, [(fork, iter([7, 8])), (b, (1, 2))])
    assert plans[0].copies == [BlockCopy("w0", 1, 2)]
    assert d.unfinished_copies == {SeqRef("t", fork): [BlockCopy("w0", 1, 2)]}
    d.commit_write("t", b, None, 2)
    d.cancel_write("t", b)  # nothing left to cancel: still logged, replays the same
    d.prepare_write("t", a, 0, [9, 9, 9])
    d.cancel_write("t", a)
    final = d.manager.to_records()
    store.close()

    store = _store(path)
    result = recover(store, cfg)
    assert result.manager.to_records() == final
    assert result.manager.tenant_quotas() == {"t": TenantQuota(5, None)}
    assert result.manager.take_released() == {}, "replayed releases must not reach workers"
    durable = DurableBlockManager.from_recovery(result, store)
    # The fork's write was prepared (with a copy) and never committed: dropped; the
    # reservation of b is gone already.
    assert drop_unfinished_copies(durable) == [SeqRef("t", fork)]
    assert cancel_unfinished_writes(durable) == []
    durable.manager.check_integrity()
    store.close()


def test_recovery_cancels_reservations_of_calls_in_flight(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    cfg = BlockManagerConfig(block_size=BS, num_layers=LAYERS, layout_fingerprint="fp")
    store = _store(path)
    d = DurableBlockManager(BlockManager(cfg), store)
    d.add_worker("w0", 6, epoch="e0")
    a = d.create_sequence("t").seq_id
    fill(d, "t", a, [1, 2])
    d.prepare_writes("t", 1, [(a, [3, 4, 5])])  # the crash came before the commit
    store.close()

    store = _store(path)
    durable = DurableBlockManager.from_recovery(recover(store, cfg), store)
    assert durable.unfinished_writes() == [SeqRef("t", a)]
    assert cancel_unfinished_writes(durable) == [SeqRef("t", a)]
    assert durable.sequence_info("t", a).token_ids == (1, 2)
    # Block 1 held only the cancelled position 4: free, for the workers to poison.
    assert durable.take_released() == {"w0": [1]}
    durable.prepare_write("t", a, 1, [7])  # another token is welcome there now
    store.close()


class UndoWorkload(Workload):
    """The store tests' random workload plus batches, cancels and per-tenant quotas."""

    def step(self) -> str:
        op = self.rng.choice((*OPS, "batch", "batch", "cancel", "quota"))
        try:
            self._do(op)
        except CacheError:
            self.errors += 1
        return op

    def _do(self, op: str) -> None:
        m, rng = self.m, self.rng
        if op == "batch":
            tenant = rng.choice(TENANTS)
            mine = [p for p in self.live if p[0] == tenant]
            picked = rng.sample(mine, min(len(mine), rng.randrange(1, 4)))
            if not picked:
                return
            layer = None if rng.random() < 0.5 else rng.randrange(CONFIG.num_layers)
            writes = []
            for _, seq_id in picked:
                cursor = m.write_cursor(tenant, seq_id, 0 if layer is None else layer)
                n = rng.randrange(1, 9)
                tokens = list(cursor.reserved[:n])
                tokens += [rng.randrange(1, 50) for _ in range(n - len(tokens))]
                writes.append((seq_id, tokens))
            m.prepare_writes(tenant, layer, writes)
            self.mutations += 1
            for seq_id, tokens in writes:
                if rng.random() < 0.7:
                    m.commit_write(tenant, seq_id, layer, len(tokens))
                    self.mutations += 1
        elif op == "cancel":
            picked = self._pick()
            if picked:
                m.cancel_write(*picked)
                self.mutations += 1
        elif op == "quota":
            m.set_tenant_quota(
                rng.choice(TENANTS), rng.choice([None, 3, 12]), rng.choice([None, 2, 6])
            )
            self.mutations += 1
        else:
            super()._do(op)


_paths = itertools.count()


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    seed=st.integers(0, 2**32 - 1),
    steps=st.integers(1, 150),
    checkpoint_every=st.integers(1, 50),
)
@example(seed=1, steps=600, checkpoint_every=40)
@example(seed=2, steps=600, checkpoint_every=1000)
def test_random_batches_cancels_and_quotas_recover_exactly(
    tmp_path: Path, seed: int, steps: int, checkpoint_every: int
) -> None:
    path = tmp_path / f"s{next(_paths)}.db"
    store = _store(path, checkpoint_every)
    durable = DurableBlockManager(BlockManager(CONFIG), store)
    work = UndoWorkload(durable, random.Random(seed))
    work.setup()
    for _ in range(steps):
        work.step()
        durable.manager.check_integrity()
    # Failed calls (a refused batch among them) are never logged.
    assert store.last_lsn() == work.mutations
    expected = durable.manager.to_records()
    unfinished = durable.unfinished_copies
    store.close()
    store = _store(path)
    result = recover(store, CONFIG)
    assert result.manager.to_records() == expected
    assert result.unfinished_copies == unfinished
    store.close()
