"""Assembling a running service: `start_service` and the `RunningService` it returns.

`start_service` starts workers (in-process, a local Ray or a Ray cluster), the coordinator
with its write-ahead store and tenant quotas, the gRPC server with authentication, in-flight
limits, health checking and reflection, the shared-memory regions of same-host clients, the
local sessions and the Prometheus endpoint, each a named step below. `RunningService.stop()`
drains: health turns NOT_SERVING, new calls are refused, calls in flight get
`shutdown_grace_s` to finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cache_service._proto.kvcache.v1 import kvcache_pb2_grpc as pb_grpc
from cache_service.api.auth import AuthInterceptor, TokenTable, load_token_table
from cache_service.api.inflight import InFlightLimiter, InFlightLimitInterceptor
from cache_service.api.local_sessions import Authenticate, LocalSessions
from cache_service.api.servicer import (
    DEFAULT_TENANT,
    METHOD_PERMISSIONS,
    SERVICE_NAME,
    KVCacheServicer,
)
from cache_service.api.wire_decode import RequestDecodeInterceptor
from cache_service.config import ServiceConfig
from cache_service.control.types import TenantQuota
from cache_service.engine.coordinator import Coordinator
from cache_service.engine.store import MetadataStore, StoreConfig
from cache_service.event_loop import loop_name
from cache_service.obs.loop import probe_loop_lag
from cache_service.wire.shared_regions import SharedRegions
from cache_service.wire.tls import ServerTLSConfig, server_credentials
from cache_service.wire.worker_channel import remove_orphan_arenas
from workers.layout import KVLayout

__all__ = ["RunningService", "server_torch_threads", "start_service"]

log = logging.getLogger("kvcache.server")


@dataclass
class RunningService:
    """A started service. `address` is "host:port" with the bound port; `shared_regions`
    the shared-memory regions of same-host clients (deleted at `stop`)."""

    config: ServiceConfig
    coordinator: Coordinator
    server: grpc.aio.Server
    port: int
    metrics: Any
    metrics_http: Any = None
    shared_regions: SharedRegions | None = None
    local_sessions: LocalSessions | None = None
    _servicer: KVCacheServicer | None = None
    _health: Any = None
    _cleanups: list[Callable[[], Any]] = field(default_factory=list)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _stopped: bool = False
    _froze: bool = False

    @property
    def address(self) -> str:
        host = self.config.server.host
        if host in ("0.0.0.0", "::", "[::]"):
            host = "127.0.0.1"
        return f"{host}:{self.port}"

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain and stop: NOT_SERVING, refuse new calls, wait up to grace_s for calls in
        flight, then stop background work, the metrics endpoint and the workers we started,
        and delete the shared-memory regions."""
        if self._stopped:
            return
        self._stopped = True
        grace = self.config.server.shutdown_grace_s if grace_s is None else grace_s
        log.info("shutting down", extra={"grace_s": grace})
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        if self._servicer is not None:
            self._servicer.end_sessions()
        if self.local_sessions is not None:
            await asyncio.gather(self.server.stop(grace), self.local_sessions.close(grace))
        else:
            await self.server.stop(grace)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.coordinator.close()
        if self._froze:
            _release_freeze()
        if self.metrics_http is not None:
            self.metrics_http.stop()
        for cleanup in self._cleanups:
            try:
                result = cleanup()
                if asyncio.iscoroutine(result):
                    await result
            except Exception:  # keep stopping the rest
                log.exception("cleanup failed")
        log.info("stopped")

    async def wait(self) -> None:
        """Until the server terminates."""
        await self.server.wait_for_termination()


def _pool_config(config: ServiceConfig, layout: KVLayout) -> Any:
    from workers.config import PoolConfig

    return PoolConfig(
        layout=layout,
        num_blocks=config.workers.blocks_per_worker,
        # Slot fingerprints exist for the online correctness check only.
        fingerprints=config.coordinator.correctness_check_fraction > 0,
        cuda_graphs=config.workers.cuda_graphs,
        warm_up_query_heads=config.workers.warm_up_query_heads,
        warm_up_max_batch=config.coordinator.max_batch_items,
        host_blocks=config.workers.host_tier_blocks,
    )


async def _start_workers(
    config: ServiceConfig, layout: KVLayout
) -> tuple[list[Any], list[Callable[[], Any]]]:
    """Worker clients per config, and the cleanups that stop what was started."""
    wc = config.workers
    if wc.in_process:
        from cache_service.engine.worker_clients import LocalWorkerClient

        device = "cuda" if wc.device == "cuda" else "cpu"
        # GPU pools answer per-layer calls on the event loop (see LocalWorkerClient.inline);
        # CPU pools compute attention on the host, which would stall the loop.
        clients = [
            LocalWorkerClient(
                f"{wc.name_prefix}{i}",
                _pool_config(config, layout),
                device,
                inline=device == "cuda",
            )
            for i in range(wc.num_workers)
        ]
        return clients, [c.close for c in clients]

    import ray

    from cache_service.engine.worker_clients import RayWorkerClient
    from cache_service.wire.worker_channel import ChannelOptions
    from workers import launcher

    launch = launcher.LaunchConfig(
        pool=_pool_config(config, layout),
        num_workers=wc.num_workers,
        ray_address=wc.ray_address,
        namespace=wc.namespace,
        name_prefix=wc.name_prefix,
        use_gpu=wc.device == "cuda",
        local_num_cpus=wc.ray_num_cpus,
        max_restarts=wc.max_restarts,
    )
    embedded = wc.ray_address is None
    started_ray = not ray.is_initialized()
    # Blocks the event loop while Ray starts: nothing is served yet, and ray.init wants the
    # main thread (it installs signal handlers there).
    handles = _launch_or_attach(launch, embedded)
    channel = None
    if wc.channel_arena_bytes:
        channel = ChannelOptions(
            arena_bytes=wc.channel_arena_bytes,
            connections=wc.channel_connections,
            remote=wc.channel_remote,
        )
    clients = [
        RayWorkerClient(
            launcher.worker_name(wc.name_prefix, i),
            h,
            call_timeout_s=config.coordinator.worker_timeout_s,
            channel=channel,
        )
        for i, h in enumerate(handles)
    ]
    cleanups: list[Callable[[], Any]] = [c.close for c in clients]
    if embedded:
        cleanups.append(lambda: launcher.shutdown_workers(wc.namespace, wc.name_prefix))
        if started_ray:
            cleanups.append(ray.shutdown)
    return clients, cleanups


def _launch_or_attach(launch: Any, embedded: bool) -> list[Any]:
    from workers import launcher
    from workers.errors import WorkersAlreadyExist

    try:
        return launcher.launch_workers(launch)
    except WorkersAlreadyExist:
        if embedded:
            raise
        # A cluster's detached workers outlive a coordinator: a restarted one attaches.
        log.info("attaching to running workers", extra={"prefix": launch.name_prefix})
        return launcher.attach_workers(launch.namespace, launch.name_prefix)


# Services of this process that froze the collector's objects (server.gc_freeze): the
# first freezes, the last to stop unfreezes (several may run at once in one process).
_freezes = 0


def _hold_freeze() -> None:
    """Collect, then freeze what is left (`gc.freeze`): from here on full collections walk
    only the objects made since. Garbage is collected first, so nothing dead is frozen."""
    global _freezes
    if _freezes == 0:
        gc.collect()
        gc.freeze()
    _freezes += 1


def _release_freeze() -> None:
    """One freezing service stopped; the last one hands the frozen objects back to the
    collector (garbage among them is collected as usual from then on)."""
    global _freezes
    _freezes -= 1
    if _freezes == 0:
        gc.unfreeze()


def _local_session_auth(auth: AuthInterceptor | None) -> Authenticate:
    """How a local session's hello is authenticated: as a gRPC Session stream with that
    authorization metadata would be (without authentication, everyone is accepted)."""
    if auth is None:
        return lambda authorization: (None, grpc.StatusCode.OK, "")
    method = f"/{SERVICE_NAME}/Session"

    def decide(authorization: str) -> tuple[Any, grpc.StatusCode, str]:
        metadata = (("authorization", authorization),) if authorization else ()
        return auth.decide(method, metadata)

    return decide


async def _probe_workers(coordinator: Coordinator, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            await coordinator.check_workers()
        except Exception:
            log.exception("worker probe failed")


def server_torch_threads(config: ServiceConfig) -> int | None:
    """The intra-op thread count the server process should use (None: torch's default);
    see ``ServerConfig.torch_threads``."""
    if config.server.torch_threads is not None:
        return config.server.torch_threads
    if config.workers.in_process and config.workers.device == "cpu":
        return None
    return 1


async def start_service(
    config: ServiceConfig,
    *,
    workers: list[Any] | None = None,
    metrics: Any = None,
) -> RunningService:
    """Start workers (unless given), the coordinator, the gRPC server and metrics.

    Args:
        config: the service configuration (port 0 binds a free port: see `.port`).
        workers: WorkerClients to use instead of starting workers (their owner stops them).
        metrics: a ServiceMetrics to use (default: a new one on a private registry).

    Raises:
        ConfigError / AuthConfigError / TLSConfigError: bad settings; WorkerLaunchError:
        workers could not start; RuntimeError: the port could not be bound.
    """
    from cache_service.obs.metrics import ServiceMetrics

    threads = server_torch_threads(config)
    if threads is not None:
        torch.set_num_threads(threads)
    layout = config.layout.kv_layout()
    table = load_token_table(config.auth_file) if config.auth_file else None
    tls = _tls_credentials(config)
    cleanups: list[Callable[[], Any]] = []
    if metrics is None:
        metrics = ServiceMetrics(bytes_per_block=layout.bytes_per_block)
    if workers is None:
        workers, cleanups = await _start_workers(config, layout)
    for w in workers:
        observe = getattr(w, "observe_data_calls", None)
        if observe is not None:  # the service's worker clients (a test's fakes may lack it)
            observe(metrics.add_worker_data_call)
    try:
        running = await _serve(config, layout, workers, metrics, table, tls, cleanups)
    except BaseException:
        for cleanup in cleanups:
            with contextlib.suppress(Exception):
                result = cleanup()
                if asyncio.iscoroutine(result):
                    await result
        raise
    _start_background_tasks(running)
    if config.server.gc_freeze:
        _hold_freeze()
        running._froze = True
    _log_serving(running, len(workers), layout, tls=tls is not None, auth=table is not None)
    return running


def _tls_credentials(config: ServiceConfig) -> grpc.ServerCredentials | None:
    """The server's TLS credentials (None: plaintext)."""
    if config.tls is None:
        return None
    return server_credentials(
        ServerTLSConfig(config.tls.cert_file, config.tls.key_file, config.tls.client_ca_file)
    )


async def _serve(
    config: ServiceConfig,
    layout: KVLayout,
    workers: list[Any],
    metrics: Any,
    table: TokenTable | None,
    tls: grpc.ServerCredentials | None,
    cleanups: list[Callable[[], Any]],
) -> RunningService:
    """Everything after the workers, up to a serving server; what stops each part is added
    to `cleanups` (the caller runs them if this raises)."""
    coordinator = await _start_coordinator(config, layout, workers, metrics, table, cleanups)
    auth = AuthInterceptor(table, METHOD_PERMISSIONS) if table is not None else None
    server = _grpc_server(config, metrics, auth)
    regions = _shared_regions(config, metrics, cleanups)
    servicer = KVCacheServicer(
        coordinator,
        config.server.max_message_bytes,
        config.server.stream_chunk_bytes,
        shared_regions=regions,
        metrics=metrics,
    )
    pb_grpc.add_KVCacheServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    port = _bind(server, config, tls)
    await server.start()
    local = None
    if config.server.local_sessions and tls is None:
        local = await _start_local_sessions(config, servicer, auth, metrics, cleanups)
    serving = health_pb2.HealthCheckResponse.SERVING
    await health_servicer.set("", serving)
    await health_servicer.set(SERVICE_NAME, serving)
    metrics_http = None
    if config.metrics.enabled:
        try:
            metrics_http = metrics.start_http_server(config.metrics.host, config.metrics.port)
        except BaseException:
            await server.stop(0)
            raise
    return RunningService(
        config=config,
        coordinator=coordinator,
        server=server,
        port=port,
        metrics=metrics,
        metrics_http=metrics_http,
        shared_regions=regions,
        local_sessions=local,
        _servicer=servicer,
        _health=health_servicer,
        _cleanups=cleanups,
    )


async def _start_coordinator(
    config: ServiceConfig,
    layout: KVLayout,
    workers: list[Any],
    metrics: Any,
    table: TokenTable | None,
    cleanups: list[Callable[[], Any]],
) -> Coordinator:
    """The started coordinator over `workers`: its write-ahead store, the token file's
    tenant quotas, its stats and event-loop thread bound to `metrics`."""
    # The write-ahead metadata store; a second coordinator on the same file fails here.
    store = MetadataStore(StoreConfig(config.store_path)) if config.store_path else None
    if store is not None:
        cleanups.insert(0, store.close)
    coordinator = Coordinator(layout, workers, config.coordinator, metrics, store=store)
    await coordinator.start()
    if table is not None:  # the token file's per-tenant quotas, enforced by the control plane
        policies = {t: table.policy(t) for t in table.tenants()}
        coordinator.set_tenant_quotas(
            {t: TenantQuota(p.max_blocks, p.max_sequences) for t, p in policies.items()}
        )
    metrics.bind_stats(coordinator.stats, loop=asyncio.get_running_loop())
    # The coordinator's work all runs on this thread: its CPU time is the service's load.
    metrics.bind_event_loop_thread()
    cleanups.append(metrics.unbind_event_loop_thread)
    return coordinator


def _grpc_server(
    config: ServiceConfig, metrics: Any, auth: AuthInterceptor | None
) -> grpc.aio.Server:
    """The gRPC server (not started) with its interceptors, outermost first: metrics,
    authentication, in-flight limits, request decoding."""
    interceptors: list[grpc.aio.ServerInterceptor] = [metrics.rpc_interceptor()]
    if auth is not None:
        interceptors.append(auth)
    if config.server.max_in_flight_per_client > 0:  # after auth: counts know the tenant
        limiter = InFlightLimiter(config.server.max_in_flight_per_client)
        interceptors.append(InFlightLimitInterceptor(limiter, f"/{SERVICE_NAME}/"))
    # Innermost: requests that do not parse become INVALID_ARGUMENT, not UNKNOWN.
    interceptors.append(RequestDecodeInterceptor(f"/{SERVICE_NAME}/"))
    limit = config.server.max_message_bytes
    return grpc.aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.max_send_message_length", limit),
            ("grpc.max_receive_message_length", limit),
            # Refuse a port another process already serves instead of sharing it.
            ("grpc.so_reuseport", 0),
        ],
    )


def _shared_regions(
    config: ServiceConfig, metrics: Any, cleanups: list[Callable[[], Any]]
) -> SharedRegions:
    """The shared-memory regions of same-host clients (their files deleted at stop, or if
    the start fails from here on), after removing what a killed coordinator left."""
    # Pools on CUDA in this process copy request tensors straight out of pinned regions;
    # worker channels copy them into their arenas: both read regions in place.
    pin = config.workers.in_process and config.workers.device == "cuda"
    channels = not config.workers.in_process and config.workers.channel_arena_bytes > 0
    regions = SharedRegions(
        config.shared_memory,
        on_change=metrics.set_shared_memory,
        pin_for_cuda=pin,
        zero_copy=pin or channels,
        share_with_workers=channels,
    )
    cleanups.append(regions.close)
    # What a coordinator killed on this host left (it never ran its own cleanups).
    regions.remove_orphans()
    remove_orphan_arenas()
    return regions


def _bind(
    server: grpc.aio.Server, config: ServiceConfig, tls: grpc.ServerCredentials | None
) -> int:
    """Bind the configured address (TLS when `tls`); the bound port."""
    address = f"{config.server.host}:{config.server.port}"
    port = (
        server.add_secure_port(address, tls)
        if tls is not None
        else server.add_insecure_port(address)
    )
    if port == 0:
        raise RuntimeError(f"could not bind {address} (in use, or not a local address)")
    return port


async def _start_local_sessions(
    config: ServiceConfig,
    servicer: KVCacheServicer,
    auth: AuthInterceptor | None,
    metrics: Any,
    cleanups: list[Callable[[], Any]],
) -> LocalSessions | None:
    """The local sessions' Unix socket, serving `servicer`'s session calls (None: the
    default directory could not be used, and the service runs without them)."""
    local = LocalSessions(
        functools.partial(servicer._session_call, local=True),
        _local_session_auth(auth),
        DEFAULT_TENANT,
        config.server.max_message_bytes,
        on_change=metrics.set_local_sessions,
        serve_now=(servicer.session_call_now if config.server.local_session_callbacks else None),
    )
    try:
        servicer.local_session_socket = await local.start(config.server.local_session_dir)
        cleanups.insert(0, functools.partial(local.close, 0.0))
    except (OSError, ValueError) as exc:
        if config.server.local_session_dir is not None:
            raise  # a directory asked for by name must work
        # An optimization for same-host clients: serve without it rather than not.
        log.warning("local sessions off: %s", exc)
        return None
    return local


def _start_background_tasks(running: RunningService) -> None:
    """The service's periodic work (stopped by `RunningService.stop`): the event-loop lag
    probe, the worker health probe, the reaper of abandoned shared regions."""
    config = running.config
    loop = asyncio.get_running_loop()
    if config.metrics.event_loop_lag_interval_s > 0:
        running._tasks.append(
            loop.create_task(
                probe_loop_lag(
                    running.metrics.observe_event_loop_lag,
                    config.metrics.event_loop_lag_interval_s,
                )
            )
        )
    if config.coordinator.health_check_interval_s > 0:
        running._tasks.append(
            loop.create_task(
                _probe_workers(running.coordinator, config.coordinator.health_check_interval_s)
            )
        )
    regions = running.shared_regions
    if regions is not None and regions.enabled:
        running._tasks.append(loop.create_task(regions.reap_forever()))


def _log_serving(
    running: RunningService, num_workers: int, layout: KVLayout, *, tls: bool, auth: bool
) -> None:
    """Log what serves where (and warn when the configured event loop is not the one)."""
    loop_kind = loop_name()
    if running.config.server.event_loop == "uvloop" and loop_kind != "uvloop":
        # start_service runs on its caller's loop; event_loop.run makes the configured one.
        log.warning(
            "server.event_loop is 'uvloop' but the service was started on asyncio's loop "
            "(run it with cache_service.event_loop.run)"
        )
    regions = running.shared_regions
    local = running.local_sessions
    log.info(
        "serving",
        extra={
            "address": running.address,
            "event_loop": loop_kind,
            "workers": num_workers,
            "layout": layout.fingerprint(),
            "tls": tls,
            "auth": auth,
            "metrics": running.metrics_http.url if running.metrics_http else None,
            "shared_memory": regions.directory if regions is not None and regions.enabled else None,
            "local_sessions": local.path if local is not None else None,
        },
    )
