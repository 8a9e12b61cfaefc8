"""Exact accounting of the control plane: pool states, fragmentation, prefix hits, events.

`CacheStats` is a snapshot computed from the allocator's own state when asked (nothing is
mirrored along the request path, so nothing can drift). The metrics layer reads it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from cache_service.control.block_pool import BlockPool
from cache_service.control.host_tier import HostTier
from cache_service.control.sequence import Sequence
from cache_service.control.types import PhysicalBlock

__all__ = [
    "CacheCounters",
    "CacheStats",
    "HostTierStats",
    "WorkerStats",
    "collect_stats",
    "partial_fills",
]


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """One worker's pool, in blocks and token slots.

    Attributes:
        total: blocks in the pool; total == used + cached_free + free.
        used: blocks referenced by a block table or a pin.
        cached_free: unreferenced blocks still findable in the prefix index (evictable).
        free: blocks holding nothing.
        allocated_slots: used * block_size.
        filled_slots: slots of used blocks holding a reserved token; a block's fill is the
            highest reserved offset + 1 among the sequences using it (a shared block counts
            once).
    """

    total: int
    used: int
    cached_free: int
    free: int
    allocated_slots: int
    filled_slots: int

    @property
    def utilization(self) -> float:
        """used / total (0..1)."""
        return self.used / self.total if self.total else 0.0

    @property
    def fragmentation(self) -> float:
        """(allocated - filled) / allocated slots (0..1; 0 with nothing allocated)."""
        if not self.allocated_slots:
            return 0.0
        return (self.allocated_slots - self.filled_slots) / self.allocated_slots


@dataclass(frozen=True, slots=True)
class HostTierStats:
    """One worker's host tier (cache_service.control.host_tier), in blocks.

    Attributes:
        total: host blocks; total == used + free.
        used: host blocks holding an evicted prefix block's keys.
        free: host blocks holding nothing.
    """

    total: int
    used: int
    free: int

    @property
    def utilization(self) -> float:
        """used / total (0..1)."""
        return self.used / self.total if self.total else 0.0


@dataclass(frozen=True, slots=True)
class CacheStats:
    """A snapshot of the whole control plane.

    Attributes:
        workers: per live worker id.
        utilization: used / total blocks over every live worker (0..1).
        fragmentation: (allocated - filled) / allocated slots over every live worker.
        prefix_query_tokens: per tenant, prompt tokens submitted to create_sequence.
        prefix_hit_tokens: per tenant, of those, tokens served from cached blocks.
        evictions: cached-free blocks reclaimed (dropped from the index) so far.
        cow_copies: copy-on-write block copies so far.
        pinned_blocks: distinct blocks held by at least one pin.
        active_sequences: sequences holding a block table (not freed, not lost).
        lost_sequences: sequences failed by a lost worker and not yet freed by their client.
        host_tiers: per live worker with a host tier.
        host_hit_tokens: of prefix_hit_tokens (all tenants), tokens restored from a host
            tier; the rest were served from GPU pools.
        host_evictions: host blocks whose keys were dropped to make room in a host tier.
    """

    workers: dict[str, WorkerStats]
    utilization: float
    fragmentation: float
    prefix_query_tokens: dict[str, int]
    prefix_hit_tokens: dict[str, int]
    evictions: int
    cow_copies: int
    pinned_blocks: int
    active_sequences: int
    lost_sequences: int
    host_tiers: dict[str, HostTierStats] = field(default_factory=dict)
    host_hit_tokens: int = 0
    host_evictions: int = 0


@dataclass(slots=True)
class CacheCounters:
    """Monotonic event counters (part of the state: snapshots carry them)."""

    evictions: int = 0
    cow_copies: int = 0
    host_hit_tokens: int = 0
    prefix_query_tokens: dict[str, int] = field(default_factory=dict)
    prefix_hit_tokens: dict[str, int] = field(default_factory=dict)

    def count_query(self, tenant: str, query_tokens: int, hit_tokens: int) -> None:
        """Record one prompt lookup of `query_tokens` of which `hit_tokens` were cached."""
        self.prefix_query_tokens[tenant] = self.prefix_query_tokens.get(tenant, 0) + query_tokens
        self.prefix_hit_tokens[tenant] = self.prefix_hit_tokens.get(tenant, 0) + hit_tokens


def partial_fills(sequences: Iterable[Sequence], block_size: int) -> dict[PhysicalBlock, int]:
    """Fill (highest reserved offset + 1) of every partly filled used block.

    Only a sequence's last block can be partial, and a partial block is shared only by
    forks with the same reserved tokens (appending into a shared partial block copies it),
    so the last blocks are all that needs looking at.
    """
    fills: dict[PhysicalBlock, int] = {}
    for seq in sequences:
        rest = len(seq.tokens) % block_size
        if rest:
            block = seq.table[-1]
            if fills.get(block, 0) < rest:
                fills[block] = rest
    return fills


def collect_stats(
    pools: Mapping[str, BlockPool],
    sequences: Mapping[str, Sequence],
    pinned: Mapping[PhysicalBlock, int],
    counters: CacheCounters,
    block_size: int,
    lost_sequences: int,
    host: HostTier | None = None,
) -> CacheStats:
    """Compute a CacheStats snapshot; O(workers + sequences). `host`: the host tiers."""
    unfilled: dict[str, int] = {}
    for block, fill in partial_fills(sequences.values(), block_size).items():
        unfilled[block.worker_id] = unfilled.get(block.worker_id, 0) + block_size - fill
    workers: dict[str, WorkerStats] = {}
    for worker_id, pool in pools.items():
        allocated = pool.num_used * block_size
        workers[worker_id] = WorkerStats(
            total=pool.num_blocks,
            used=pool.num_used,
            cached_free=pool.num_cached,
            free=pool.num_free,
            allocated_slots=allocated,
            filled_slots=allocated - unfilled.get(worker_id, 0),
        )
    total = sum(w.total for w in workers.values())
    used = sum(w.used for w in workers.values())
    allocated = sum(w.allocated_slots for w in workers.values())
    filled = sum(w.filled_slots for w in workers.values())
    return CacheStats(
        workers=workers,
        utilization=used / total if total else 0.0,
        fragmentation=(allocated - filled) / allocated if allocated else 0.0,
        prefix_query_tokens=dict(counters.prefix_query_tokens),
        prefix_hit_tokens=dict(counters.prefix_hit_tokens),
        evictions=counters.evictions,
        cow_copies=counters.cow_copies,
        pinned_blocks=len(pinned),
        active_sequences=len(sequences),
        lost_sequences=lost_sequences,
        host_tiers={
            w: HostTierStats(p.num_blocks, p.num_used, p.num_free)
            for w, p in (host.pools.items() if host is not None else ())
        },
        host_hit_tokens=counters.host_hit_tokens,
        host_evictions=host.evictions if host is not None else 0,
    )
