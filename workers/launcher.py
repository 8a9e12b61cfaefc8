"""Start, find and stop the named, detached PoolWorker actors.

Workers are named ``<name_prefix><i>`` in a Ray namespace and created with
``lifetime="detached"``, so they outlive the process that launched them: a restarted
coordinator finds them again with :func:`attach_workers` (their epochs tell it whether
their pools survived). On a GPU cluster one worker per GPU is placed through a detached
placement group (one bundle per worker, spread over the nodes); on a CPU machine N workers
run the torch path with ``num_gpus=0``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from workers.actor import PoolWorkerActor
from workers.config import PoolConfig
from workers.errors import WorkerLaunchError, WorkersAlreadyExist
from workers.ray_startup import start_local_ray

__all__ = [
    "LaunchConfig",
    "attach_workers",
    "connect_ray",
    "launch_workers",
    "placement_group_name",
    "shutdown_workers",
    "worker_name",
]


@dataclass(frozen=True)
class LaunchConfig:
    """Where and how many workers to start.

    Attributes:
        pool: each worker's pool (block count or memory fraction, layout, debug).
        num_workers: workers to start; None = one per GPU of the cluster.
        ray_address: None starts a local Ray in this process; otherwise the address of a
            running cluster ("auto", "ray://host:10001", "host:6379").
        namespace: Ray namespace of the named actors.
        name_prefix: actor names are ``f"{name_prefix}{i}"``.
        use_gpu: place workers on GPUs; None = when the cluster has any.
        gpus_per_worker: GPU share of one worker (1 = a whole GPU; a fraction lets several
            workers share one GPU, for tests).
        cpus_per_worker: CPUs Ray reserves for each worker.
        max_restarts: how often Ray restarts a dead worker (-1: forever). A restart has a
            new epoch and an empty pool.
        local_num_cpus: CPUs of a Ray started locally (None: Ray's default).
        torch_threads: torch intra-op threads in each CPU worker (None: Ray's default).
        ready_timeout_s: seconds to wait for the placement group and the pools.
    """

    pool: PoolConfig
    num_workers: int | None = None
    ray_address: str | None = None
    namespace: str = "kvcache"
    name_prefix: str = "kvcache-worker-"
    use_gpu: bool | None = None
    gpus_per_worker: float = 1.0
    cpus_per_worker: float = 0.0
    max_restarts: int = 0
    local_num_cpus: int | None = None
    torch_threads: int | None = 1
    ready_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if not isinstance(self.pool, PoolConfig):
            raise WorkerLaunchError(
                f"LaunchConfig.pool must be a PoolConfig, got {type(self.pool).__name__}"
            )
        if self.num_workers is not None and (
            isinstance(self.num_workers, bool)
            or not isinstance(self.num_workers, int)
            or self.num_workers < 1
        ):
            raise WorkerLaunchError(
                f"LaunchConfig.num_workers must be a positive int or None (one per GPU), got "
                f"{self.num_workers!r}"
            )
        if not self.name_prefix or not self.namespace:
            raise WorkerLaunchError("LaunchConfig.name_prefix and namespace must not be empty")
        g = self.gpus_per_worker
        if not (isinstance(g, int | float) and g > 0 and (g <= 1 or g == int(g))):
            raise WorkerLaunchError(
                "LaunchConfig.gpus_per_worker must be a fraction in (0, 1] or a whole number, "
                f"got {self.gpus_per_worker!r}"
            )
        if self.cpus_per_worker < 0:
            raise WorkerLaunchError(
                f"LaunchConfig.cpus_per_worker must be >= 0, got {self.cpus_per_worker!r}"
            )
        if not isinstance(self.max_restarts, int) or self.max_restarts < -1:
            raise WorkerLaunchError(
                f"LaunchConfig.max_restarts must be an int >= -1, got {self.max_restarts!r}"
            )
        if not self.ready_timeout_s > 0:
            raise WorkerLaunchError(
                f"LaunchConfig.ready_timeout_s must be > 0, got {self.ready_timeout_s!r}"
            )


def worker_name(name_prefix: str, index: int) -> str:
    """The actor name (and worker id) of worker ``index``."""
    return f"{name_prefix}{index}"


def placement_group_name(name_prefix: str) -> str:
    """The name of the detached placement group of a prefix's GPU workers."""
    return f"{name_prefix}placement"


def connect_ray(address: str | None, namespace: str, *, local_num_cpus: int | None = None) -> None:
    """Make sure this process is connected to Ray.

    Args:
        address: None starts a fresh local Ray (never joins one found on the machine by
            accident); otherwise the cluster to join.
        namespace: namespace of this Ray job (used only when this call connects).
        local_num_cpus: CPUs of a local Ray.
    """
    if ray.is_initialized():
        return
    if address is None:
        start_local_ray(namespace, num_cpus=local_num_cpus)
    else:
        ray.init(address=address, namespace=namespace, log_to_driver=False)


def _existing_names(namespace: str, name_prefix: str) -> list[str]:
    """Names of live named actors ``<prefix><digits>`` in ``namespace``, by index."""
    pattern = re.compile(re.escape(name_prefix) + r"(\d+)")
    found = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] != namespace:
            continue
        match = pattern.fullmatch(entry["name"])
        if match:
            found.append((int(match.group(1)), entry["name"]))
    return [name for _, name in sorted(found)]


def _plan_gpu_workers(config: LaunchConfig) -> tuple[bool, int]:
    """(use_gpu, number of workers) for ``config`` on the connected cluster."""
    gpus = ray.cluster_resources().get("GPU", 0.0)
    use_gpu = config.use_gpu if config.use_gpu is not None else gpus > 0
    if use_gpu and gpus <= 0:
        raise WorkerLaunchError("use_gpu=True but the Ray cluster reports no GPU")
    if config.num_workers is not None:
        return use_gpu, config.num_workers
    if not use_gpu:
        raise WorkerLaunchError(
            "num_workers=None means one worker per GPU, but the cluster has no GPU (or "
            "use_gpu=False): give num_workers for CPU workers"
        )
    return use_gpu, math.floor(gpus / config.gpus_per_worker)


def _reserve_gpus(config: LaunchConfig, count: int) -> PlacementGroup:
    bundle = {"GPU": config.gpus_per_worker}
    if config.cpus_per_worker:
        bundle["CPU"] = config.cpus_per_worker
    group = placement_group(
        [dict(bundle) for _ in range(count)],
        strategy="SPREAD",
        name=placement_group_name(config.name_prefix),
        # Detached like the workers: a placement group dies with the job that made it, and
        # would take the workers with it.
        lifetime="detached",
    )
    if not group.wait(timeout_seconds=config.ready_timeout_s):
        remove_placement_group(group)
        raise WorkerLaunchError(
            f"could not reserve {count} bundles of {bundle} within {config.ready_timeout_s}s; "
            f"the cluster offers {ray.available_resources()}"
        )
    return group


def launch_workers(config: LaunchConfig) -> list[ray.actor.ActorHandle]:
    """Start the workers and wait until every pool is allocated.

    Returns:
        Actor handles, worker 0 first. Each worker's id is its actor name
        (:func:`worker_name`).

    Raises:
        WorkersAlreadyExist: workers with these names are running (attach to them or shut
            them down first); a WorkerLaunchError.
        WorkerLaunchError: the cluster lacks the resources, or a pool could not be created
            (the message carries the worker's error). Nothing is left running.
    """
    connect_ray(config.ray_address, config.namespace, local_num_cpus=config.local_num_cpus)
    existing = _existing_names(config.namespace, config.name_prefix)
    if existing:
        raise WorkersAlreadyExist(config.namespace, existing)
    use_gpu, count = _plan_gpu_workers(config)
    if count < 1:
        raise WorkerLaunchError("the cluster has no whole GPU for a worker")
    group = _reserve_gpus(config, count) if use_gpu else None
    handles = []
    try:
        for i in range(count):
            options: dict = {
                "name": worker_name(config.name_prefix, i),
                "namespace": config.namespace,
                "lifetime": "detached",
                "max_restarts": config.max_restarts,
                "num_cpus": config.cpus_per_worker,
                "num_gpus": config.gpus_per_worker if use_gpu else 0,
            }
            if group is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=i
                )
            handle = PoolWorkerActor.options(**options).remote(
                worker_name(config.name_prefix, i),
                config.pool,
                "cuda" if use_gpu else "cpu",
                None if use_gpu else config.torch_threads,
            )
            handles.append(handle)
        ray.get([h.describe.remote() for h in handles], timeout=config.ready_timeout_s)
    except Exception as exc:
        for handle in handles:
            ray.kill(handle, no_restart=True)
        if group is not None:
            remove_placement_group(group)
        raise WorkerLaunchError(f"starting {count} workers failed: {exc}") from exc
    return handles


def attach_workers(
    namespace: str, name_prefix: str, *, ray_address: str | None = "auto"
) -> list[ray.actor.ActorHandle]:
    """Handles of the live workers ``<name_prefix><i>`` in ``namespace``, by index.

    Args:
        ray_address: cluster to join if this process is not connected yet.

    Raises:
        WorkerLaunchError: no such workers.
    """
    if not ray.is_initialized():
        if ray_address is None:
            raise WorkerLaunchError("attach_workers needs a running Ray: give ray_address")
        connect_ray(ray_address, namespace)
    names = _existing_names(namespace, name_prefix)
    if not names:
        raise WorkerLaunchError(f"no workers named {name_prefix!r}<i> in namespace {namespace!r}")
    return [ray.get_actor(name, namespace=namespace) for name in names]


def shutdown_workers(namespace: str, name_prefix: str) -> int:
    """Kill the named workers (no restart) and remove their placement group.

    Returns:
        How many workers were killed (0 when none existed).
    """
    if not ray.is_initialized():
        raise WorkerLaunchError("shutdown_workers needs a connected Ray (see connect_ray)")
    names = _existing_names(namespace, name_prefix)
    for name in names:
        try:
            ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
        except ValueError:  # died between listing and lookup
            pass
    try:
        group = ray.util.get_placement_group(placement_group_name(name_prefix))
    except ValueError:
        group = None
    if group is not None:
        remove_placement_group(group)
    return len(names)
