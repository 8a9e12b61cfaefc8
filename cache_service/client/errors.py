"""The client's errors: one class per gRPC status a call can fail with.

`KVCacheError` carries the status code and the server's message; catch a subclass for one
status, or `KVCacheError` for all.
"""

from __future__ import annotations

import grpc

__all__ = [
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


class InternalError(KVCacheError):
    """A server bug or another unexpected status."""
