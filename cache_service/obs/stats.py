"""Turn the control plane's exact accounting (CacheStats) into Prometheus metric families.

The figures are read at scrape time from the block manager itself rather than mirrored in
counters updated along the request path: what Prometheus stores is then the allocator's own
bookkeeping, never a second copy that could drift from it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from cache_service.control.accounting import CacheStats

__all__ = ["CacheStatsCollector", "StatsBinding", "stats_families"]

log = logging.getLogger(__name__)

# The block states a worker's pool is split into; they add up to its capacity.
BLOCK_STATES = ("used", "cached_free", "free")


def stats_families(stats: CacheStats, prefix: str, bytes_per_block: int | None) -> list[Metric]:
    """Build every metric family for one CacheStats snapshot.

    Args:
        stats: a `cache_service.control.accounting.CacheStats` (per-worker `WorkerStats` in
            `stats.workers`, keyed by worker id).
        prefix: metric name prefix, e.g. "kvcache".
        bytes_per_block: KV bytes of one block, all layers, K and V (`KVLayout.bytes_per_block`);
            None leaves the two byte gauges out.

    Returns:
        Gauges for pool state (blocks, slots, ratios 0..1, bytes) per worker, cluster-wide
        ratios, prefix-cache counters per tenant, evictions, copy-on-write copies, pinned
        blocks and active sequences.
    """
    return [
        *_pool_families(stats, prefix, bytes_per_block),
        *_host_tier_families(stats, prefix, bytes_per_block),
        *_cluster_families(stats, prefix),
        *_prefix_families(stats, prefix),
        *_sequence_families(stats, prefix),
    ]


def _pool_families(stats: CacheStats, p: str, bytes_per_block: int | None) -> list[Metric]:
    """Per-worker pool gauges: blocks by state, ratios, slots, and bytes if the size is known."""
    capacity = GaugeMetricFamily(
        f"{p}_pool_capacity_blocks", "Blocks in the worker's KV pool.", labels=["worker"]
    )
    blocks = GaugeMetricFamily(
        f"{p}_pool_blocks",
        "Blocks of the worker's pool by state: used (referenced by a sequence or pinned), "
        "cached_free (unreferenced, still findable in the prefix index, evictable), free.",
        labels=["worker", "state"],
    )
    utilization = GaugeMetricFamily(
        f"{p}_pool_utilization_ratio",
        "Used blocks over pool capacity (0..1).",
        labels=["worker"],
    )
    fragmentation = GaugeMetricFamily(
        f"{p}_pool_fragmentation_ratio",
        "Internal fragmentation: allocated but unfilled token slots over allocated slots (0..1).",
        labels=["worker"],
    )
    allocated = GaugeMetricFamily(
        f"{p}_pool_allocated_slots",
        "Token slots in the worker's used blocks.",
        labels=["worker"],
    )
    filled = GaugeMetricFamily(
        f"{p}_pool_filled_slots",
        "Token slots of used blocks that hold a reserved token.",
        labels=["worker"],
    )
    families: list[Metric] = [capacity, blocks, utilization, fragmentation, allocated, filled]

    held_bytes = capacity_bytes = None
    if bytes_per_block is not None:
        held_bytes = GaugeMetricFamily(
            f"{p}_kv_held_bytes",
            "KV cache bytes held by used blocks (used blocks x bytes per block).",
            labels=["worker"],
        )
        capacity_bytes = GaugeMetricFamily(
            f"{p}_pool_capacity_bytes",
            "KV cache bytes of the worker's whole pool.",
            labels=["worker"],
        )
        families += [held_bytes, capacity_bytes]

    for worker_id in sorted(stats.workers):
        w = stats.workers[worker_id]
        capacity.add_metric([worker_id], w.total)
        for state in BLOCK_STATES:
            blocks.add_metric([worker_id, state], getattr(w, state))
        # The control plane's own ratios (WorkerStats properties), not a recomputation.
        utilization.add_metric([worker_id], w.utilization)
        fragmentation.add_metric([worker_id], w.fragmentation)
        allocated.add_metric([worker_id], w.allocated_slots)
        filled.add_metric([worker_id], w.filled_slots)
        if held_bytes is not None and capacity_bytes is not None:
            held_bytes.add_metric([worker_id], w.used * bytes_per_block)
            capacity_bytes.add_metric([worker_id], w.total * bytes_per_block)
    return families


def _host_tier_families(stats: CacheStats, p: str, bytes_per_block: int | None) -> list[Metric]:
    """Per-worker host tier gauges (cache_service.control.host_tier): blocks by state,
    utilization, bytes held; only workers with a host tier appear."""
    blocks = GaugeMetricFamily(
        f"{p}_host_tier_blocks",
        "Blocks of the worker's host tier by state: used (an evicted prefix block kept in "
        "host memory, findable by prefix), free.",
        labels=["worker", "state"],
    )
    utilization = GaugeMetricFamily(
        f"{p}_host_tier_utilization_ratio",
        "Used host tier blocks over host tier capacity (0..1).",
        labels=["worker"],
    )
    families: list[Metric] = [blocks, utilization]
    held = None
    if bytes_per_block is not None:
        held = GaugeMetricFamily(
            f"{p}_host_tier_held_bytes",
            "KV bytes held in the worker's host tier (used host blocks x bytes per block).",
            labels=["worker"],
        )
        families.append(held)
    for worker_id in sorted(stats.host_tiers):
        h = stats.host_tiers[worker_id]
        blocks.add_metric([worker_id, "used"], h.used)
        blocks.add_metric([worker_id, "free"], h.free)
        utilization.add_metric([worker_id], h.utilization)
        if held is not None and bytes_per_block is not None:
            held.add_metric([worker_id], h.used * bytes_per_block)
    return families


def _cluster_families(stats: CacheStats, p: str) -> list[Metric]:
    """Cluster-wide utilization and fragmentation ratios, as the control plane computes them."""
    return [
        GaugeMetricFamily(
            f"{p}_cluster_utilization_ratio",
            "Used blocks over the capacity of every live worker (0..1), as the control "
            "plane computes it.",
            value=stats.utilization,
        ),
        GaugeMetricFamily(
            f"{p}_cluster_fragmentation_ratio",
            "Unfilled over allocated token slots across every live worker (0..1), as the "
            "control plane computes it.",
            value=stats.fragmentation,
        ),
    ]


def _prefix_families(stats: CacheStats, p: str) -> list[Metric]:
    """Prefix-cache counters per tenant, evictions, copy-on-write copies, pinned blocks."""
    queries = CounterMetricFamily(
        f"{p}_prefix_query_tokens",
        "Prompt tokens looked up in the prefix index, per tenant.",
        labels=["tenant"],
    )
    hits = CounterMetricFamily(
        f"{p}_prefix_hit_tokens",
        "Prompt tokens served from cached prefix blocks, per tenant.",
        labels=["tenant"],
    )
    for tenant in sorted(stats.prefix_query_tokens):
        queries.add_metric([tenant], stats.prefix_query_tokens[tenant])
        hits.add_metric([tenant], stats.prefix_hit_tokens.get(tenant, 0))
    tier_hits = CounterMetricFamily(
        f"{p}_prefix_tier_hit_tokens",
        "Prompt tokens served from cached prefix blocks (all tenants), by the tier they "
        "were found in: gpu (a pool) or host (restored from a host tier).",
        labels=["tier"],
    )
    total_hits = sum(stats.prefix_hit_tokens.values())
    tier_hits.add_metric(["gpu"], total_hits - stats.host_hit_tokens)
    tier_hits.add_metric(["host"], stats.host_hit_tokens)
    return [
        queries,
        hits,
        tier_hits,
        CounterMetricFamily(
            f"{p}_host_tier_evictions",
            "Host tier blocks whose prefix keys were dropped to make room for newer ones.",
            value=stats.host_evictions,
        ),
        CounterMetricFamily(
            f"{p}_prefix_evictions",
            "Cached-free blocks reclaimed by the allocator (dropped from the prefix index, or "
            "moved to the host tier).",
            value=stats.evictions,
        ),
        CounterMetricFamily(
            f"{p}_cow_copies",
            "Copy-on-write block copies (a write into a shared, partly filled block).",
            value=stats.cow_copies,
        ),
        GaugeMetricFamily(
            f"{p}_pinned_blocks", "Blocks pinned in the prefix cache.", value=stats.pinned_blocks
        ),
    ]


def _sequence_families(stats: CacheStats, p: str) -> list[Metric]:
    """Sequences holding a block table, and those lost with a worker but not yet freed."""
    return [
        GaugeMetricFamily(
            f"{p}_active_sequences",
            "Sequences that hold a block table (created, not freed, not lost).",
            value=stats.active_sequences,
        ),
        GaugeMetricFamily(
            f"{p}_lost_sequences_pending",
            "Sequences failed by a lost worker whose client has not freed them yet.",
            value=stats.lost_sequences,
        ),
    ]


@dataclass(frozen=True)
class StatsBinding:
    """Where a scrape reads the control plane's accounting from.

    Attributes:
        fn: returns the current CacheStats; must not block for long.
        bytes_per_block: KV bytes of one block (all layers, K and V); None omits bytes.
        loop: when the control plane lives on an asyncio loop (the coordinator), `fn` is run
            on that loop so the snapshot never interleaves with a half-applied mutation;
            None calls `fn` on the scraping thread (it must then be thread-safe).
        timeout_s: how long a scrape waits for the loop to run `fn`, in seconds.
    """

    fn: Callable[[], CacheStats]
    bytes_per_block: int | None = None
    loop: asyncio.AbstractEventLoop | None = None
    timeout_s: float = 5.0

    def read(self) -> CacheStats:
        """Take one snapshot, on the loop when one is bound."""
        if self.loop is None:
            return self.fn()
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            return self.fn()
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(self.fn())
            except BaseException as exc:
                future.set_exception(exc)

        self.loop.call_soon_threadsafe(run)
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            # A loop that is stuck or gone must not run fn for a scrape that gave up.
            future.cancel()
            raise


class CacheStatsCollector(Collector):
    """A custom collector: one CacheStats snapshot per scrape.

    A failing snapshot (the loop is stopped, `fn` raises) is logged and counted in
    `<prefix>_stats_collect_errors_total`, exported by this collector so the failing scrape
    itself already shows the new count; the rest of the scrape still succeeds, so one
    broken source never hides every other metric.
    """

    def __init__(self, binding: StatsBinding, prefix: str) -> None:
        self._binding = binding
        self._prefix = prefix
        self._errors = 0
        self._lock = threading.Lock()

    def describe(self) -> Iterable[Metric]:
        # Describing would run fn at registration time; an empty description tells the
        # registry not to, and no name clash checks are needed for these families.
        return []

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self._binding.read()
        except Exception:
            log.exception("reading CacheStats for a metrics scrape failed")
            stats = None
            with self._lock:
                self._errors += 1
        with self._lock:
            errors = self._errors
        yield CounterMetricFamily(
            f"{self._prefix}_stats_collect_errors",
            "Scrapes whose read of the control plane's accounting failed.",
            value=errors,
        )
        if stats is not None:
            yield from stats_families(stats, self._prefix, self._binding.bytes_per_block)
