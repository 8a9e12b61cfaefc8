"""The host tier's bookkeeping: cached prefix blocks that left a GPU pool, kept in that
worker's host memory (workers.host_tier) instead of being dropped.

Eviction order across tiers (docs/architecture.md "Eviction order"):

1. an allocation takes a free GPU block first;
2. else the pool's eviction policy names a cached-free GPU block; its prefix keys move to a
   host block of the same worker (an `offload` move: GPU -> host) when that worker has a
   host tier: a free host block, else the host tier's own policy victim, whose keys are
   dropped;
3. with no host tier (size 0) the keys are dropped, as before.

The host tier of each worker orders its blocks with a policy of the same name as the GPU
pools (`coordinator.eviction_policy`, cache_service.control.eviction): the one seam
decides both tiers' victims.

A prefix match that reaches a host block (`PrefixIndex.match(..., host=...)`) restores it:
a GPU block of the same worker is taken (steps 1-2 above), a `restore` move (host -> GPU)
is queued, and the keys go back to the GPU index at the new block. The coordinator sends
the queued moves (`BlockManager.take_tier_moves`) before any later call on that worker
(cache_service.engine.block_releases), offloads before releases before restores, so a
block is read before it is poisoned or overwritten.

Invariants (`check_host_tier`): every host block is free or holds the keys of exactly one
evicted GPU block (one key, or two when it was also published for everyone); no key is
in both tiers; the counts agree. A host block is lost with its worker (`drop_worker`), and
a recovered coordinator drops the whole tier (`drop_all`): a logged offload may never have
run, so nothing restored could be trusted.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from cache_service.control.eviction import EvictionPolicy, make_policy
from cache_service.control.kv_events import MEDIUM_CPU
from cache_service.control.prefix_index import IndexEntry, decode_tokens, encode_tokens
from cache_service.control.types import PhysicalBlock
from cache_service.errors import InvalidRequest

if TYPE_CHECKING:
    from cache_service.control.block_manager import BlockManager

__all__ = [
    "HostBlock",
    "HostPool",
    "HostTier",
    "TierMove",
    "check_host_tier",
    "evict_block",
    "host_records",
    "restorable",
    "restore_blocks",
    "restore_host_records",
]


@dataclass(frozen=True, slots=True)
class HostBlock:
    """Block `index` of worker `worker_id`'s host tier. A dataclass, not a tuple, so it
    never compares equal to the `PhysicalBlock` with the same fields."""

    worker_id: str
    index: int


@dataclass(frozen=True, slots=True)
class TierMove:
    """One block copied between a worker's GPU pool and its host tier.

    Attributes:
        direction: "offload" (GPU block `block` -> host block `host`) or "restore"
            (host -> GPU).
        block: GPU pool block index.
        host: host tier block index.
    """

    direction: Literal["offload", "restore"]
    block: int
    host: int


class HostPool:
    """One worker's host blocks: a free list and, for the held ones, their keys in the
    eviction policy's order. O(1) per operation, like `BlockPool`."""

    __slots__ = ("_free", "_keys", "_policy", "num_blocks", "worker_id")

    def __init__(self, worker_id: str, num_blocks: int, policy: EvictionPolicy) -> None:
        """`num_blocks` free host blocks (0 .. num_blocks-1), held ones leaving in
        `policy`'s order (an empty policy)."""
        if type(num_blocks) is not int or num_blocks < 0:
            raise InvalidRequest(f"host_blocks must be an int >= 0, got {num_blocks!r}")
        self.worker_id = worker_id
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._keys: dict[int, list[bytes]] = {}
        self._policy = policy

    @property
    def num_used(self) -> int:
        """Host blocks holding keys."""
        return len(self._keys)

    @property
    def num_free(self) -> int:
        """Host blocks holding nothing."""
        return len(self._free)

    def keys_of(self, index: int) -> list[bytes]:
        """The keys host block `index` holds (empty if free)."""
        return list(self._keys.get(index, ()))

    def held(self) -> Iterator[tuple[int, list[bytes]]]:
        """(host index, keys) of every held block, in the policy's order (next victim
        first for LRU)."""
        for index in self._policy.order():
            yield index, self._keys[index]

    def free_order(self) -> list[int]:
        """The free list, next handed out last."""
        return list(self._free)

    def put(self, keys: list[bytes]) -> tuple[int, list[bytes]] | None:
        """Store a block's keys in a host block: a free one, else the policy's victim.

        Returns:
            (host index, the keys the victim held: dropped from the tier; empty if none);
            None when every host block is being restored (the keys are then dropped).
        """
        dropped: list[bytes] = []
        if self._free:
            index = self._free.pop()
        else:
            victim = self._policy.pop_victim()
            if victim is None:
                return None
            index = victim
            dropped = self._keys.pop(index)
        self._keys[index] = keys
        self._policy.on_cached_free(index)
        return index, dropped

    def take(self, index: int) -> list[bytes]:
        """Remove host block `index`'s keys (it is being restored). The block is not free
        yet: `release` it once the restore has been queued."""
        self._policy.on_reused(index)
        return self._keys.pop(index)

    def release(self, index: int) -> None:
        """Host block `index` (taken) holds nothing any more."""
        self._free.append(index)

    @classmethod
    def restore(
        cls,
        worker_id: str,
        num_blocks: int,
        free_order: list[int],
        held: list[tuple[int, list[bytes]]],
        policy: EvictionPolicy,
    ) -> HostPool:
        """Rebuild from `free_order()` and `held()`.

        Raises:
            InvalidRequest: they do not partition 0..num_blocks-1.
        """
        pool = cls(worker_id, num_blocks, policy)
        seen = sorted([*free_order, *(i for i, _ in held)])
        if seen != list(range(num_blocks)):
            raise InvalidRequest(
                f"worker {worker_id!r}: host free and held blocks do not partition "
                f"0..{num_blocks - 1}"
            )
        pool._free = list(free_order)
        for index, keys in held:
            pool._keys[index] = list(keys)
            policy.on_cached_free(index)
        return pool


class HostTier:
    """Every worker's `HostPool`, the host entries by key (what `PrefixIndex.match` reads
    as its `host` argument), and the moves not yet handed to the coordinator."""

    __slots__ = ("entries", "evictions", "moves", "policy_name", "pools")

    def __init__(self, policy_name: str) -> None:
        """No host tier yet; host pools order their blocks with policy `policy_name`."""
        self.policy_name = policy_name
        self.pools: dict[str, HostPool] = {}
        # key -> the entry as it was in the GPU index, its block a HostBlock.
        self.entries: dict[bytes, IndexEntry] = {}
        self.moves: dict[str, list[TierMove]] = {}
        # Host blocks whose keys were dropped to make room (host tier evictions).
        self.evictions = 0

    def add_worker(self, worker_id: str, num_blocks: int) -> None:
        """Give `worker_id` an empty host tier of `num_blocks` (0: none).

        Raises:
            InvalidRequest: num_blocks is not an int >= 0.
        """
        pool = HostPool(worker_id, num_blocks, make_policy(self.policy_name))
        if num_blocks:
            self.pools[worker_id] = pool

    def drop_worker(self, worker_id: str) -> int:
        """Forget a worker's host tier (its worker is gone, and its memory with it).
        Returns the keys dropped."""
        pool = self.pools.pop(worker_id, None)
        self.moves.pop(worker_id, None)
        if pool is None:
            return 0
        dropped = 0
        for _, keys in list(pool.held()):
            for key in keys:
                del self.entries[key]
                dropped += 1
        return dropped

    def drop_all(self) -> int:
        """Empty every host tier (keeping their sizes). Returns the keys dropped."""
        dropped = len(self.entries)
        for worker_id, pool in list(self.pools.items()):
            self.pools[worker_id] = HostPool(
                worker_id, pool.num_blocks, make_policy(self.policy_name)
            )
        self.entries.clear()
        self.moves.clear()
        return dropped

    def take_moves(self) -> dict[str, list[TierMove]]:
        """The moves queued since the last call, per worker, in the order decided."""
        moves, self.moves = self.moves, {}
        return moves


def evict_blocks(m: BlockManager, blocks: list[PhysicalBlock]) -> None:
    """Blocks `blocks` leave the GPU pool (reused, or reclaimed by `evict`): they leave
    the GPU index (one removed event per worker and owner), and the keys of each block
    whose worker has a host tier move there (an offload move is queued; a stored event
    with medium "cpu"); a host block given up to make room reports its keys removed."""
    tier = m._host
    moving = []
    for block in blocks:
        if block.worker_id in tier.pools and (keys := m._index.keys_of(block)):
            moving.append((block, keys, [m._index.get(key) for key in keys]))
    m._index.remove_blocks(blocks)
    for block, keys, entries in moving:
        placed = tier.pools[block.worker_id].put(keys)
        if placed is None:
            continue
        index, dropped = placed
        if dropped:
            tier.evictions += 1
            _report_removed(m, [(key, tier.entries.pop(key)) for key in dropped])
        host = HostBlock(block.worker_id, index)
        moved = [(k, e._replace(block=host)) for k, e in zip(keys, entries, strict=True) if e]
        tier.entries.update(moved)
        _report_stored(m, moved)
        tier.moves.setdefault(block.worker_id, []).append(TierMove("offload", block.index, index))


def drop_all(m: BlockManager) -> int:
    """Empty every host tier (`HostTier.drop_all`), reporting the keys removed."""
    items = list(m._host.entries.items())
    dropped = m._host.drop_all()
    _report_removed(m, items)
    return dropped


def evict_block(m: BlockManager, block: PhysicalBlock) -> None:
    """`evict_blocks` of one block."""
    evict_blocks(m, [block])


def _report_stored(m: BlockManager, items: list[tuple[bytes, IndexEntry]]) -> None:
    events = m._index.events
    if events is not None:
        for key, entry in items:
            events.stored(
                [key], entry.parent, entry.owner, entry.namespace, entry.block.worker_id,
                m._index.block_size, medium=MEDIUM_CPU,
            )  # fmt: skip


def _report_removed(m: BlockManager, items: list[tuple[bytes, IndexEntry]]) -> None:
    events = m._index.events
    if events is not None:
        for key, entry in items:
            events.removed(
                [key], entry.owner, entry.namespace, entry.block.worker_id, medium=MEDIUM_CPU
            )


def restorable(m: BlockManager, matched: list[tuple[bytes, Any]]) -> list[tuple[bytes, Any]]:
    """The longest head of a cross-tier match whose host blocks can all get a GPU block
    of their worker (free, or evictable without touching the match's own GPU blocks)."""
    if not any(type(b) is HostBlock for _, b in matched):
        return matched
    room: dict[str, int] = {}
    for _, block in matched:
        if type(block) is PhysicalBlock and m._pools[block.worker_id].is_cached(block.index):
            # Adopted first, so it stops being evictable.
            room[block.worker_id] = room.get(block.worker_id, m._pools[block.worker_id].available)
            room[block.worker_id] -= 1
    for i, (_, block) in enumerate(matched):
        if type(block) is HostBlock:
            left = room.get(block.worker_id, m._pools[block.worker_id].available)
            if left < 1:
                return matched[:i]
            room[block.worker_id] = left - 1
    return matched


def restore_blocks(m: BlockManager, matched: list[tuple[bytes, Any]]) -> list[PhysicalBlock]:
    """Bring the host blocks of a `restorable` match back to their workers' GPU pools.

    The caller has already taken references on the match's GPU blocks (so no eviction
    here can reach them). Each host block gets a GPU block with one reference (the
    caller's), its keys are published there again and a restore move is queued; its host
    block is freed only after every take of this call, so an offload queued by one of them
    cannot overwrite a host block still to be restored.

    Returns:
        The physical block of every matched position, in order.
    """
    tier = m._host
    # Every host block of the match leaves its tier's policy first: an offload queued
    # while taking GPU blocks below then cannot pick one of them as its victim.
    taken: dict[int, tuple[list[bytes], list[IndexEntry]]] = {}
    for i, (_, block) in enumerate(matched):
        if type(block) is HostBlock:
            keys = tier.pools[block.worker_id].take(block.index)
            taken[i] = (keys, [tier.entries.pop(key) for key in keys])
            _report_removed(m, list(zip(keys, taken[i][1], strict=True)))
    blocks: list[PhysicalBlock] = []
    for i, (_, block) in enumerate(matched):
        if type(block) is not HostBlock:
            blocks.append(block)
            continue
        index, evicted = m._pools[block.worker_id].take()
        gpu = PhysicalBlock(block.worker_id, index)
        if evicted:
            m._counters.evictions += 1
            evict_blocks(m, [gpu])
            m._note_released(gpu)
        keys, entries = taken[i]
        for key, entry in zip(keys, entries, strict=True):
            m._index.publish(key, entry._replace(block=gpu))
        tier.moves.setdefault(block.worker_id, []).append(TierMove("restore", index, block.index))
        blocks.append(gpu)
    for i in taken:
        block = matched[i][1]
        tier.pools[block.worker_id].release(block.index)
    return blocks


# ---- integrity ---------------------------------------------------------------------------


def check_host_tier(m: BlockManager) -> list[str]:
    """Problems with the host tier: blocks listed twice or in no state, a held block
    without keys or with keys the entries disagree on, a key in both tiers, entries
    without a block, a host tier of an unknown worker."""
    bad: list[str] = []
    tier = m._host
    seen_keys: set[bytes] = set()
    for worker_id, pool in tier.pools.items():
        if worker_id not in m._pools:
            bad.append(f"host tier of unknown worker {worker_id!r}")
        held = list(pool.held())
        free = pool.free_order()
        ids = sorted([*free, *(i for i, _ in held)])
        if ids != list(range(pool.num_blocks)):
            bad.append(f"{worker_id}: host blocks are not each free xor held")
        for index, keys in held:
            if not keys:
                bad.append(f"{worker_id}: host block {index} is held but has no key")
            tokens = set()
            for key in keys:
                entry = tier.entries.get(key)
                if entry is None or entry.block != HostBlock(worker_id, index):
                    bad.append(f"{worker_id}: host block {index} key {key.hex()[:12]} not mapped")
                    continue
                tokens.add(entry.tokens)
                seen_keys.add(key)
                if m._index.get(key) is not None:
                    bad.append(f"{key.hex()[:12]} is in both tiers")
            if len(tokens) > 1:
                bad.append(f"{worker_id}: host block {index} holds keys of different tokens")
    extra = set(tier.entries) - seen_keys
    if extra:
        bad.append(f"{len(extra)} host entries belong to no host block")
    return bad


# ---- snapshots ----------------------------------------------------------------------------


def host_records(m: BlockManager) -> list[dict[str, Any]]:
    """Every worker's host tier as JSON-able data (see cache_service/control/records.py)."""
    tier = m._host
    out = []
    for worker_id, pool in tier.pools.items():
        held = []
        for index, keys in pool.held():
            held.append(
                {
                    "index": index,
                    "entries": [_entry_record(key, tier.entries[key]) for key in keys],
                }
            )
        out.append(
            {
                "worker_id": worker_id,
                "num_blocks": pool.num_blocks,
                "free": pool.free_order(),
                "held": held,
            }
        )
    return out


def _entry_record(key: bytes, entry: IndexEntry) -> dict[str, Any]:
    return {
        "key": key.hex(),
        "parent": entry.parent.hex(),
        "owner": entry.owner,
        "tokens": decode_tokens(entry.tokens),
        "namespace": entry.namespace,
    }


def restore_host_records(m: BlockManager, records: list[dict[str, Any]]) -> None:
    """Rebuild the host tiers `host_records` wrote (workers already added).

    Raises:
        InvalidRequest: an unknown worker, a size that differs from the worker's, or
            blocks that do not partition the tier.
    """
    tier = m._host
    for w in records:
        worker_id = w["worker_id"]
        if worker_id not in m._pools:
            raise InvalidRequest(f"host tier of unknown worker {worker_id!r}")
        held: list[tuple[int, list[bytes]]] = []
        for h in w["held"]:
            keys = []
            for e in h["entries"]:
                key = bytes.fromhex(e["key"])
                tier.entries[key] = IndexEntry(
                    HostBlock(worker_id, h["index"]),
                    bytes.fromhex(e["parent"]),
                    e["owner"],
                    encode_tokens(e["tokens"]),
                    e.get("namespace", ""),
                )
                keys.append(key)
            held.append((h["index"], keys))
        tier.pools[worker_id] = HostPool.restore(
            worker_id, w["num_blocks"], w["free"], held, make_policy(m.config.eviction_policy)
        )


def host_sizes(m: BlockManager) -> Mapping[str, int]:
    """Host tier size in blocks per worker that has one."""
    return {w: p.num_blocks for w, p in m._host.pools.items()}
