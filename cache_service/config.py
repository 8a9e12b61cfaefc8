"""Service configuration: dataclasses, loaded from a YAML file and overridden by CLI flags.

A file mirrors the dataclasses, one section per group; every field is optional::

    layout:      {num_layers: 4, num_kv_heads: 2, head_dim: 64, block_size: 16, dtype: float32}
    workers:     {num_workers: 2, blocks_per_worker: 512, host_tier_blocks: 0, device: cpu,
                  ray_address: null}
    server:      {host: 127.0.0.1, port: 50051, max_message_bytes: 268435456}
    coordinator: {batch_window_ms: 0.5, max_batch_items: 256, coalesce_layers: true,
                  eviction_policy: lru, kv_event_ring: 4096}
    metrics:     {enabled: true, host: 127.0.0.1, port: 9400}
    shared_memory: {enabled: true, max_region_bytes: 268435456, max_regions_per_tenant: 16,
                    max_total_bytes: 4294967296, idle_timeout_s: 600}
    auth_file: null          # token file (cache_service.api.auth); null: no authentication
    tls: null                # {cert_file, key_file, client_ca_file}; null: plaintext
    store_path: null         # write-ahead metadata store (SQLite); null: none (cache_service.engine.store)
    log_level: INFO
    log_format: text         # or json (one JSON object per line)

Unknown keys and ill-typed values raise ConfigError naming the key. Pure: imports neither
torch, Ray nor gRPC.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cache_service.control.eviction import DEFAULT_EVICTION_POLICY, check_policy_name
from cache_service.event_loop import EVENT_LOOPS

__all__ = [
    "ConfigError",
    "CoordinatorConfig",
    "LayoutConfig",
    "MetricsConfig",
    "ServerConfig",
    "ServiceConfig",
    "SharedMemoryConfig",
    "TLSFilesConfig",
    "WorkersConfig",
    "load_config",
]

_DTYPES = ("float16", "bfloat16", "float32")
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
MiB = 1 << 20
GiB = 1 << 30


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range; the message names it."""


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def _port(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise ConfigError(
            f"{name} must be a TCP port in 0..65535 (0: any free port), got {value!r}"
        )


def _non_negative(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ConfigError(f"{name} must be a number >= 0, got {value!r}")


@dataclass(frozen=True)
class LayoutConfig:
    """The KV layout every worker pool uses (see workers.layout.KVLayout).

    Attributes:
        num_layers: attention layers.
        num_kv_heads: key/value heads per layer.
        head_dim: channels per head.
        block_size: token slots per block.
        dtype: "float16" | "bfloat16" | "float32" (bfloat16 on GPUs; CPU workers compute in
            the torch reference, where float32 is the fast and exact choice).
    """

    num_layers: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    block_size: int = 16
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            _positive_int(f"layout.{name}", getattr(self, name))
        if self.dtype not in _DTYPES:
            raise ConfigError(f"layout.dtype must be one of {list(_DTYPES)}, got {self.dtype!r}")

    def kv_layout(self) -> Any:
        """This layout as a `workers.layout.KVLayout`."""
        from workers.layout import KVLayout

        return KVLayout(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_size=self.block_size,
            dtype=self.dtype,
        )


@dataclass(frozen=True)
class WorkersConfig:
    """How the worker pools are started.

    Attributes:
        num_workers: pools to start (one per GPU on a GPU cluster).
        blocks_per_worker: blocks in each pool.
        host_tier_blocks: blocks of each worker's host tier (cache_service.control.host_tier,
            workers.host_tier): host memory, page-locked for CUDA pools, that cached prefix
            blocks evicted from the pool move to, so a later prompt still hits them (they
            are copied back first). Same block size as the pool's (layout.bytes_per_block
            each: 2 MiB for Llama-3.1-8B in bf16). 0 (default): off, evicted blocks are
            dropped.
        device: "cpu" or "cuda": CPU workers run the torch reference kernels, CUDA workers
            the Triton kernels (one GPU each).
        ray_address: None starts a local Ray (embedded); "auto" or "ray://host:port" joins
            a running cluster.
        in_process: run the pools inside the coordinator's process (no Ray): the fastest
            start, for tests and single-process use.
        namespace: Ray namespace of the named worker actors.
        name_prefix: worker actor names are "<prefix><i>"; restart-safe ids.
        ray_num_cpus: CPUs given to an embedded Ray (None: Ray's default).
        max_restarts: how often Ray restarts a worker that died (-1: always). A restarted
            worker comes back empty, with a new epoch; the coordinator registers it again.
        cuda_graphs: CUDA pools replay a decode step's per-layer write-and-attend as a CUDA
            graph once it repeats (workers.decode_graphs): one launch instead of three.
        warm_up_query_heads: the query head counts of the models served (e.g. [32]): CUDA
            pools compile their decode kernels for them at start, about a second per
            variant the first time on a host (Triton caches them on disk), instead of
            while serving. Empty (default): compiled on first use.
        channel_arena_bytes: the arena of each worker channel, bytes: Ray workers get their
            per-layer data calls straight from the coordinator (cache_service.
            worker_channel), a fraction of a Ray call's cost: on the coordinator's node
            over a Unix socket with the tensors in this much shared memory, on other nodes
            over TCP (see channel_remote). A call whose tensors do not fit goes through
            Ray. 0: every call through Ray.
        channel_connections: worker channels per worker (calls in flight on it at once).
        channel_remote: reach workers on other nodes over TCP (each such worker listens
            on its node's address, on a free port, for holders of a token it hands out
            over Ray); false: their calls go through Ray.
    """

    num_workers: int = 2
    blocks_per_worker: int = 512
    host_tier_blocks: int = 0
    device: str = "cpu"
    ray_address: str | None = None
    in_process: bool = False
    namespace: str = "kvcache"
    name_prefix: str = "kvcache-worker-"
    ray_num_cpus: int | None = None
    max_restarts: int = -1
    cuda_graphs: bool = True
    warm_up_query_heads: tuple[int, ...] = ()
    channel_arena_bytes: int = 32 << 20
    channel_connections: int = 2
    channel_remote: bool = True

    def __post_init__(self) -> None:
        _positive_int("workers.num_workers", self.num_workers)
        _positive_int("workers.channel_connections", self.channel_connections)
        if not isinstance(self.channel_remote, bool):
            raise ConfigError(
                f"workers.channel_remote must be true or false, got {self.channel_remote!r}"
            )
        if (
            isinstance(self.channel_arena_bytes, bool)
            or not isinstance(self.channel_arena_bytes, int)
            or (self.channel_arena_bytes != 0 and self.channel_arena_bytes < 1 << 16)
        ):
            raise ConfigError(
                "workers.channel_arena_bytes must be 0 (no channel) or at least 65536, got "
                f"{self.channel_arena_bytes!r}"
            )
        _positive_int("workers.blocks_per_worker", self.blocks_per_worker)
        if (
            isinstance(self.host_tier_blocks, bool)
            or not isinstance(self.host_tier_blocks, int)
            or self.host_tier_blocks < 0
        ):
            raise ConfigError(
                "workers.host_tier_blocks must be an integer >= 0 (0: no host tier), got "
                f"{self.host_tier_blocks!r}"
            )
        if not isinstance(self.cuda_graphs, bool):
            raise ConfigError(
                f"workers.cuda_graphs must be true or false, got {self.cuda_graphs!r}"
            )
        if not isinstance(self.warm_up_query_heads, tuple) or any(
            isinstance(h, bool) or not isinstance(h, int) or h < 1 for h in self.warm_up_query_heads
        ):
            raise ConfigError(
                "workers.warm_up_query_heads must be a list of positive integers, got "
                f"{self.warm_up_query_heads!r}"
            )
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"workers.device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.ray_num_cpus is not None:
            _positive_int("workers.ray_num_cpus", self.ray_num_cpus)
        if not self.name_prefix:
            raise ConfigError("workers.name_prefix must not be empty")
        if isinstance(self.max_restarts, bool) or not (
            isinstance(self.max_restarts, int) and self.max_restarts >= -1
        ):
            raise ConfigError(
                f"workers.max_restarts must be an integer >= -1, got {self.max_restarts!r}"
            )


@dataclass(frozen=True)
class ServerConfig:
    """The gRPC endpoint.

    Attributes:
        host: listen address ("0.0.0.0" to serve other machines).
        port: TCP port; 0 binds any free port (the server reports the bound one).
        max_message_bytes: largest request or response message, bytes. Attend /
            append-and-attend payloads must fit; Append, export and import stream.
        stream_chunk_bytes: data bytes per message of export streams (and what the client
            uses for Append / import).
        shutdown_grace_s: seconds in-flight calls get to finish at shutdown.
        max_in_flight_per_client: calls one client connection may have in flight; more are
            refused with RESOURCE_EXHAUSTED (cache_service.api.inflight). 0: no limit.
        local_sessions: also serve Session messages over a Unix domain socket on this
            host (cache_service.api.local_sessions): a same-host client's per-layer calls then
            skip gRPC's threads on both sides. Only the server's user can connect;
            authentication is the same. Not offered by a TLS server.
        local_session_dir: where the socket's private directory is made (default: the
            system's temporary directory). A directory named here must exist and be
            writable, else the server does not start; with the default, a server that
            cannot make its socket logs a warning and serves without local sessions.
        local_session_callbacks: answer a local session's repeated decode layer (a
            decode-memo hit) from its worker round's completion callback, without a task
            per call. False sends every call through a task, as a gRPC Session's are: the
            same answers, more Python per call (for comparing and diagnosing the two paths).
        gc_freeze: once serving, move every object that exists to the collector's
            permanent generation (`gc.freeze`; undone at stop): full collections then walk
            only what was made since, not the hundreds of thousands of long-lived objects of
            torch, Triton and gRPC. Without it a full collection stalled the event loop for
            about 100 ms on a 2-core host (benchmarks/results/archive/service-cpu.md).
        torch_threads: torch intra-op CPU threads in the server process. None (default):
            torch's own choice when the pools run in-process on the CPU (their attention
            uses them), else 1: the coordinator's tensor work is small copies and checks,
            where a thread pool per core only adds wake-up latency and spinning threads
            that compete with the event loop.
        event_loop: the event loop `kvcache serve` (and the embedded demo and bench) runs
            the service on (cache_service.event_loop): "asyncio" (default) or "uvloop"
            (installed with the `uvloop` extra; refused at start where it is missing). On
            the H200 host uvloop measured no better (cache_service.event_loop says how).
    """

    host: str = "127.0.0.1"
    port: int = 50051
    max_message_bytes: int = 256 * MiB
    stream_chunk_bytes: int = 2 * MiB
    shutdown_grace_s: float = 10.0
    max_in_flight_per_client: int = 128
    local_sessions: bool = True
    local_session_dir: str | None = None
    local_session_callbacks: bool = True
    gc_freeze: bool = True
    torch_threads: int | None = None
    event_loop: str = "asyncio"

    def __post_init__(self) -> None:
        if self.event_loop not in EVENT_LOOPS:
            raise ConfigError(
                f"server.event_loop must be one of {', '.join(EVENT_LOOPS)}, got "
                f"{self.event_loop!r}"
            )
        if self.torch_threads is not None:
            _positive_int("server.torch_threads", self.torch_threads)
        if not self.host:
            raise ConfigError("server.host must not be empty")
        _port("server.port", self.port)
        if not isinstance(self.gc_freeze, bool):
            raise ConfigError(f"server.gc_freeze must be true or false, got {self.gc_freeze!r}")
        for name in ("local_sessions", "local_session_callbacks"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(
                    f"server.{name} must be true or false, got {getattr(self, name)!r}"
                )
        if self.local_session_dir is not None and not (
            isinstance(self.local_session_dir, str) and self.local_session_dir
        ):
            raise ConfigError(
                "server.local_session_dir must be a directory path or null, got "
                f"{self.local_session_dir!r}"
            )
        _positive_int("server.max_message_bytes", self.max_message_bytes)
        _positive_int("server.stream_chunk_bytes", self.stream_chunk_bytes)
        if self.stream_chunk_bytes > self.max_message_bytes // 2:
            raise ConfigError(
                "server.stream_chunk_bytes must be at most half of server.max_message_bytes "
                f"({self.max_message_bytes // 2}), got {self.stream_chunk_bytes}"
            )
        _non_negative("server.shutdown_grace_s", self.shutdown_grace_s)
        if isinstance(self.max_in_flight_per_client, bool) or not (
            isinstance(self.max_in_flight_per_client, int) and self.max_in_flight_per_client >= 0
        ):
            raise ConfigError(
                "server.max_in_flight_per_client must be an integer >= 0 (0: no limit), got "
                f"{self.max_in_flight_per_client!r}"
            )


@dataclass(frozen=True)
class CoordinatorConfig:
    """How the coordinator drives the workers.

    Attributes:
        batch_window_ms: the longest the first request for a worker (and layer, without
            coalesce_layers) waits for
            others to join its worker call, milliseconds. The window is adaptive: while the
            recent calls of that (worker, layer) came one at a time, a request that finds
            no worker call in flight goes at once (a lone caller pays no window); once
            other requests arrive while one gathers or is in flight, the window applies
            again. Requests arriving while a call is in flight always gather into the next
            call. A window ends early once every client of the last rounds has its
            requests waiting (clients calling in step wait for each other, not for the
            clock). 0 still merges requests that arrive in the same event-loop turn.
        max_batch_items: a worker call is sent at once when it holds this many sequences.
        worker_timeout_s: a worker call taking longer counts as a lost worker.
        health_check_interval_s: how often idle workers are probed for a restart (a new
            epoch) or death, seconds; 0 disables the probe (failed calls still notice).
        tenant_quota_blocks: blocks any one tenant may hold (None: no quota).
        eviction_policy: which cached-free block a pool evicts when it needs one and has
            no free block (cache_service.control.eviction; docs/architecture.md "Eviction order"):
            "lru" (least recently released first) is the one built in. A write-ahead store
            must be reopened with the policy it was written with.
        correctness_check_fraction: share of worker rounds (attend / append-and-attend)
            recomputed by the torch reference and compared, in [0, 1]; 0 disables the
            online correctness check (cache_service.engine.correctness_check). Rounds that merged
            calls of several layers are not sampled. A checked round answers its callers
            first; its check runs beside the traffic (kvcache_correctness_check_seconds
            shows how long), its recomputation outside the worker's lock.
        correctness_check_sequences: check at most this many sequences of a sampled round,
            drawn at random (None: all of them). Bounds what a check costs its round, at
            the price of coverage per check; rounds whose sequences span several workers
            are checked whole.
        coalesce_layers: merge concurrent calls for different layers of one worker into
            one worker call as well (one launch of each kernel over pages of every layer,
            `KVPool.run_round`), not only calls for the same layer: clients
            decoding layer by layer are rarely at the same layer at once.
        overlap_rounds: clients calling in step take turns in two groups, one group's
            worker call in flight while the coordinator takes in the other's requests,
            instead of one worker call for all of them while the coordinator waits; costs
            one more worker call per round of every client. None (default): on for
            workers in another process (Ray actors: the coordinator's event loop is free
            while their calls run), off for workers in the coordinator's process (their
            calls hold its event loop).
        kv_event_ring: KV events kept in memory (and in the store's checkpoints) for
            subscribers resuming from an earlier number (SubscribeKvEvents); one asking for
            an older one gets OUT_OF_RANGE. An event costs about 150 bytes in a checkpoint
            plus about 70 per key it carries (a stored chain carries one per block).
        step_lease_timeout_s: the longest a step lease lives (StepLease: a co-located
            client runs a planned step on the worker's pool itself), seconds; a lease whose
            client is still running it then is waited for as long again before it is
            revoked (its connection closed, nothing committed). 0 grants none (every layer
            through the coordinator).
        max_lease_steps: the most decode steps one step lease covers (a StepLease asking
            for more gets this many): the lease reserves each sequence's next positions
            for all of them at once, and its client plans the steps between itself, so
            the coordinator's work per step is divided by their number. 1: a lease per
            forward.
    """

    batch_window_ms: float = 0.5
    max_batch_items: int = 256
    worker_timeout_s: float = 60.0
    health_check_interval_s: float = 5.0
    tenant_quota_blocks: int | None = None
    eviction_policy: str = DEFAULT_EVICTION_POLICY
    correctness_check_fraction: float = 0.01
    correctness_check_sequences: int | None = None
    coalesce_layers: bool = True
    overlap_rounds: bool | None = None
    kv_event_ring: int = 4096
    step_lease_timeout_s: float = 5.0
    max_lease_steps: int = 16

    def __post_init__(self) -> None:
        _non_negative("coordinator.batch_window_ms", self.batch_window_ms)
        _positive_int("coordinator.max_lease_steps", self.max_lease_steps)
        from workers.step_leases import MAX_STEPS  # the lease wire's bound

        if self.max_lease_steps > MAX_STEPS:
            raise ConfigError(
                f"coordinator.max_lease_steps must be at most {MAX_STEPS}, got {self.max_lease_steps}"
            )
        _non_negative("coordinator.step_lease_timeout_s", self.step_lease_timeout_s)
        _positive_int("coordinator.kv_event_ring", self.kv_event_ring)
        _positive_int("coordinator.max_batch_items", self.max_batch_items)
        if not (isinstance(self.worker_timeout_s, int | float) and self.worker_timeout_s > 0):
            raise ConfigError(
                f"coordinator.worker_timeout_s must be > 0 seconds, got {self.worker_timeout_s!r}"
            )
        _non_negative("coordinator.health_check_interval_s", self.health_check_interval_s)
        if self.tenant_quota_blocks is not None:
            _positive_int("coordinator.tenant_quota_blocks", self.tenant_quota_blocks)
        try:
            check_policy_name(self.eviction_policy)
        except ValueError as exc:
            raise ConfigError(f"coordinator.eviction_policy: {exc}") from None
        _non_negative("coordinator.correctness_check_fraction", self.correctness_check_fraction)
        if self.correctness_check_sequences is not None:
            _positive_int(
                "coordinator.correctness_check_sequences", self.correctness_check_sequences
            )
        if self.overlap_rounds is not None and not isinstance(self.overlap_rounds, bool):
            raise ConfigError(
                "coordinator.overlap_rounds must be true, false or null (by the workers), "
                f"got {self.overlap_rounds!r}"
            )
        if not isinstance(self.coalesce_layers, bool):
            raise ConfigError(
                f"coordinator.coalesce_layers must be true or false, got {self.coalesce_layers!r}"
            )
        if self.correctness_check_fraction > 1:
            raise ConfigError(
                "coordinator.correctness_check_fraction must be in [0, 1], got "
                f"{self.correctness_check_fraction!r}"
            )


@dataclass(frozen=True)
class MetricsConfig:
    """The Prometheus /metrics endpoint (port 0: any free port).

    Attributes:
        enabled: serve /metrics over HTTP.
        host, port: where it listens.
        event_loop_lag_interval_s: how often the coordinator's event loop is probed for its
            lag (`kvcache_event_loop_lag_seconds`), seconds; 0 disables the probe.
    """

    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = 9400
    event_loop_lag_interval_s: float = 0.5

    def __post_init__(self) -> None:
        _port("metrics.port", self.port)
        _non_negative("metrics.event_loop_lag_interval_s", self.event_loop_lag_interval_s)
        if not math.isfinite(self.event_loop_lag_interval_s):
            raise ConfigError(
                "metrics.event_loop_lag_interval_s must be a finite number of seconds, got "
                f"{self.event_loop_lag_interval_s!r}"
            )


@dataclass(frozen=True)
class SharedMemoryConfig:
    """Shared-memory regions for the tensors of same-host clients' batch calls
    (CreateSharedRegion; cache_service.wire.shared_regions).

    Attributes:
        enabled: serve CreateSharedRegion. False: it answers FAILED_PRECONDITION and clients
            send tensors as bytes.
        max_region_bytes: largest region, bytes.
        max_regions_per_tenant: regions one tenant may hold at once.
        max_total_bytes: bytes of all regions of all tenants together (they live in
            /dev/shm, i.e. in memory).
        idle_timeout_s: a region no call used for this long is released by the server,
            seconds (a client that died never releases its own).
    """

    enabled: bool = True
    max_region_bytes: int = 256 * MiB
    max_regions_per_tenant: int = 16
    max_total_bytes: int = 4 * GiB
    idle_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"shared_memory.enabled must be true or false, got {self.enabled!r}")
        _positive_int("shared_memory.max_region_bytes", self.max_region_bytes)
        _positive_int("shared_memory.max_regions_per_tenant", self.max_regions_per_tenant)
        _positive_int("shared_memory.max_total_bytes", self.max_total_bytes)
        if self.max_region_bytes > self.max_total_bytes:
            raise ConfigError(
                "shared_memory.max_region_bytes must be at most shared_memory.max_total_bytes "
                f"({self.max_total_bytes}), got {self.max_region_bytes}"
            )
        if (
            isinstance(self.idle_timeout_s, bool)
            or not isinstance(self.idle_timeout_s, int | float)
            or not self.idle_timeout_s > 0
        ):
            raise ConfigError(
                f"shared_memory.idle_timeout_s must be > 0 seconds, got {self.idle_timeout_s!r}"
            )


@dataclass(frozen=True)
class TLSFilesConfig:
    """PEM files of the server's TLS (client_ca_file set: mutual TLS)."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None


@dataclass(frozen=True)
class ServiceConfig:
    """Everything `kvcache serve` needs. See the module docstring for the file format."""

    layout: LayoutConfig = field(default_factory=LayoutConfig)
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    coordinator: CoordinatorConfig = field(default_factory=CoordinatorConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    shared_memory: SharedMemoryConfig = field(default_factory=SharedMemoryConfig)
    auth_file: str | None = None
    tls: TLSFilesConfig | None = None
    store_path: str | None = None
    log_level: str = "INFO"
    log_format: str = "text"

    def __post_init__(self) -> None:
        if self.log_level not in _LOG_LEVELS:
            raise ConfigError(
                f"log_level must be one of {list(_LOG_LEVELS)}, got {self.log_level!r}"
            )
        if self.log_format not in ("text", "json"):
            raise ConfigError(f"log_format must be 'text' or 'json', got {self.log_format!r}")
        hkv = self.layout.num_kv_heads
        odd = [h for h in self.workers.warm_up_query_heads if h % hkv]
        if odd:
            raise ConfigError(
                f"workers.warm_up_query_heads must be multiples of layout.num_kv_heads ({hkv}), "
                f"got {odd}"
            )

    def with_overrides(self, overrides: Mapping[str, Any]) -> ServiceConfig:
        """A copy with dotted keys replaced, e.g. {"server.port": 0, "auth_file": "t.yaml"}.

        None values are skipped, so unset CLI flags can be passed through unchanged.
        """
        doc = to_dict(self)
        for key, value in overrides.items():
            if value is None:
                continue
            parts = key.split(".")
            node = doc
            for part in parts[:-1]:
                if not isinstance(node.get(part), dict):
                    if part in node and node[part] is None:
                        node[part] = {}
                    else:
                        raise ConfigError(f"unknown configuration key {key!r}")
                node = node[part]
            node[parts[-1]] = value
        return from_dict(doc)


def to_dict(config: Any) -> dict[str, Any]:
    """The configuration as plain nested dicts (what a YAML file holds)."""
    return dataclasses.asdict(config)


def _build(cls: type, raw: Any, where: str) -> Any:
    if not isinstance(raw, Mapping):
        raise ConfigError(
            f"{where or 'the configuration'} must be a mapping, got {type(raw).__name__}"
        )
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(raw) - known
    if unknown:
        raise ConfigError(
            f"unknown key(s) {sorted(map(str, unknown))} in {where or 'the configuration'}; "
            f"allowed: {sorted(known)}"
        )
    kwargs = {}
    for name, value in raw.items():
        key = f"{where}.{name}" if where else name
        kwargs[name] = _convert(hints[name], value, key)
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required field is missing
        raise ConfigError(f"{where or 'the configuration'}: {exc}") from None


def _convert(hint: Any, value: Any, key: str) -> Any:
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, value, key)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, key)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        return float(value)
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return value
    if typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return tuple(_convert(args[0], v, f"{key}[{i}]") for i, v in enumerate(value))
    raise ConfigError(f"{key}: unsupported type {hint!r}")  # pragma: no cover - a code bug


def from_dict(doc: Mapping[str, Any]) -> ServiceConfig:
    """Build and validate a ServiceConfig from nested dicts; raises ConfigError."""
    return _build(ServiceConfig, doc, "")


def load_config(path: str | Path | None = None) -> ServiceConfig:
    """Read a YAML configuration file (None: the defaults)."""
    if path is None:
        return ServiceConfig()
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read configuration: {exc.strerror}") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    try:
        return from_dict(doc or {})
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
