"""A service running in a background thread of the executor's own process.

For examples, tests and benchmarks of model executors: `start_service` is a coroutine of
the gRPC asyncio server, while a model executor is ordinary blocking code. This runs the
service's event loop on a daemon thread and hands back its "host:port"; everything still
goes through a real gRPC server on a real port.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from typing import Any

from cache_service.config import ServiceConfig

__all__ = ["EmbeddedService"]


class EmbeddedService:
    """Start a service from `config` on a background event loop; `stop()` (or the context
    manager's exit) drains it and ends the thread.

    Args:
        config: the service configuration (``server.port = 0`` binds a free port).
        start_timeout_s: how long to wait for the service to come up, seconds.

    Raises:
        whatever `cache_service.api.server.start_service` raises (bad config, workers that
        cannot start, a port that cannot be bound); TimeoutError if it does not start.
    """

    def __init__(self, config: ServiceConfig, start_timeout_s: float = 120.0) -> None:
        from cache_service.api.server import start_service

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="kvcache-embedded", daemon=True
        )
        self._thread.start()
        started: Future[Any] = asyncio.run_coroutine_threadsafe(start_service(config), self._loop)
        try:
            self.running = started.result(timeout=start_timeout_s)
        except BaseException:
            started.cancel()
            self._end_loop()
            raise
        self._stopped = False

    @property
    def address(self) -> str:
        """ "host:port" of the gRPC server."""
        return self.running.address

    def stop(self, grace_s: float = 1.0, timeout_s: float = 60.0) -> None:
        """Drain the server (``grace_s`` for calls in flight), stop its workers, end the thread."""
        if self._stopped:
            return
        self._stopped = True
        try:
            asyncio.run_coroutine_threadsafe(self.running.stop(grace_s), self._loop).result(
                timeout=timeout_s
            )
        finally:
            self._end_loop()

    def _end_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> EmbeddedService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
