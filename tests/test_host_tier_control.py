"""The host tier's bookkeeping (cache_service/control/host_tier.py): evicted prefix blocks
move to host blocks instead of being dropped, a prefix hit restores them, the tiers'
accounting stays exact, and worker loss / recovery drop the host entries."""

from __future__ import annotations

import pytest

from cache_service.control.block_manager import BlockManager, BlockManagerConfig
from cache_service.control.host_tier import HostBlock, TierMove
from cache_service.control.types import PhysicalBlock
from cache_service.errors import IntegrityError, InvalidRequest

BS = 4


def manager(gpu: int = 2, host: int = 2, workers: int = 1) -> BlockManager:
    m = BlockManager(BlockManagerConfig(BS, 2, "fp"))
    for i in range(workers):
        m.add_worker(f"w{i}", gpu, host_blocks=host)
    return m


def cache_prompt(m: BlockManager, tokens: list[int], tenant: str = "t") -> str:
    """Compute a prompt's blocks, publish them and free the sequence (cached-free)."""
    seq_id = m.create_sequence(tenant).seq_id
    m.prepare_write(tenant, seq_id, None, tokens)
    m.commit_write(tenant, seq_id, None, len(tokens))
    m.free(tenant, seq_id)
    return seq_id


def block(i: int) -> list[int]:
    return [i] * BS


def test_an_evicted_block_moves_to_the_host_tier_and_a_hit_restores_it() -> None:
    m = manager(gpu=2, host=2)
    cache_prompt(m, block(1))  # GPU block 0
    cache_prompt(m, block(2))  # GPU block 1
    assert m.take_tier_moves() == {}
    cache_prompt(m, block(3))  # evicts block(1): least recently released
    assert m.take_tier_moves() == {"w0": [TierMove("offload", 0, 0)]}
    m.check_integrity()
    stats = m.stats()
    assert stats.host_tiers["w0"].used == 1
    # Still found: lookup counts it (restorable), create_sequence restores it.
    assert m.lookup("t", [*block(1), 9]) == BS
    created = m.create_sequence("t", [*block(1), 9])
    assert created.num_cached_tokens == BS
    moves = m.take_tier_moves()["w0"]
    # Restoring takes a GPU block: the LRU cached-free one (block(2)) goes to host first.
    assert moves == [TierMove("offload", 1, 1), TierMove("restore", 1, 0)]
    m.check_integrity()
    assert m.stats().host_hit_tokens == BS
    assert m.stats().host_tiers["w0"].used == 1  # block(2) now; block(1)'s host block freed
    view = m.attention_view("t", created.seq_id, 0)
    assert view.seq_len == BS


def test_without_a_host_tier_evicted_blocks_are_dropped() -> None:
    m = manager(gpu=2, host=0)
    for i in (1, 2, 3):
        cache_prompt(m, block(i))
    assert m.take_tier_moves() == {}
    assert m.lookup("t", [*block(1), 9]) == 0
    assert m.host_tiers() == {}
    m.check_integrity()


def test_a_full_host_tier_drops_its_own_least_recent_block() -> None:
    m = manager(gpu=2, host=1)
    for i in (1, 2, 3):
        cache_prompt(m, block(i))  # block(1) -> host 0
    cache_prompt(m, block(4))  # block(2) -> host 0, block(1) dropped
    assert m.lookup("t", [*block(1), 9]) == 0
    assert m.lookup("t", [*block(2), 9]) == BS
    assert m.stats().host_evictions == 1
    m.check_integrity()


def test_a_chain_across_tiers_is_matched_and_restored_whole() -> None:
    m = manager(gpu=4, host=4)
    prompt = block(1) + block(2) + block(3)
    cache_prompt(m, prompt)  # blocks 0, 1, 2; released tail first: 2, 1, 0 in LRU order
    cache_prompt(m, block(7) + block(8) + block(9))  # block 3, then evicts 2 and 1 to host
    m.take_tier_moves()
    assert m.lookup("t", [*prompt, 0]) == 3 * BS
    created = m.create_sequence("t", [*prompt, 0])
    assert created.num_cached_tokens == 3 * BS
    moves = m.take_tier_moves()["w0"]
    assert [mv.direction for mv in moves].count("restore") == 2
    m.check_integrity()
    info = m.sequence_info("t", created.seq_id)
    assert info.num_blocks == 3


def test_tenants_never_restore_each_others_blocks() -> None:
    m = manager(gpu=2, host=2)
    for i in (1, 2, 3):
        cache_prompt(m, block(i), tenant="a")  # a's block(1) -> host
    assert m.lookup("a", [*block(1), 0]) == BS
    assert m.lookup("b", [*block(1), 0]) == 0
    assert m.create_sequence("b", [*block(1), 0]).num_cached_tokens == 0
    m.check_integrity()


def test_a_restore_without_room_on_the_gpu_stops_the_match_there() -> None:
    m = manager(gpu=2, host=2)
    for i in (1, 2, 3):
        cache_prompt(m, block(i))  # block(1) -> host
    holder = m.create_sequence("t").seq_id
    m.prepare_write("t", holder, None, block(5) + block(6))  # every GPU block used now
    assert m.lookup("t", [*block(1), 0]) == 0
    assert m.create_sequence("t", [*block(1), 0]).num_cached_tokens == 0
    m.check_integrity()


def test_losing_a_worker_drops_its_host_entries_and_re_adding_starts_empty() -> None:
    m = manager(gpu=2, host=2, workers=2)
    seq = m.create_sequence("t").seq_id
    m.prepare_write("t", seq, None, block(1))
    m.commit_write("t", seq, None, BS)
    worker = m.sequence_info("t", seq).workers[0]
    m.free("t", seq)
    other = m.create_sequence("t").seq_id
    m.prepare_write("t", other, None, block(2))
    m.commit_write("t", other, None, BS)
    m.free("t", other)
    evicted = m.evict(worker_id=worker)
    assert evicted >= 1
    assert m.stats().host_tiers[worker].used == evicted
    assert m.lookup("t", [*block(1), 0]) == BS
    m.lose_worker(worker)
    assert m.lookup("t", [*block(1), 0]) == 0
    assert worker not in m.stats().host_tiers
    m.check_integrity()
    m.add_worker(worker, 2, host_blocks=2)
    assert m.stats().host_tiers[worker].used == 0
    m.check_integrity()


def test_snapshots_carry_the_host_tier_and_drop_host_tier_empties_it() -> None:
    m = manager(gpu=2, host=2)
    for i in (1, 2, 3):
        cache_prompt(m, block(i))
    again = BlockManager.from_records(m.to_records())
    assert again.lookup("t", [*block(1), 0]) == BS
    assert again.to_records() == m.to_records()
    assert again.drop_host_tier() == 1
    assert again.lookup("t", [*block(1), 0]) == 0
    assert again.host_tiers() == {"w0": 2}
    assert again.stats().host_tiers["w0"].used == 0
    again.check_integrity()


def test_the_integrity_check_sees_a_key_in_both_tiers_and_a_held_block_without_keys() -> None:
    m = manager(gpu=2, host=2)
    for i in (1, 2, 3):
        cache_prompt(m, block(i))
    key = next(iter(m._host.entries))
    entry = m._host.entries[key]
    m._index.publish(key, entry._replace(block=PhysicalBlock("w0", 1)))
    with pytest.raises(IntegrityError, match="both tiers"):
        m.check_integrity()
    m2 = manager(gpu=2, host=2)
    for i in (1, 2, 3):
        cache_prompt(m2, block(i))
    m2._host.pools["w0"]._keys[0] = []
    with pytest.raises(IntegrityError, match="no key"):
        m2.check_integrity()
    assert isinstance(entry.block, HostBlock)


def test_a_negative_host_size_is_refused() -> None:
    m = BlockManager(BlockManagerConfig(BS, 1, "fp"))
    with pytest.raises(InvalidRequest, match="host_blocks"):
        m.add_worker("w0", 2, host_blocks=-1)
    assert m.workers() == {}


def test_the_log_replays_the_host_tier_and_a_recovered_coordinator_drops_it(tmp_path) -> None:
    from cache_service.engine.recovery import (
        DurableBlockManager,
        recover,
        recover_control_plane,
    )
    from cache_service.engine.store import MetadataStore, StoreConfig

    config = BlockManagerConfig(BS, 2, "fp")

    def open_store(checkpoint_every: int) -> MetadataStore:
        return MetadataStore(
            StoreConfig(
                str(tmp_path / "m.db"), synchronous="NORMAL", checkpoint_every=checkpoint_every
            )
        )

    store = open_store(3)  # checkpoints mid-way: the host tier is in the snapshot too
    store.begin_generation()
    d = DurableBlockManager(BlockManager(config), store)
    d.add_worker("w0", 2, epoch="e0", host_blocks=2)
    for i in (1, 2, 3):
        seq = d.create_sequence("t").seq_id
        d.prepare_write("t", seq, None, block(i))
        d.commit_write("t", seq, None, BS)
        d.free("t", seq)
    restored = d.create_sequence("t", [*block(1), 0])
    assert restored.num_cached_tokens == BS
    d.free("t", restored.seq_id)
    records = d.to_records()
    assert d.host_tiers() == {"w0": 2}
    store.close()

    store = open_store(1000)
    store.begin_generation()
    result = recover(store, config)
    assert result.manager.to_records() == records  # replayed exactly, host tier included
    assert result.manager.take_tier_moves() == {}  # copies of the past are not redone
    store.close()

    store = open_store(1000)
    durable, _, kept = recover_control_plane(store, config, {"w0": ("e0", 2)})
    assert kept == {"w0"}
    assert durable.stats().host_tiers["w0"].used == 0
    assert durable.lookup("t", [*block(2), 0]) == 0  # was in the host tier: dropped
    durable.check_integrity()
    store.close()
    store = open_store(1000)
    store.begin_generation()
    again = recover(store, config)  # the drop was logged
    assert again.manager.stats().host_tiers["w0"].used == 0
    store.close()


def test_kv_events_follow_a_block_across_tiers() -> None:
    # A router must see a block leave the GPU and land in host memory (and back), and a
    # host block given up for room leave: replaying the events gives both tiers' keys.
    from cache_service.control.kv_events import AllCleared, BlockRemoved, BlockStored, KvEventLog

    m = manager(gpu=2, host=1)
    log = KvEventLog()  # no write-ahead log: events visible at once
    m.attach_events(log)
    held: dict[str, set[bytes]] = {"gpu": set(), "cpu": set()}

    def replay() -> None:
        for event in log.read(replay.seen, 1000):
            body = event.body
            if isinstance(body, BlockStored):
                held[body.medium].update(body.hashes)
            elif isinstance(body, BlockRemoved):
                assert set(body.hashes) <= held[body.medium], body
                held[body.medium].difference_update(body.hashes)
            elif isinstance(body, AllCleared):
                held["gpu"].clear()
                held["cpu"].clear()
            replay.seen = event.sequence

    replay.seen = 0
    for i in (1, 2, 3):
        cache_prompt(m, block(i))  # block(1) -> host
    replay()
    assert len(held["gpu"]) == 2 and len(held["cpu"]) == 1
    cache_prompt(m, block(4))  # block(2) -> host; block(1) leaves the host tier
    replay()
    assert len(held["gpu"]) == 2 and len(held["cpu"]) == 1
    assert m.lookup("t", [*block(1), 9]) == 0
    m.create_sequence("t", [*block(2), 9])  # restores block(2): cpu -> gpu
    replay()
    # block(2) takes block(3)'s GPU block; the only host block is the one being restored,
    # so block(3) finds no room there and is gone.
    assert held["cpu"] == set() and len(held["gpu"]) == 2
    assert [m.lookup("t", [*block(i), 9]) for i in (1, 2, 3, 4)] == [0, BS, 0, BS]
    m.lose_worker("w0")
    replay()
    assert held == {"gpu": set(), "cpu": set()}
