"""The client's errors: one class per gRPC status a call can fail with.

`KVCacheError` carries the status code and the server's message; catch a subclass for one
status, or `KVCacheError` for all.
"""

from __future__ import annotations

import grpc

__all__ = [
    "AlreadyAppliedError",
    "DataLossError",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "InternalError",
    "InvalidArgumentError",
    "KVCacheError",
    "NotFoundError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "UnauthenticatedError",
    "UnavailableError",
]


class KVCacheError(Exception):
    """A call failed. `code` is the gRPC status code, `message` the server's explanation."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class InvalidArgumentError(KVCacheError):
    """Bad shapes, dtypes, token counts or layer numbers."""


class NotFoundError(KVCacheError):
    """Unknown sequence id."""


class ResourceExhaustedError(KVCacheError):
    """No room in the pools after eviction, or a tenant quota; free sequences or wait."""


class FailedPreconditionError(KVCacheError):
    """The sequence is not in the state the call needs (e.g. a layer not yet written)."""


class DataLossError(KVCacheError):
    """The sequence's blocks were lost with a worker: free it and recompute."""


class UnavailableError(KVCacheError):
    """The server or its workers cannot serve now; retry later."""


class UnauthenticatedError(KVCacheError):
    """Missing or unknown bearer token."""


class PermissionDeniedError(KVCacheError):
    """The tenant lacks a permission the call needs."""


class DeadlineExceededError(KVCacheError):
    """The call did not finish within its deadline."""


class AlreadyAppliedError(KVCacheError):
    """ALREADY_EXISTS: a retry of a request id whose first call was applied and whose reply
    the server no longer keeps. The change is in place; do not apply it again."""


class InternalError(KVCacheError):
    """A server bug or another unexpected status."""


# The client's error class of each status a call can fail with (others: InternalError).
STATUS_ERRORS: dict[grpc.StatusCode, type[KVCacheError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.DATA_LOSS: DataLossError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyAppliedError,
}


def error_for(code: grpc.StatusCode, message: str) -> KVCacheError:
    """The KVCacheError of a call that failed with `code` and the server's `message`."""
    return STATUS_ERRORS.get(code, InternalError)(code, message)


def error_from_rpc(exc: grpc.RpcError) -> KVCacheError:
    """The KVCacheError of a failed gRPC call (UNKNOWN when it carries no status)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return error_for(code, details or code.name)
