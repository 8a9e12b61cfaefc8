"""Errors the coordinator itself raises (besides the control plane's, `cache_service.errors`).

Domain errors only: `cache_service.api.status_mapping` decides which gRPC status each
becomes, so the engine never imports grpc.
"""

from __future__ import annotations

__all__ = ["ServiceError", "ServiceUnavailable", "WorkerLost"]


class ServiceError(Exception):
    """Base of the errors the coordinator itself raises (besides the control plane's)."""


class ServiceUnavailable(ServiceError):
    """No worker can serve the call (none registered, all lost, or the server is stopping)."""


class WorkerLost(ServiceError):
    """A worker holding blocks of the call's sequences died or restarted during the call.

    Attributes:
        worker_id: the worker.
        seq_ids: the caller's sequences that lost blocks (they now fail with DATA_LOSS).
    """

    def __init__(self, worker_id: str, seq_ids: list[str], reason: str) -> None:
        self.worker_id = worker_id
        self.seq_ids = seq_ids
        self.reason = reason
        lost = f" sequences {seq_ids}" if seq_ids else " sequences of this call"
        super().__init__(
            f"worker {worker_id!r} was lost ({reason}); the KV of{lost} is gone: free "
            "them and recompute (create again, append the prompt)"
        )
