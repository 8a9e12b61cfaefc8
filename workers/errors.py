"""Exceptions of the data plane. Pure, and picklable so they cross Ray unchanged."""

from __future__ import annotations

__all__ = [
    "InvalidWorkerRequest",
    "PoolAllocationError",
    "StaleCoordinatorError",
    "StaleEpochError",
    "WorkerError",
    "WorkerLaunchError",
    "WorkerUnavailable",
    "WorkersAlreadyExist",
]


class WorkerError(Exception):
    """Base class of every error a worker, its pool or its launcher raises."""


class StaleEpochError(WorkerError):
    """A call named an epoch the worker does not have: it restarted (empty pool) or the
    caller is out of date. Nothing was done.

    Attributes:
        worker_id: the worker that refused the call.
        expected: the epoch the caller named.
        actual: the worker's epoch.
    """

    def __init__(self, worker_id: str, expected: str, actual: str) -> None:
        self.worker_id = worker_id
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"worker {worker_id!r} has epoch {actual!r}, the call expected {expected!r}: the "
            "worker restarted with an empty pool (or the caller is stale); nothing was done"
        )

    def __reduce__(self) -> tuple[type, tuple[str, str, str]]:
        return (type(self), (self.worker_id, self.expected, self.actual))


class StaleCoordinatorError(WorkerError):
    """A call came from a coordinator generation lower than the highest one that has
    claimed the worker: that coordinator was superseded (a restarted successor opened the
    store after it). Nothing was done.

    Attributes:
        worker_id: the worker that refused the call.
        generation: the caller's generation.
        current: the highest generation that claimed the worker.
    """

    def __init__(self, worker_id: str, generation: int, current: int) -> None:
        self.worker_id = worker_id
        self.generation = generation
        self.current = current
        super().__init__(
            f"worker {worker_id!r} refused the call: coordinator generation {generation} was "
            f"superseded by {current}; nothing was done"
        )

    def __reduce__(self) -> tuple[type, tuple[str, int, int]]:
        return (type(self), (self.worker_id, self.generation, self.current))


class InvalidWorkerRequest(WorkerError, ValueError):
    """An argument does not fit the pool (shape, dtype, layout, block id, layer); the message
    names it. Nothing was written."""


class NonFiniteInput(InvalidWorkerRequest):
    """A write-and-attend asked to check its inputs (``check_finite``) met a NaN or an
    infinity in its key, value or query; nothing was written."""


class PoolAllocationError(WorkerError):
    """The pool does not fit on its device, or its size is malformed."""


class WorkerUnavailable(WorkerError):
    """The worker cannot be reached: its actor died, is restarting, or did not answer in
    time. Whether anything was done is unknown; the caller should check the epoch.

    Attributes:
        worker_id: the worker.
    """

    def __init__(self, worker_id: str, reason: str) -> None:
        self.worker_id = worker_id
        self.reason = reason
        super().__init__(f"worker {worker_id!r} is unavailable: {reason}")

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return (type(self), (self.worker_id, self.reason))


class WorkerLaunchError(WorkerError):
    """Workers could not be started, found or stopped; the message says why."""


class WorkersAlreadyExist(WorkerLaunchError):
    """Workers with the names a launch would use are already running (attach to them, or
    shut them down first).

    Attributes:
        names: the running workers' names.
    """

    def __init__(self, namespace: str, names: list[str]) -> None:
        self.namespace = namespace
        self.names = list(names)
        super().__init__(
            f"workers {self.names} already exist in namespace {namespace!r}: use "
            "attach_workers() to reuse them or shutdown_workers() to replace them"
        )

    def __reduce__(self) -> tuple[type, tuple[str, list[str]]]:
        return (type(self), (self.namespace, self.names))
