"""Prometheus metrics of the KV-cache service (one object the coordinator owns).

Naming follows Prometheus conventions: one prefix (default "kvcache"), base units
(seconds, bytes), `_total` on counters, ratios in 0..1, no colons. docs/metrics.md lists
every metric with its labels and meaning.

Two kinds of figures:
- events along the request path (RPCs, worker calls, tokens, lost sequences, worker
  restarts) are counted as they happen through the methods below;
- the pool and prefix-cache state is read at scrape time from the control plane's own
  accounting (`bind_stats`), so the exported values are the allocator's exact numbers.
"""

from __future__ import annotations

import asyncio
import math
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc.aio
from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)
from prometheus_client import start_http_server as _start_http_server

from cache_service._proto.kvcache.v1 import kvcache_pb2 as pb
from cache_service.obs.loop import LoopCPUCollector, current_thread_cpu_clock
from cache_service.obs.rpc import RpcMetricsInterceptor
from cache_service.obs.stats import CacheStatsCollector, StatsBinding

if TYPE_CHECKING:
    from cache_service.control.accounting import CacheStats
    from cache_service.control.kv_events import KvEvent

__all__ = ["MetricsHTTPServer", "ServiceMetrics"]

# The service label of the session calls (the label the RPC interceptor gives its RPCs).
_SERVICE = pb.DESCRIPTOR.services_by_name["KVCache"].full_name

_PREFIX_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")

# RPC latency, seconds: from a cached lookup (sub-millisecond) to a long prefill on CPU.
RPC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
# One worker call (kernel launches of a coalesced layer batch plus the actor round trip).
WORKER_CALL_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    10,
)
# How late the event loop ran a callback that was due, seconds: from a loop with time to
# spare (tens of microseconds) to one stalled for a second.
LOOP_LAG_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)
# Sequences in one worker call: powers of two up to a large decode batch.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# Client calls per worker call (kvcache_worker_round_size).
PARTS_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)


# The ways a per-layer data call reaches its worker (kvcache_worker_data_calls_total).
DATA_CALL_PATHS = ("in_process", "channel", "ray")
# Copies between a worker's GPU pool and its host tier (cache_service.control.host_tier).
TIER_DIRECTIONS = ("offload", "restore")


def _check_worker_id(worker_id: str) -> None:
    if not isinstance(worker_id, str) or not worker_id:
        raise ValueError(f"worker_id must be a non-empty string, got {worker_id!r}")


def _check_seconds(seconds: object) -> None:
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, int | float)
        or not math.isfinite(seconds)
        or seconds < 0
    ):
        raise ValueError(f"seconds must be a finite number >= 0, got {seconds!r}")


def _check_count(name: str, n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"{name} must be a non-negative int, got {n!r}")


@dataclass
class MetricsHTTPServer:
    """The /metrics HTTP endpoint running in a background thread; `stop()` ends it.

    Attributes:
        host: the address it listens on.
        port: the bound TCP port (the real one when 0 was asked for).
    """

    host: str
    port: int
    _server: Any
    _thread: threading.Thread

    @property
    def url(self) -> str:
        """The scrape URL, e.g. "http://127.0.0.1:9400/metrics"."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving and close the socket; idempotent."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=timeout_s)

    def __enter__(self) -> MetricsHTTPServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ServiceMetrics:
    """Every metric the service exports, in one registry.

    Args:
        registry: where the metrics are registered; None creates a private registry that
            also carries the process, platform and GC collectors (several services can then
            live in one process, e.g. in tests).
        prefix: metric name prefix, `[a-zA-Z_][a-zA-Z0-9_]*` (no colons).
        bytes_per_block: KV bytes of one block, all layers, K and V
            (`KVLayout.bytes_per_block`); can also be given to `bind_stats`.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        prefix: str = "kvcache",
        bytes_per_block: int | None = None,
    ) -> None:
        if not isinstance(prefix, str) or not _PREFIX_RE.match(prefix):
            raise ValueError(
                f"prefix must match [a-zA-Z_][a-zA-Z0-9_]* (Prometheus name, no colons), "
                f"got {prefix!r}"
            )
        if bytes_per_block is not None:
            _check_positive_int("bytes_per_block", bytes_per_block)
        if registry is None:
            registry = CollectorRegistry(auto_describe=True)
            for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
                registry.register(collector)
        self.registry = registry
        self.prefix = prefix
        self._bytes_per_block = bytes_per_block
        self._lock = threading.Lock()
        self._epochs: dict[str, str] = {}
        self._stats_collector: CacheStatsCollector | None = None
        self._loop_collector: LoopCPUCollector | None = None
        # Registered in this order, which is the order of the exposition.
        self._add_rpc_metrics(prefix, registry)
        self._add_worker_call_metrics(prefix, registry)
        self._add_tier_transfer_metrics(prefix, registry)
        self._add_token_metrics(prefix, registry)
        self._add_correctness_metrics(prefix, registry)
        self._add_worker_state_metrics(prefix, registry)
        self._add_host_metrics(prefix, registry)
        self._add_kv_event_metrics(prefix, registry)

    def _add_rpc_metrics(self, p: str, reg: CollectorRegistry) -> None:
        """gRPC requests: counts and latency by service, method and status code."""
        self.rpc_requests = Counter(
            f"{p}_rpc_requests",
            "gRPC requests handled, by service, method and final status code.",
            ["service", "method", "code"],
            registry=reg,
        )
        # (method, code) -> the (duration, count) children of a session call's labels.
        self._session_children: dict[tuple[str, str], tuple[Any, Any]] = {}
        self.rpc_duration = Histogram(
            f"{p}_rpc_duration_seconds",
            "gRPC handling time in seconds, by service, method and final status code.",
            ["service", "method", "code"],
            buckets=RPC_BUCKETS,
            registry=reg,
        )

    def _add_worker_call_metrics(self, p: str, reg: CollectorRegistry) -> None:
        """Coordinator -> worker calls: latency, batch size and coalescing."""
        self.worker_call_duration = Histogram(
            f"{p}_worker_call_duration_seconds",
            "Time of one coordinator -> worker call (one coalesced layer batch: KV writes and "
            "attention kernels plus the actor round trip), seconds.",
            ["worker"],
            buckets=WORKER_CALL_BUCKETS,
            registry=reg,
        )
        self.worker_batch_size = Histogram(
            f"{p}_worker_batch_size",
            "Sequences in one worker call after coalescing (1 for a write).",
            ["worker"],
            buckets=BATCH_BUCKETS,
            registry=reg,
        )
        self.worker_round_size = Histogram(
            f"{p}_worker_round_size",
            "Client calls coalesced into one worker call (a round's parts; 1: a call alone).",
            ["worker"],
            buckets=PARTS_BUCKETS,
            registry=reg,
        )
        self.worker_calls_over_layers = Counter(
            f"{p}_worker_calls_over_layers",
            "Worker calls coalescing client calls of several layers (clients a layer apart: "
            "one call over the pool's pages of every layer).",
            ["worker"],
            registry=reg,
        )

    def _add_tier_transfer_metrics(self, p: str, reg: CollectorRegistry) -> None:
        """Copies between GPU pools and host tiers: bytes and time, by direction."""
        self.tier_transfer_bytes = Counter(
            f"{p}_tier_transfer_bytes",
            "KV bytes copied between a worker's GPU pool and its host tier: offload (GPU -> "
            "host, an evicted prefix block kept) or restore (host -> GPU, a prefix hit).",
            ["direction"],
            registry=reg,
        )
        self.tier_transfer_seconds = Histogram(
            f"{p}_tier_transfer_seconds",
            "Time of one batched copy between GPU pools and host tiers (the worker call), "
            "seconds, by direction.",
            ["direction"],
            buckets=WORKER_CALL_BUCKETS,
            registry=reg,
        )
        # Both directions exported from the start (0 until a copy), so rates and panels
        # have a series before the first eviction.
        for direction in TIER_DIRECTIONS:
            self.tier_transfer_bytes.labels(direction)
            self.tier_transfer_seconds.labels(direction)

    def _add_token_metrics(self, p: str, reg: CollectorRegistry) -> None:
        """Tokens written and attended, and sequences lost with a worker."""
        self.tokens_appended = Counter(
            f"{p}_tokens_appended", "Tokens whose K/V were written (per layer batch).", registry=reg
        )
        self.attention_tokens = Counter(
            f"{p}_attention_tokens", "Query tokens whose attention was served.", registry=reg
        )
        self.lost_sequences = Counter(
            f"{p}_lost_sequences",
            "Sequences failed with DATA_LOSS because a worker holding their blocks was lost.",
            registry=reg,
        )
        self.step_leases = Counter(
            f"{p}_step_leases",
            "Step leases granted to co-located clients, and ended (event).",
            ["event"],
            registry=reg,
        )
        # Bound once: a lease is granted and ended per decode step, and labels() takes a
        # lock and validates the label each time.
        self._step_lease_events = {
            event: self.step_leases.labels(event) for event in ("granted", "ended")
        }
        self.leased_layers = Counter(
            f"{p}_leased_layers",
            "Layers written under a step lease (by a co-located client on the worker's pool), "
            "committed when the lease ended.",
            registry=reg,
        )

    def _add_correctness_metrics(self, p: str, reg: CollectorRegistry) -> None:
        """The online correctness checks: mismatches, their time, discarded checks."""
        self.correctness_mismatches = Counter(
            f"{p}_correctness_mismatches",
            "Online correctness checks whose attention output differed from the reference, "
            "by worker.",
            ["worker"],
            registry=reg,
        )
        self.correctness_check_duration = Histogram(
            f"{p}_correctness_check_seconds",
            "Time of one online correctness check (the reference recomputation and the "
            "comparison), seconds; it runs after its round answered, beside the traffic.",
            buckets=WORKER_CALL_BUCKETS,
            registry=reg,
        )
        self.correctness_checks_discarded = Counter(
            f"{p}_correctness_checks_discarded",
            "Online correctness checks discarded because one of their blocks went free or one "
            "of their sequences had a write cancelled while they ran (the data they read may "
            "have been reused).",
            registry=reg,
        )

    def _add_worker_state_metrics(self, p: str, reg: CollectorRegistry) -> None:
        """Per-layer data calls by path, and each worker's liveness and restarts."""
        self._data_call_children: dict[tuple[str, str], Any] = {}
        self._worker_call_children: dict[str, tuple[Any, Any]] = {}
        self.worker_data_calls = Counter(
            f"{p}_worker_data_calls",
            "Per-layer data calls (writes, attention) to the workers, by worker and by path: "
            "'in_process' (a pool in the coordinator's process), 'channel' (a Ray worker over "
            "its worker channel: a Unix socket and shared memory on the same node, TCP from "
            "another), 'ray' (a Ray actor call: the channel off or unavailable, or a call "
            "too large for it).",
            ["worker", "path"],
            registry=reg,
        )
        self.worker_up = Gauge(
            f"{p}_worker_up",
            "1 while the worker is reachable and serving, else 0.",
            ["worker"],
            registry=reg,
        )
        self.worker_restarts = Counter(
            f"{p}_worker_restarts",
            "Worker restarts seen by the coordinator (epoch changes; each empties the pool).",
            ["worker"],
            registry=reg,
        )

    def _add_host_metrics(self, p: str, reg: CollectorRegistry) -> None:
        """The coordinator process: shared memory, local sessions, event-loop lag."""
        self.shared_memory_regions = Gauge(
            f"{p}_shared_memory_regions",
            "Shared-memory regions held for same-host clients' tensors (all tenants).",
            registry=reg,
        )
        self.local_sessions = Gauge(
            f"{p}_local_sessions",
            "Local sessions open: same-host clients sending Session calls over the server's "
            "Unix domain socket instead of gRPC.",
            registry=reg,
        )
        self.event_loop_lag = Histogram(
            f"{p}_event_loop_lag_seconds",
            "How much later than due the coordinator's event loop ran a periodic probe, "
            "seconds: the wait of a callback that became ready behind the loop's other work.",
            buckets=LOOP_LAG_BUCKETS,
            registry=reg,
        )
        self.shared_memory_bytes = Gauge(
            f"{p}_shared_memory_bytes",
            "Bytes of the shared-memory regions held (all tenants; in /dev/shm, i.e. memory).",
            registry=reg,
        )

    def _add_kv_event_metrics(self, p: str, reg: CollectorRegistry) -> None:
        """KV events (SubscribeKvEvents): published by type, subscribers."""
        self.kv_events = Counter(
            f"{p}_kv_events",
            "KV events published (made visible to subscribers once durable) by type: "
            "stored, removed, cleared.",
            ["type"],
            registry=reg,
        )
        for kind in ("stored", "removed", "cleared"):
            self.kv_events.labels(type=kind)
        self.kv_event_subscribers = Gauge(
            f"{p}_kv_event_subscribers",
            "Open SubscribeKvEvents streams.",
            registry=reg,
        )

    # -- gRPC ------------------------------------------------------------------------------

    def rpc_interceptor(self) -> grpc.aio.ServerInterceptor:
        """An interceptor for `grpc.aio.server(interceptors=[...])` recording every RPC's
        latency (seconds) and count by service, method and final status code."""
        return RpcMetricsInterceptor(self.rpc_requests, self.rpc_duration)

    def observe_session_call(self, method: str, code: str, seconds: float) -> None:
        """Record one call made as a message of a `Session` stream like an RPC of its own:
        method ``Session.<call>`` (e.g. ``Session.AppendAttendBatch``), its status code
        name, its handling time in seconds. (The stream itself is recorded as one
        ``Session`` RPC when it ends.)"""
        # One labels() lookup per (method, code) ever: it takes a lock and validates the
        # labels, and a session records every layer's call.
        children = self._session_children.get((method, code))
        if children is None:
            key = (_SERVICE, method, code)
            children = (self.rpc_duration.labels(*key), self.rpc_requests.labels(*key))
            self._session_children[(method, code)] = children
        children[0].observe(seconds)
        children[1].inc()

    # -- data plane ------------------------------------------------------------------------

    def observe_worker_call(
        self,
        worker_id: str,
        layer_batch_size: int,
        seconds: float,
        parts: int = 1,
        over_layers: bool = False,
    ) -> None:
        """Record one coordinator -> worker call.

        Args:
            worker_id: the worker's id (as in the block manager).
            layer_batch_size: sequences in the call after coalescing (>= 1; 1 for a write).
            seconds: wall time of the call, seconds (finite, >= 0).
            parts: client calls coalesced into it (>= 1).
            over_layers: whether those calls were on several layers.
        """
        _check_positive_int("layer_batch_size", layer_batch_size)
        _check_positive_int("parts", parts)
        _check_seconds(seconds)
        if type(over_layers) is not bool:
            raise ValueError(f"over_layers must be a bool, got {over_layers!r}")
        # Once per worker call: the labelled children are looked up once per worker.
        children = self._worker_call_children.get(worker_id)
        if children is None:
            _check_worker_id(worker_id)
            children = self._worker_call_children[worker_id] = (
                self.worker_call_duration.labels(worker_id),
                self.worker_batch_size.labels(worker_id),
                self.worker_round_size.labels(worker_id),
                self.worker_calls_over_layers.labels(worker_id),
            )
        children[0].observe(seconds)
        children[1].observe(layer_batch_size)
        children[2].observe(parts)
        if over_layers:
            children[3].inc()

    def observe_tier_transfer(self, direction: str, nbytes: int, seconds: float) -> None:
        """Record one batched copy between a GPU pool and its host tier.

        Args:
            direction: "offload" (GPU -> host) or "restore" (host -> GPU).
            nbytes: bytes copied (>= 0).
            seconds: wall time of the worker call (finite, >= 0).
        """
        if direction not in TIER_DIRECTIONS:
            raise ValueError(f"direction must be one of {TIER_DIRECTIONS}, got {direction!r}")
        _check_count("nbytes", nbytes)
        _check_seconds(seconds)
        self.tier_transfer_bytes.labels(direction).inc(nbytes)
        self.tier_transfer_seconds.labels(direction).observe(seconds)

    def add_worker_data_call(self, worker_id: str, path: str) -> None:
        """Count one per-layer data call to a worker, by the path it took ("in_process",
        "channel" or "ray")."""
        child = self._data_call_children.get((worker_id, path))
        if child is None:
            _check_worker_id(worker_id)
            if path not in DATA_CALL_PATHS:
                raise ValueError(f"path must be one of {DATA_CALL_PATHS}, got {path!r}")
            child = self._data_call_children[(worker_id, path)] = self.worker_data_calls.labels(
                worker_id, path
            )
        child.inc()

    def add_tokens_appended(self, n: int) -> None:
        """Count `n` tokens written into the cache (n >= 0)."""
        _check_count("n", n)
        self.tokens_appended.inc(n)

    def add_attention_tokens(self, n: int) -> None:
        """Count `n` query tokens whose attention output was returned (n >= 0)."""
        _check_count("n", n)
        self.attention_tokens.inc(n)

    def add_step_lease(self, event: str) -> None:
        """Count a step lease `event`: "granted" or "ended"."""
        child = self._step_lease_events.get(event)
        (child if child is not None else self.step_leases.labels(event)).inc()

    def add_leased_layers(self, n: int) -> None:
        """Count `n` layers written under a step lease (n >= 0)."""
        _check_count("n", n)
        self.leased_layers.inc(n)

    def add_lost_sequences(self, n: int) -> None:
        """Count `n` sequences failed with DATA_LOSS (n >= 0)."""
        _check_count("n", n)
        self.lost_sequences.inc(n)

    def add_correctness_mismatch(self, worker_id: str, layer: int) -> None:
        """Count one online correctness-check mismatch on `worker_id`.

        The layer is validated but not a label: a mismatch is rare and investigated from the
        coordinator's log, while a per-layer label would multiply the series by num_layers.
        """
        _check_worker_id(worker_id)
        _check_count("layer", layer)
        self.correctness_mismatches.labels(worker_id).inc()

    def add_correctness_check_discarded(self) -> None:
        """Count one online correctness check discarded unjudged (its sequences changed)."""
        self.correctness_checks_discarded.inc()

    def observe_correctness_check(self, seconds: float) -> None:
        """Record one online correctness check that ran: its wall time, seconds (finite,
        >= 0). The histogram's count is the number of checks."""
        _check_seconds(seconds)
        self.correctness_check_duration.observe(seconds)

    def set_worker_state(self, worker_id: str, up: bool, epoch: str) -> None:
        """Report a worker's liveness and epoch; a changed epoch counts as one restart.

        The first epoch seen for a worker is its start, not a restart. Series of a worker
        start at 0 when it is first reported, so rates over them exist before any incident.
        """
        _check_worker_id(worker_id)
        if not isinstance(up, bool):
            raise ValueError(f"up must be a bool, got {up!r}")
        if not isinstance(epoch, str) or not epoch:
            raise ValueError(f"epoch must be a non-empty string, got {epoch!r}")
        with self._lock:
            previous = self._epochs.get(worker_id)
            self._epochs[worker_id] = epoch
            restarts = self.worker_restarts.labels(worker_id)
            self.correctness_mismatches.labels(worker_id)
            if previous is not None and previous != epoch:
                restarts.inc()
            self.worker_up.labels(worker_id).set(1 if up else 0)

    def remove_worker(self, worker_id: str) -> None:
        """Drop every per-worker series of a worker taken out of the cluster for good."""
        _check_worker_id(worker_id)
        with self._lock:
            self._epochs.pop(worker_id, None)
            self._worker_call_children.pop(worker_id, None)
            for metric in (
                self.worker_up,
                self.worker_restarts,
                self.correctness_mismatches,
                self.worker_call_duration,
                self.worker_batch_size,
                self.worker_round_size,
                self.worker_calls_over_layers,
            ):
                try:
                    metric.remove(worker_id)
                except KeyError:
                    pass
            for path in DATA_CALL_PATHS:
                self._data_call_children.pop((worker_id, path), None)
                try:
                    self.worker_data_calls.remove(worker_id, path)
                except KeyError:
                    pass

    # -- shared memory ---------------------------------------------------------------------

    def set_shared_memory(self, regions: int, nbytes: int) -> None:
        """Report the shared-memory regions held: their count and their bytes (both >= 0;
        `SharedRegions` calls this after every change)."""
        _check_count("regions", regions)
        _check_count("nbytes", nbytes)
        self.shared_memory_regions.set(regions)
        self.shared_memory_bytes.set(nbytes)

    def set_local_sessions(self, sessions: int) -> None:
        """Report the local sessions open (>= 0; `LocalSessions` calls this on changes)."""
        _check_count("sessions", sessions)
        self.local_sessions.set(sessions)

    def add_kv_events(self, events: list[KvEvent]) -> None:
        """Count published KV events by type (`KvEventFeed` calls this on each release)."""
        counts: dict[str, int] = {}
        for event in events:
            counts[event.type] = counts.get(event.type, 0) + 1
        for kind, n in counts.items():
            self.kv_events.labels(type=kind).inc(n)

    def set_kv_event_subscribers(self, subscribers: int) -> None:
        """Report the open KV event subscriptions (>= 0)."""
        _check_count("subscribers", subscribers)
        self.kv_event_subscribers.set(subscribers)

    # -- the coordinator's event loop -------------------------------------------------------

    def bind_event_loop_thread(self) -> bool:
        """Export the calling thread's CPU seconds as
        ``<prefix>_event_loop_cpu_seconds_total``, read at every scrape: call it on the
        thread that runs the coordinator's event loop. Binding again replaces the previous
        thread.

        Returns:
            False where the platform has no per-thread CPU clocks (nothing exported).
        """
        clock_id = current_thread_cpu_clock()
        if clock_id is None:
            return False
        collector = LoopCPUCollector(self.prefix, clock_id)
        with self._lock:
            if self._loop_collector is not None:
                self.registry.unregister(self._loop_collector)
            self.registry.register(collector)
            self._loop_collector = collector
        return True

    def unbind_event_loop_thread(self) -> None:
        """Stop exporting the event-loop thread's CPU seconds (the service stopped);
        idempotent."""
        with self._lock:
            if self._loop_collector is not None:
                self.registry.unregister(self._loop_collector)
                self._loop_collector = None

    def observe_event_loop_lag(self, seconds: float) -> None:
        """Record how late the event loop ran a probe that was due, seconds (finite,
        >= 0; `cache_service.obs.loop.probe_loop_lag`)."""
        _check_seconds(seconds)
        self.event_loop_lag.observe(seconds)

    # -- control-plane state ---------------------------------------------------------------

    def bind_stats(
        self,
        fn: Callable[[], CacheStats],
        bytes_per_block: int | None = None,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        """Export the control plane's accounting, read from `fn()` at every scrape.

        Args:
            fn: returns a `CacheStats` (e.g. `block_manager.stats`).
            bytes_per_block: KV bytes of one block (`KVLayout.bytes_per_block`); defaults to
                the constructor's. Without either, the two byte gauges are not exported.
            loop: the asyncio loop that owns the block manager; `fn` then runs on it so a
                scrape never sees a half-applied change. None: `fn` runs on the scrape
                thread and must be thread-safe.
            timeout_s: seconds a scrape waits for the loop to run `fn`.

        Binding again replaces the previous source.
        """
        if not callable(fn):
            raise ValueError(f"fn must be callable, got {fn!r}")
        if bytes_per_block is not None:
            _check_positive_int("bytes_per_block", bytes_per_block)
        else:
            bytes_per_block = self._bytes_per_block
        if not (isinstance(timeout_s, int | float) and timeout_s > 0):
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
        binding = StatsBinding(fn, bytes_per_block, loop, float(timeout_s))
        collector = CacheStatsCollector(binding, self.prefix)
        with self._lock:
            if self._stats_collector is not None:
                self.registry.unregister(self._stats_collector)
            self.registry.register(collector)
            self._stats_collector = collector

    # -- exposition ------------------------------------------------------------------------

    def start_http_server(self, host: str = "127.0.0.1", port: int = 9400) -> MetricsHTTPServer:
        """Serve /metrics over HTTP in a background thread.

        Args:
            host: listen address ("0.0.0.0" in a container, loopback by default).
            port: TCP port; 0 picks a free one (read it from the result's `.port`).

        Returns:
            The running server; call `.stop()` to end it.
        """
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int in 0..65535, got {port!r}")
        server, thread = _start_http_server(port, addr=host, registry=self.registry)
        return MetricsHTTPServer(host, server.server_address[1], server, thread)


def _check_positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
