"""Running a setup function in every Ray worker's process of a benchmark's service (for the
diagnostics that time or mark what happens inside the worker)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import bench_service


def on_ray_workers(setup: Callable[[Any], None]) -> None:
    """Wrap bench_service's start_service: once a service with Ray workers is up, call
    ``setup(worker)`` in each worker's process (``__ray_call__``: `setup` travels by value,
    so it imports what it needs itself)."""
    import ray

    start = bench_service.start_service

    async def started(*args: Any, **kwargs: Any) -> Any:
        running = await start(*args, **kwargs)
        for client in running.coordinator._clients.values():
            handle = getattr(client, "handle", None)
            if handle is not None:
                ray.get(handle.__ray_call__.remote(setup))
        return running

    bench_service.start_service = started
