"""Unit tests of the control-plane facade (cache_service/control/block_manager.py), rule by rule."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from cache_service import prefix_keys
from cache_service.control.block_manager import (
    BlockCopy,
    BlockManager,
    BlockManagerConfig,
    CacheError,
    InvalidRequest,
    LayerNotWritten,
    PoolExhausted,
    QuotaExceeded,
    Segment,
    SeqRef,
    SequenceLost,
    SequenceNotFound,
)
from cache_service.errors import IntegrityError

BS = 4
LAYERS = 2


def make(workers: dict[str, int] | None = None, **config: Any) -> BlockManager:
    cfg = BlockManagerConfig(block_size=BS, num_layers=LAYERS, layout_fingerprint="fp", **config)
    m = BlockManager(cfg)
    for worker_id, size in ({"w0": 8} if workers is None else workers).items():
        m.add_worker(worker_id, size)
    return m


def fill(m: BlockManager, tenant: str, seq_id: str, tokens: list[int]) -> list[tuple[str, int]]:
    """Write tokens on every layer and commit them; returns the slots."""
    plan = m.prepare_write(tenant, seq_id, None, tokens)
    m.commit_write(tenant, seq_id, None, len(tokens))
    return plan.slots


def new_seq(m: BlockManager, tenant: str, prompt: list[int]) -> tuple[str, int]:
    """Create a sequence for prompt, compute the uncached rest; returns (id, cached)."""
    created = m.create_sequence(tenant, prompt)
    fill(m, tenant, created.seq_id, prompt[created.num_cached_tokens :])
    return created.seq_id, created.num_cached_tokens


def unchanged(m: BlockManager, call: Callable[[], object], error: type[CacheError]) -> str:
    """Run a call that must fail with `error` and leave the state untouched."""
    before = m.to_records()
    with pytest.raises(error) as info:
        call()
    assert m.to_records() == before
    m.check_integrity()
    return str(info.value)


# ---- writes, slots, layers --------------------------------------------------------------


def test_write_reserves_one_block_at_a_time_and_maps_slots() -> None:
    m = make()
    seq = m.create_sequence("t").seq_id
    plan = m.prepare_write("t", seq, None, [10, 11, 12, 13, 14])
    assert plan.start == 0 and plan.copies == []
    assert plan.slots == [("w0", 0), ("w0", 1), ("w0", 2), ("w0", 3), ("w0", 4)]
    assert m.stats().workers["w0"].used == 2
    m.commit_write("t", seq, None, 5)
    plan = m.prepare_write("t", seq, None, [15])
    assert (plan.start, plan.slots) == (5, [("w0", 5)])
    m.commit_write("t", seq, None, 1)
    view = m.attention_view("t", seq, 1)
    assert view.seq_len == 6
    assert view.segments == (Segment("w0", 0, (0, 1)),)
    m.check_integrity()


def test_layer_by_layer_writes_reuse_reserved_slots() -> None:
    m = make()
    seq = m.create_sequence("t").seq_id
    first = m.prepare_write("t", seq, 0, [1, 2, 3])
    m.commit_write("t", seq, 0, 3)
    with pytest.raises(LayerNotWritten, match="layer 1"):
        m.attention_view("t", seq, 1)
    assert m.attention_view("t", seq, 0).seq_len == 3
    # Layer 1 covers the same positions: same slots, nothing new reserved.
    second = m.prepare_write("t", seq, 1, [1, 2, 3, 4])
    assert second.slots[:3] == first.slots and second.slots[3] == ("w0", 3)
    assert m.sequence_info("t", seq).token_ids == (1, 2, 3, 4)
    m.commit_write("t", seq, 1, 4)
    assert m.sequence_info("t", seq).written == (3, 4)
    msg = unchanged(m, lambda: m.prepare_write("t", seq, 0, [9]), InvalidRequest)
    assert "position 3 is reserved for token 4, got 9" in msg
    unchanged(m, lambda: m.prepare_write("t", seq, None, [4]), InvalidRequest)
    unchanged(m, lambda: m.commit_write("t", seq, 0, 2), InvalidRequest)
    unchanged(m, lambda: m.commit_write("t", seq, None, 0), InvalidRequest)


@pytest.mark.parametrize(
    ("layer", "tokens", "match"),
    [
        (2, [1], "layer must be"),
        (-1, [1], "layer must be"),
        (True, [1], "layer must be"),
        ("0", [1], "layer must be"),
        (0, [], "empty"),
        (0, [-1], "token ids"),
        (0, "ab", "token ids"),
        (0, [1.0], "token ids"),
    ],
)
def test_bad_write_arguments_are_rejected(layer: Any, tokens: Any, match: str) -> None:
    m = make()
    seq = m.create_sequence("t").seq_id
    msg = unchanged(m, lambda: m.prepare_write("t", seq, layer, tokens), InvalidRequest)
    assert match in msg


def test_commit_rejects_bad_counts() -> None:
    m = make()
    seq = m.create_sequence("t").seq_id
    m.prepare_write("t", seq, None, [1, 2])
    for bad in (-1, 1.0, None):
        unchanged(m, lambda bad=bad: m.commit_write("t", seq, 0, bad), InvalidRequest)
    msg = unchanged(m, lambda: m.commit_write("t", seq, 1, 3), InvalidRequest)
    assert "passes the 2 reserved tokens" in msg
    m.commit_write("t", seq, 0, 0)  # a no-op is fine
    with pytest.raises(InvalidRequest, match="one layer"):
        m.attention_view("t", seq, None)  # type: ignore[arg-type]


# ---- prefix cache -----------------------------------------------------------------------


def test_only_full_blocks_written_on_every_layer_are_published() -> None:
    m = make()
    seq = m.create_sequence("t").seq_id
    m.prepare_write("t", seq, 0, list(range(9)))
    m.commit_write("t", seq, 0, 9)
    assert m.lookup("t", list(range(12))) == 0
    m.prepare_write("t", seq, 1, list(range(5)))
    m.commit_write("t", seq, 1, 5)
    assert m.lookup("t", list(range(12))) == 4
    m.prepare_write("t", seq, 1, list(range(5, 9)))
    m.commit_write("t", seq, 1, 4)
    assert m.lookup("t", list(range(12))) == 8


@pytest.mark.parametrize(("prompt_len", "reused"), [(1, 0), (4, 0), (5, 4), (8, 4), (9, 8)])
def test_reuse_leaves_at_least_the_last_prompt_token(prompt_len: int, reused: int) -> None:
    m = make()
    new_seq(m, "t", list(range(12)))
    prompt = list(range(prompt_len))
    assert m.lookup("t", prompt) == reused
    created = m.create_sequence("t", prompt)
    assert created.num_cached_tokens == reused
    info = m.sequence_info("t", created.seq_id)
    assert info.token_ids == tuple(prompt[:reused]) and info.written == (reused, reused)


def test_prefix_hit_shares_blocks_and_counts_tokens() -> None:
    m = make()
    a, _ = new_seq(m, "t", list(range(10)))
    b, cached = new_seq(m, "t", [*range(8), 77, 78])
    assert cached == 8
    assert m.attention_view("t", b, 0).segments == (Segment("w0", 0, (0, 1, 3)),)
    stats = m.stats()
    assert stats.prefix_query_tokens == {"t": 20} and stats.prefix_hit_tokens == {"t": 8}
    assert stats.workers["w0"].used == 4  # two shared + one tail each
    assert m.lookup("t", list(range(12))) == 8  # lookup counts nothing
    assert m.stats().prefix_query_tokens == {"t": 20}
    m.free("t", a)
    m.free("t", b)
    assert m.stats().workers["w0"].cached_free == 2  # the partial tails are simply free
    m.check_integrity()


def test_hash_collisions_never_share_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    import hashlib

    constant = hashlib.sha256(b"everything collides")
    monkeypatch.setattr(prefix_keys, "_sha256", lambda data: constant)
    m = make()
    new_seq(m, "t", [1, 2, 3, 4, 5])
    assert m.lookup("t", [9, 9, 9, 9, 9]) == 0
    assert m.create_sequence("t", [9, 9, 9, 9, 9]).num_cached_tokens == 0
    assert m.lookup("t", [1, 2, 3, 4, 5]) == 4


def test_tenants_share_only_what_is_published_public() -> None:
    m = make({"w0": 16})
    system = list(range(8))
    a, _ = new_seq(m, "a", [*system, 100])
    assert m.lookup("b", [*system, 1]) == 0
    assert m.publish_public("a", a) == 2
    assert m.publish_public("a", a) == 0
    assert m.lookup("b", [*system, 1]) == 8
    # b continues the public prefix privately; c sees the public part only.
    b, cached = new_seq(m, "b", [*system, 200, 201, 202, 203, 204])
    assert cached == 8
    assert m.lookup("b", [*system, 200, 201, 202, 203, 0]) == 12
    assert m.lookup("c", [*system, 200, 201, 202, 203, 0]) == 8
    assert m.lookup("a", [*system, 200, 201, 202, 203, 0]) == 8
    # The public blocks are shared physically across tenants.
    seg_a = m.attention_view("a", a, 0).segments[0].block_indices[:2]
    seg_b = m.attention_view("b", b, 0).segments[0].block_indices[:2]
    assert seg_a == seg_b
    m.check_integrity()


def test_layout_fingerprint_separates_caches() -> None:
    m1 = make()
    new_seq(m1, "t", list(range(9)))
    records = m1.to_records()
    records["config"]["layout_fingerprint"] = "other"
    # A snapshot whose keys were made under another layout does not pass as consistent.
    with pytest.raises(InvalidRequest, match="key is not the hash"):
        BlockManager.from_records(records)


# ---- cached-free blocks, eviction, pins -------------------------------------------------


def test_eviction_is_lru_tail_first_and_never_of_referenced_blocks() -> None:
    m = make({"w0": 6})
    a, _ = new_seq(m, "t", [*range(8), 1])  # blocks 0, 1 full; 2 partial
    b, _ = new_seq(m, "t", [*range(10, 18), 1])  # blocks 3, 4 full; 5 partial
    m.free("t", a)
    m.free("t", b)
    stats = m.stats().workers["w0"]
    assert (stats.cached_free, stats.free) == (4, 2)
    c = m.create_sequence("t").seq_id
    # 2 free blocks first, then a's tail (1), a's head (0), then b's tail (4).
    fill(m, "t", c, list(range(100, 112)))
    assert m.stats().evictions == 1
    assert m.lookup("t", [*range(8), 1]) == 4  # a's head survives
    fill(m, "t", c, list(range(112, 116)))
    assert m.lookup("t", [*range(8), 1]) == 0
    assert m.lookup("t", [*range(10, 18), 1]) == 8  # b untouched so far
    fill(m, "t", c, list(range(116, 120)))
    assert m.lookup("t", [*range(10, 18), 1]) == 4
    assert m.stats().evictions == 3
    # Blocks in use are never evicted: c holds all of them but b's head, which d adopts.
    assert m.create_sequence("t", [*range(10, 14), 1]).num_cached_tokens == 4
    msg = unchanged(m, lambda: fill(m, "t", c, list(range(120, 124))), PoolExhausted)
    assert "need 1 more blocks; 0 free or evictable" in msg
    m.check_integrity()


def test_lengths_past_what_a_sequence_can_hold_are_refused_before_counting() -> None:
    """Every block of every worker is the longest sequence: a prompt, lookup, pin or write
    past it is InvalidRequest naming both lengths, and nothing is counted or reserved."""
    m = make({"w0": 3, "w1": 2})
    cap = 5 * BS
    seq, _ = new_seq(m, "t", list(range(BS + 1)))
    over = list(range(cap + 1))
    for call in (
        lambda: m.create_sequence("t", over),
        lambda: m.lookup("t", over),
        lambda: m.pin("t", over),
        lambda: m.prepare_write("t", seq, None, over),
        lambda: m.prepare_write("t", seq, 0, list(range(cap - BS))),  # ends at cap + 1
    ):
        msg = unchanged(m, call, InvalidRequest)
        assert str(cap + 1) in msg and f"{cap} tokens" in msg, msg
    assert m.stats().prefix_query_tokens == {"t": BS + 1}
    assert m.lookup("t", list(range(cap))) == BS  # the capacity itself is a valid length


def test_pins_keep_a_prefix_from_eviction() -> None:
    m = make({"w0": 3})
    system = list(range(8))
    a, _ = new_seq(m, "t", [*system, 1])
    assert m.pin("t", system) == 8
    assert m.pin("t", system) == 8  # pins nest
    m.free("t", a)
    stats = m.stats()
    assert stats.pinned_blocks == 2 and stats.workers["w0"].used == 2
    b = m.create_sequence("t").seq_id
    fill(m, "t", b, [5])
    unchanged(m, lambda: fill(m, "t", b, [6, 7, 8, 9]), PoolExhausted)
    m.unpin("t", system)
    unchanged(m, lambda: fill(m, "t", b, [6, 7, 8, 9]), PoolExhausted)
    m.unpin("t", system)
    assert m.stats().pinned_blocks == 0
    fill(m, "t", b, [6, 7, 8, 9])  # now the prefix's tail block is evicted
    assert m.lookup("t", [*system, 1]) == 4
    msg = unchanged(m, lambda: m.unpin("t", system), InvalidRequest)
    assert "holds no pin" in msg
    assert m.pin("u", system) == 0  # another tenant cannot pin t's blocks
    assert m.pin("t", [1, 2, 3]) == 0  # nothing to pin: nothing recorded
    unchanged(m, lambda: m.unpin("t", [1, 2, 3]), InvalidRequest)


def test_explicit_evict_drops_cached_blocks_in_lru_order() -> None:
    m = make({"w0": 8, "w1": 8})
    a, _ = new_seq(m, "t", [*range(12), 1])
    m.free("t", a)
    assert m.evict(max_blocks=1) == 1
    assert m.lookup("t", [*range(12), 1]) == 8
    assert m.evict(worker_id="w1") == 0
    assert m.evict() == 2
    assert m.lookup("t", [*range(12), 1]) == 0
    assert m.stats().evictions == 3
    unchanged(m, lambda: m.evict(max_blocks=-1), InvalidRequest)
    unchanged(m, lambda: m.evict(worker_id="nope"), InvalidRequest)


# ---- fork and copy-on-write --------------------------------------------------------------


def test_fork_shares_blocks_and_copies_a_shared_partial_block_on_write() -> None:
    m = make()
    a = m.create_sequence("t").seq_id
    fill(m, "t", a, [1, 2, 3, 4, 5, 6])
    b = m.fork("t", a)
    assert m.sequence_info("t", b).token_ids == (1, 2, 3, 4, 5, 6)
    assert m.stats().workers["w0"].used == 2
    plan = m.prepare_write("t", b, None, [70])
    assert plan.copies == [BlockCopy("w0", 1, 2)]
    assert plan.slots == [("w0", 2 * BS + 2)]
    m.commit_write("t", b, None, 1)
    assert m.attention_view("t", b, 0).segments == (Segment("w0", 0, (0, 2)),)
    assert m.attention_view("t", a, 0).segments == (Segment("w0", 0, (0, 1)),)
    # a now owns block 1 alone: no copy.
    plan = m.prepare_write("t", a, None, [60])
    assert plan.copies == [] and plan.slots == [("w0", 1 * BS + 2)]
    assert m.stats().cow_copies == 1
    m.check_integrity()


def test_fork_at_a_block_boundary_needs_no_copy() -> None:
    m = make()
    a = m.create_sequence("t").seq_id
    fill(m, "t", a, [1, 2, 3, 4])
    b = m.fork("t", a)
    plan = m.prepare_write("t", b, None, [5])
    assert plan.copies == [] and plan.slots == [("w0", BS)]
    assert m.stats().cow_copies == 0


def test_copy_on_write_needs_room_on_the_source_worker() -> None:
    m = make({"w0": 2, "w1": 1})
    a = m.create_sequence("t").seq_id
    fill(m, "t", a, [1, 2, 3, 4, 5])  # both blocks of w0
    b = m.fork("t", a)
    msg = unchanged(m, lambda: m.prepare_write("t", b, None, [6]), PoolExhausted)
    assert "copy-on-write" in msg and "'w0'" in msg


# ---- placement ---------------------------------------------------------------------------


def test_placement_prefers_the_prefix_worker_then_most_room() -> None:
    m = make({"w0": 8, "w1": 10})
    a = m.create_sequence("t").seq_id
    assert fill(m, "t", a, [1])[0][0] == "w1"  # most room
    b = m.create_sequence("t").seq_id
    assert fill(m, "t", b, [1])[0][0] == "w1"  # 9 vs 8
    c = m.create_sequence("t").seq_id
    assert fill(m, "t", c, [1])[0][0] == "w0"  # 8 vs 8: first added wins the tie
    fill(m, "t", c, [2, 3, 4, 5])
    m.commit_write("t", c, None, 0)
    # A prompt cached on w0 goes to w0 even though w1 has more room.
    d, cached = new_seq(m, "t", [1, 2, 3, 4, 9, 9])
    assert cached == 4
    assert {s.worker_id for s in m.attention_view("t", d, 0).segments} == {"w0"}


def test_prefix_worker_without_room_sends_the_rest_elsewhere() -> None:
    m = make({"w0": 3, "w1": 8})
    a, _ = new_seq(m, "t", [*range(8), 1])
    assert {s.worker_id for s in m.attention_view("t", a, 0).segments} == {"w1"}
    m2 = make({"w0": 3, "w1": 2})
    a, _ = new_seq(m2, "t", [*range(8), 1])  # w0 is full now: blocks 0, 1, 2
    b, cached = new_seq(m2, "t", [*range(8), 5, 6, 7, 8, 9])  # rest needs 2 blocks
    assert cached == 8
    view = m2.attention_view("t", b, 0)
    assert view.segments == (Segment("w0", 0, (0, 1)), Segment("w1", 8, (0, 1)))


def test_growth_spills_to_the_worker_with_most_room() -> None:
    m = make({"w0": 2, "w1": 3, "w2": 1})
    seq = m.create_sequence("t").seq_id
    slots = fill(m, "t", seq, list(range(20)))
    assert [w for w, _ in slots[::BS]] == ["w1", "w1", "w1", "w0", "w0"]
    view = m.attention_view("t", seq, 0)
    assert view.seq_len == 20
    assert view.segments == (Segment("w1", 0, (0, 1, 2)), Segment("w0", 12, (0, 1)))
    # Growth continues on the worker it spilled to, then on the last one with room.
    assert fill(m, "t", seq, [1])[0][0] == "w2"
    # It holds every block now: growing past them is a length no sequence can reach.
    unchanged(m, lambda: fill(m, "t", seq, [0] * 4), InvalidRequest)


def test_exhaustion_is_all_or_nothing() -> None:
    m = make({"w0": 2, "w1": 2})
    other = m.create_sequence("t").seq_id
    fill(m, "t", other, [7])
    seq = m.create_sequence("t").seq_id
    fill(m, "t", seq, [1])
    msg = unchanged(m, lambda: m.prepare_write("t", seq, None, list(range(1, 13))), PoolExhausted)
    assert "need 3 more blocks; 2 free or evictable across 2 workers" in msg
    m.free("t", other)
    fill(m, "t", seq, list(range(12)))  # 13 tokens, 4 blocks: exactly fits


def test_create_without_workers_is_refused() -> None:
    m = make({})
    unchanged(m, lambda: m.create_sequence("t"), PoolExhausted)


# ---- quotas ------------------------------------------------------------------------------


def test_block_quota_counts_distinct_blocks_per_tenant() -> None:
    m = make({"w0": 16}, tenant_quota_blocks=3)
    a = m.create_sequence("t").seq_id
    fill(m, "t", a, list(range(8)))
    b = m.fork("t", a)  # shares both blocks: still 2
    fill(m, "t", b, [9])  # 3
    msg = unchanged(m, lambda: fill(m, "t", a, [9]), QuotaExceeded)
    assert "holds 3 blocks; 1 more would pass its quota of 3" in msg
    # Another tenant has its own allowance.
    u = m.create_sequence("u").seq_id
    fill(m, "u", u, list(range(12)))
    unchanged(m, lambda: fill(m, "u", u, [1]), QuotaExceeded)
    m.free("t", b)
    fill(m, "t", a, [9])
    # Adopting cached blocks counts too.
    m.publish_public("u", u)
    v = m.create_sequence("v").seq_id
    fill(m, "v", v, [5])
    msg = unchanged(m, lambda: m.create_sequence("v", [*range(12), 1]), QuotaExceeded)
    assert "holds 1 blocks; 3 more" in msg
    assert m.create_sequence("v", [*range(8), 1]).num_cached_tokens == 8


def test_sequence_quota() -> None:
    m = make(tenant_quota_sequences=2)
    a = m.create_sequence("t").seq_id
    m.fork("t", a)
    unchanged(m, lambda: m.create_sequence("t"), QuotaExceeded)
    unchanged(m, lambda: m.fork("t", a), QuotaExceeded)
    m.create_sequence("u")
    m.free("t", a)
    m.create_sequence("t")


@pytest.mark.parametrize(
    "config",
    [
        {"block_size": 0},
        {"num_layers": -1},
        {"layout_fingerprint": ""},
        {"tenant_quota_blocks": 0},
        {"tenant_quota_sequences": 1.5},
    ],
)
def test_bad_config_is_rejected(config: dict[str, Any]) -> None:
    args: dict[str, Any] = {"block_size": 4, "num_layers": 1, "layout_fingerprint": "fp"}
    with pytest.raises(ValueError, match=next(iter(config))):
        BlockManagerConfig(**{**args, **config})


# ---- ids and tenants ----------------------------------------------------------------------


def test_ids_are_random_and_tenant_scoped() -> None:
    m = make()
    ids = {m.create_sequence("t").seq_id for _ in range(50)}
    assert len(ids) == 50 and all(len(i) >= 20 for i in ids)
    seq = next(iter(ids))
    with pytest.raises(SequenceNotFound) as wrong:
        m.attention_view("u", seq, 0)
    with pytest.raises(SequenceNotFound) as unknown:
        m.attention_view("u", "no-such-id", 0)
    assert str(wrong.value) == str(unknown.value).replace("no-such-id", seq)
    for call in (
        lambda: m.fork("u", seq),
        lambda: m.free("u", seq),
        lambda: m.prepare_write("u", seq, None, [1]),
        lambda: m.commit_write("u", seq, None, 0),
        lambda: m.publish_public("u", seq),
        lambda: m.sequence_info("u", seq),
        lambda: m.free("t", 42),  # type: ignore[arg-type]
    ):
        unchanged(m, call, SequenceNotFound)


def test_replayed_ids_are_used_and_checked() -> None:
    m = make()
    assert m.create_sequence("t", seq_id="s1").seq_id == "s1"
    assert m.fork("t", "s1", new_seq_id="s2") == "s2"
    unchanged(m, lambda: m.create_sequence("t", seq_id="s2"), InvalidRequest)
    unchanged(m, lambda: m.create_sequence("t", seq_id=""), InvalidRequest)
    unchanged(m, lambda: m.create_sequence(""), InvalidRequest)
    unchanged(m, lambda: m.create_sequence(None), InvalidRequest)  # type: ignore[arg-type]


# ---- lost workers -------------------------------------------------------------------------


def test_lost_worker_fails_its_sequences_and_keeps_the_rest() -> None:
    m = make({"w0": 2, "w1": 8})
    spanning = m.create_sequence("t").seq_id
    fill(m, "t", spanning, list(range(40)))  # w1 (8 blocks) then w0 (2 blocks)
    assert len(m.attention_view("t", spanning, 0).segments) == 2
    m.add_worker("w2", 4)
    other = m.create_sequence("u").seq_id
    fill(m, "u", other, [*range(8), 1])  # w2
    m.free("t", m.create_sequence("t").seq_id)
    assert m.lose_worker("w0") == [SeqRef("t", spanning)]
    stats = m.stats()
    assert set(stats.workers) == {"w1", "w2"}
    assert stats.workers["w1"].used == 0  # the survivor blocks were released
    assert stats.workers["w1"].cached_free == 8  # and stay findable
    assert stats.lost_sequences == 1 and stats.active_sequences == 1
    with pytest.raises(SequenceLost, match="worker 'w0'"):
        m.attention_view("t", spanning, 0)
    for call in (
        lambda: m.prepare_write("t", spanning, None, [1]),
        lambda: m.fork("t", spanning),
        lambda: m.commit_write("t", spanning, None, 0),
    ):
        unchanged(m, call, SequenceLost)
    unchanged(m, lambda: m.attention_view("u", spanning, 0), SequenceNotFound)
    m.free("t", spanning)
    unchanged(m, lambda: m.attention_view("t", spanning, 0), SequenceNotFound)
    assert m.attention_view("u", other, 0).seq_len == 9
    m.add_worker("w0", 3)  # a restarted worker comes back empty
    assert m.stats().workers["w0"].free == 3
    unchanged(m, lambda: m.lose_worker("nope"), InvalidRequest)
    unchanged(m, lambda: m.add_worker("w0", 3), InvalidRequest)
    m.check_integrity()


def test_lost_worker_drops_index_entries_and_pins() -> None:
    m = make({"w0": 4, "w1": 4})
    a, _ = new_seq(m, "t", [*range(8), 1])
    w = m.attention_view("t", a, 0).segments[0].worker_id
    m.pin("t", list(range(8)))
    m.free("t", a)
    assert m.lookup("t", [*range(8), 1]) == 8
    m.lose_worker(w)
    assert m.lookup("t", [*range(8), 1]) == 0
    assert m.stats().pinned_blocks == 0
    unchanged(m, lambda: m.unpin("t", list(range(8))), InvalidRequest)
    m.check_integrity()


def test_sequence_homed_on_a_lost_worker_is_replaced() -> None:
    m = make({"w0": 4, "w1": 2})
    seq = m.create_sequence("t").seq_id  # home w0, no blocks yet
    assert m.lose_worker("w0") == []
    assert fill(m, "t", seq, [1])[0][0] == "w1"


# ---- accounting ----------------------------------------------------------------------------


def test_fragmentation_counts_each_physical_block_once() -> None:
    m = make({"w0": 8})
    a = m.create_sequence("t").seq_id
    fill(m, "t", a, [1, 2, 3, 4, 5])  # one full, one with 1 slot
    m.fork("t", a)  # shares both: still 8 allocated, 5 filled
    ws = m.stats().workers["w0"]
    assert (ws.allocated_slots, ws.filled_slots) == (8, 5)
    # Reserved but not yet written slots count as filled (the reservation is the use).
    m.prepare_write("t", a, 0, [6])  # copy-on-write: a gets its own block
    stats = m.stats()
    ws = stats.workers["w0"]
    assert (ws.used, ws.allocated_slots, ws.filled_slots) == (3, 12, 7)
    assert stats.fragmentation == pytest.approx(5 / 12)
    assert stats.utilization == pytest.approx(3 / 8)
    assert ws.total == ws.used + ws.cached_free + ws.free


# ---- integrity and snapshots ---------------------------------------------------------------


def busy_manager() -> BlockManager:
    m = make({"w0": 6, "w1": 6})
    a, _ = new_seq(m, "a", [*range(8), 1, 2])
    m.publish_public("a", a)
    b, _ = new_seq(m, "b", [*range(8), 3])
    f = m.fork("b", b)
    m.prepare_write("b", f, None, [4, 5])
    m.pin("a", list(range(8)))
    c, _ = new_seq(m, "a", [*range(20, 32), 1])
    m.free("a", c)
    m.create_sequence("c")
    lost = m.create_sequence("c").seq_id
    fill(m, "c", lost, list(range(26)))  # spans both workers
    assert len(m.attention_view("c", lost, 0).segments) == 2
    assert m.lose_worker(m.attention_view("c", lost, 0).segments[0].worker_id) == [
        SeqRef("c", lost)
    ]
    m.add_worker("w9", 3)
    return m


def test_records_round_trip_through_json_and_replay_identically() -> None:
    m = busy_manager()
    m.check_integrity()
    records = m.to_records()
    restored = BlockManager.from_records(json.loads(json.dumps(records)))
    assert restored.to_records() == records
    assert restored.stats() == m.stats()
    # The same calls give the same blocks and slots on both.
    for manager in (m, restored):
        seq = manager.create_sequence("z", list(range(12)), seq_id="replayed")
        manager.prepare_write("z", seq.seq_id, None, list(range(seq.num_cached_tokens, 20)))
    assert restored.to_records() == m.to_records()


def test_inconsistent_records_are_refused() -> None:
    records = busy_manager().to_records()
    broken = json.loads(json.dumps(records))
    seq = broken["sequences"][0]
    broken["workers"][0]["free"].append(seq["table"][0][1])
    with pytest.raises(InvalidRequest, match="do not partition"):
        BlockManager.from_records(broken)
    broken = json.loads(json.dumps(records))
    broken["sequences"][0]["tokens"][0] += 1
    with pytest.raises(InvalidRequest, match="inconsistent"):
        BlockManager.from_records(broken)
    for bad in ({}, {"version": 99}, {**records, "workers": None}):
        with pytest.raises(InvalidRequest):
            BlockManager.from_records(bad)  # type: ignore[arg-type]


def test_check_integrity_reports_what_disagrees() -> None:
    m = busy_manager()
    seq = next(iter(m._seqs.values()))
    block = seq.table[0]
    m._pools[block.worker_id]._refcount[block.index] += 1
    with pytest.raises(IntegrityError, match="reference counts: 1 bad") as info:
        m.check_integrity()
    assert f"{block.worker_id}:{block.index} count" in str(info.value)
    m._pools[block.worker_id]._refcount[block.index] -= 1
    m.check_integrity()
    # Two sequences claiming one slot for different tokens.
    a = next(s for s in m._seqs.values() if s.tokens[8:] == [1, 2])
    f = next(s for s in m._seqs.values() if s.tokens[8:] == [3, 4, 5])
    saved = f.table[-1]
    f.table[-1] = a.table[-1]
    with pytest.raises(IntegrityError, match="slot handed out twice: 1 bad") as info:
        m.check_integrity()
    assert "reference counts: 2 bad" in str(info.value)
    f.table[-1] = saved
    m.check_integrity()
