"""Which gRPC status (code + message) each control-plane, worker or service error becomes.

The messages tell a person what to do. Two rules shape them:
- a sequence of another tenant is reported exactly like an unknown one (NOT_FOUND), so ids
  cannot be probed across tenants;
- errors that are not understood become INTERNAL with a short reference, and the full
  traceback goes to the server log under the same reference, never to the client.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import grpc

from cache_service import errors as ce
from cache_service.engine.attention_plan import AttentionPlanError
from cache_service.engine.errors import ServiceUnavailable, WorkerLost
from cache_service.engine.store import StoreError
from cache_service.wire.tensor_codec import TensorCodecError
from workers import errors as we

__all__ = ["Status", "status_for"]


@dataclass(frozen=True)
class Status:
    """A gRPC status to answer with; `internal` marks an unexpected error (log it)."""

    code: grpc.StatusCode
    message: str
    internal: bool = False


# Checked in order: subclasses before their bases.
_TABLE: tuple[tuple[type[BaseException], grpc.StatusCode, str], ...] = (
    (ce.SequenceNotFound, grpc.StatusCode.NOT_FOUND, ""),
    (ce.InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT, ""),
    (ce.LayerNotWritten, grpc.StatusCode.FAILED_PRECONDITION, ""),
    (ce.QuotaExceeded, grpc.StatusCode.RESOURCE_EXHAUSTED, " (tenant quota: free sequences)"),
    (ce.PoolExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED, " (free sequences or retry later)"),
    (ce.SequenceLost, grpc.StatusCode.DATA_LOSS, ""),
    (ce.SharedRegionNotFound, grpc.StatusCode.NOT_FOUND, ""),
    (ce.SharedMemoryLimit, grpc.StatusCode.RESOURCE_EXHAUSTED, ""),
    (ce.SharedMemoryDisabled, grpc.StatusCode.FAILED_PRECONDITION, ""),
    (ce.NotColocated, grpc.StatusCode.FAILED_PRECONDITION, ""),
    (ce.DeadlinePassed, grpc.StatusCode.DEADLINE_EXCEEDED, ""),
    (ce.AlreadyApplied, grpc.StatusCode.ALREADY_EXISTS, ""),
    (ce.EventsOutOfRange, grpc.StatusCode.OUT_OF_RANGE, ""),
    (TensorCodecError, grpc.StatusCode.INVALID_ARGUMENT, ""),
    (AttentionPlanError, grpc.StatusCode.INVALID_ARGUMENT, ""),
    (we.InvalidWorkerRequest, grpc.StatusCode.INVALID_ARGUMENT, ""),
    (WorkerLost, grpc.StatusCode.DATA_LOSS, ""),
    (ServiceUnavailable, grpc.StatusCode.UNAVAILABLE, ""),
    (we.StaleEpochError, grpc.StatusCode.DATA_LOSS, ""),
    # A newer coordinator (higher store generation) claimed the worker: this one must not
    # drive it any more; clients should reach the current coordinator.
    (
        we.StaleCoordinatorError,
        grpc.StatusCode.FAILED_PRECONDITION,
        " (this coordinator was superseded by a newer one; connect to the current coordinator)",
    ),
    (we.WorkerUnavailable, grpc.StatusCode.UNAVAILABLE, " (retry later)"),
    # The write-ahead log cannot take the mutation: nothing more can be acknowledged
    # durably, but no state is wrong; another coordinator (after a restart) can serve.
    (
        StoreError,
        grpc.StatusCode.UNAVAILABLE,
        " (the coordinator's metadata store is unavailable; retry after it restarts)",
    ),
)


def status_for(exc: BaseException) -> Status:
    """The status `exc` is reported as.

    Args:
        exc: an exception raised while serving a call.

    Returns:
        Status(code, message); `internal` is True for unexpected exceptions, whose message
        is a generic one with a reference ("ref=<hex>") to quote in the server log.
    """
    if isinstance(exc, ce.SequenceNotFound):
        # PermissionDenied subclasses SequenceNotFound: one answer for both, so another
        # tenant's ids look exactly like unknown ones.
        return Status(grpc.StatusCode.NOT_FOUND, _not_found_message(exc))
    for cls, code, hint in _TABLE:
        if isinstance(exc, cls):
            return Status(code, f"{exc}{hint}" if str(exc) else f"{type(exc).__name__}{hint}")
    ref = secrets.token_hex(4)
    return Status(
        grpc.StatusCode.INTERNAL,
        f"internal error ({type(exc).__name__}); the server log has details under ref={ref}",
        internal=True,
    )


def _not_found_message(exc: ce.SequenceNotFound) -> str:
    if type(exc) is ce.PermissionDenied:
        return "sequence not found (unknown, freed, or not yours)"
    return str(exc) or "sequence not found"
