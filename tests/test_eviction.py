"""The eviction-policy seam (cache_service/control/eviction.py): LRU order, reuse, undo, a custom
policy plugged in by name, and clear errors for unknown names."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import pytest

from cache_service.config import ConfigError, CoordinatorConfig, load_config
from cache_service.control.block_manager import BlockManager, BlockManagerConfig, PoolExhausted
from cache_service.control.block_pool import BlockPool
from cache_service.control.eviction import EVICTION_POLICIES, LRUPolicy, make_policy
from cache_service.engine.recovery import DurableBlockManager, RecoveryError, recover
from cache_service.engine.store import MetadataStore, StoreConfig
from cache_service.errors import InvalidRequest

BS = 4


class MostRecentFirst:
    """A test policy: the block released last is evicted first (the opposite of LRU)."""

    def __init__(self) -> None:
        self.stack: OrderedDict[int, None] = OrderedDict()
        self.victims: list[int] = []

    def __len__(self) -> int:
        return len(self.stack)

    def __contains__(self, index: object) -> bool:
        return index in self.stack

    def on_cached_free(self, index: int) -> None:
        self.stack[index] = None

    def on_reused(self, index: int) -> None:
        del self.stack[index]

    def pop_victim(self) -> int | None:
        if not self.stack:
            return None
        index = self.stack.popitem()[0]
        self.victims.append(index)
        return index

    def put_back(self, index: int) -> None:
        self.stack[index] = None

    def order(self) -> list[int]:
        return list(self.stack)


def manager(policy: str = "lru", blocks: int = 4) -> BlockManager:
    m = BlockManager(BlockManagerConfig(BS, 1, "fp", eviction_policy=policy))
    m.add_worker("w0", blocks)
    return m


def cache_prompt(m: BlockManager, tokens: list[int]) -> None:
    """Compute a one-block prompt, publish it and free it: its block stays cached-free."""
    seq_id = m.create_sequence("t").seq_id
    m.prepare_write("t", seq_id, None, tokens)
    m.commit_write("t", seq_id, None, len(tokens))
    m.free("t", seq_id)


def cached(m: BlockManager, prompts: list[list[int]]) -> list[bool]:
    return [m.lookup("t", [*p, 0]) == BS for p in prompts]


def test_lru_evicts_least_recently_released_first_and_reuse_takes_a_block_out() -> None:
    policy = LRUPolicy()
    for index in (3, 1, 2):
        policy.on_cached_free(index)
    assert policy.order() == [3, 1, 2] and len(policy) == 3
    policy.on_reused(1)
    assert 1 not in policy and policy.order() == [3, 2]
    with pytest.raises(KeyError):
        policy.on_reused(1)
    policy.on_cached_free(1)  # released again: now the most recent
    assert [policy.pop_victim() for _ in range(4)] == [3, 2, 1, None]


def test_put_back_in_reverse_restores_the_order() -> None:
    policy = LRUPolicy()
    for index in (5, 6, 7):
        policy.on_cached_free(index)
    first, second = policy.pop_victim(), policy.pop_victim()
    policy.put_back(second)
    policy.put_back(first)
    assert policy.order() == [5, 6, 7]


def test_order_rebuilds_the_policy() -> None:
    policy = make_policy("lru")
    for index in (4, 0, 9):
        policy.on_cached_free(index)
    policy.on_reused(0)
    copy = make_policy("lru")
    for index in policy.order():
        copy.on_cached_free(index)
    assert [copy.pop_victim() for _ in range(2)] == [policy.pop_victim() for _ in range(2)]


def test_a_reused_block_is_not_evicted_by_the_manager() -> None:
    m = manager("lru", blocks=3)
    prompts = [[10 * i + j for j in range(BS)] for i in range(3)]
    for p in prompts:
        cache_prompt(m, p)
    # A prefix hit on the oldest moves it out of the candidates; freed again, it is newest.
    m.free("t", m.create_sequence("t", [*prompts[0], 0]).seq_id)
    assert m.evict(max_blocks=1) == 1
    assert cached(m, prompts) == [True, False, True]
    m.check_integrity()


def test_a_custom_policy_plugged_in_by_name_chooses_the_victims(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: list[MostRecentFirst] = []

    def factory() -> MostRecentFirst:
        made.append(MostRecentFirst())
        return made[-1]

    monkeypatch.setitem(EVICTION_POLICIES, "mru-test", factory)
    m = manager("mru-test", blocks=3)
    prompts = [[10 * i + j for j in range(BS)] for i in range(3)]
    for p in prompts:
        cache_prompt(m, p)
    # A new block must evict: the policy picks the most recently released (block 2).
    seq_id = m.create_sequence("t").seq_id
    plan = m.prepare_write("t", seq_id, None, [99] * BS)
    assert plan.slots[0] == ("w0", 2 * BS)
    assert made[0].victims == [2]
    assert cached(m, prompts) == [True, True, False]
    m.check_integrity()

    # A failed batch puts its victims back where the policy had them: the first write
    # evicts block 1, the second finds too few blocks.
    first, second = m.create_sequence("t").seq_id, m.create_sequence("t").seq_id
    before = m.to_records()
    with pytest.raises(PoolExhausted, match="write 2 of 2"):
        m.prepare_writes("t", None, [(first, [1] * BS), (second, [2] * (2 * BS))])
    assert made[0].victims == [2, 1]
    assert m.to_records() == before and made[0].order() == [0, 1]

    # Snapshots name the policy and rebuild it with its order.
    copy = BlockManager.from_records(m.to_records())
    assert copy.config.eviction_policy == "mru-test"
    assert made[-1] is not made[0] and made[-1].order() == made[0].order() == [0, 1]


def test_a_pool_rejects_a_policy_that_is_not_empty() -> None:
    policy = LRUPolicy()
    policy.on_cached_free(0)
    with pytest.raises(InvalidRequest, match="empty policy"):
        BlockPool("w", 2, policy)


def test_unknown_policy_names_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match="eviction_policy: unknown eviction policy 'fifo'; known: lru"
    ):
        BlockManagerConfig(BS, 1, "fp", eviction_policy="fifo")
    with pytest.raises(ConfigError, match=r"coordinator\.eviction_policy: unknown"):
        CoordinatorConfig(eviction_policy="fifo")
    path = tmp_path / "c.yaml"
    path.write_text("coordinator: {eviction_policy: fifo}\n")
    with pytest.raises(ConfigError, match=r"coordinator\.eviction_policy: unknown eviction policy"):
        load_config(path)
    path.write_text("coordinator: {eviction_policy: lru}\n")
    assert load_config(path).coordinator.eviction_policy == "lru"
    records = manager().to_records()
    records["config"]["eviction_policy"] = "fifo"
    with pytest.raises(InvalidRequest, match="unknown eviction policy 'fifo'"):
        BlockManager.from_records(records)


def test_a_store_reopens_only_with_the_policy_it_was_written_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(EVICTION_POLICIES, "mru-test", MostRecentFirst)

    def open_store() -> MetadataStore:
        store = MetadataStore(StoreConfig(str(tmp_path / "m.db")))
        store.begin_generation()
        return store

    store = open_store()
    durable = DurableBlockManager(BlockManager(BlockManagerConfig(BS, 1, "fp")), store)
    durable.add_worker("w0", 4)
    store.close()
    store = open_store()
    with pytest.raises(RecoveryError, match="eviction_policy='lru'"):
        recover(store, BlockManagerConfig(BS, 1, "fp", eviction_policy="mru-test"))
    assert recover(store, BlockManagerConfig(BS, 1, "fp")).manager.workers() == {"w0": 4}
    store.close()


def test_the_coordinator_builds_its_manager_with_the_configured_policy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from cache_service.config import LayoutConfig
    from cache_service.engine.coordinator import Coordinator

    monkeypatch.setitem(EVICTION_POLICIES, "mru-test", MostRecentFirst)
    config = CoordinatorConfig(eviction_policy="mru-test")
    coordinator = Coordinator(LayoutConfig().kv_layout(), [], config)
    assert coordinator.block_manager.config.eviction_policy == "mru-test"
