"""Python client of the kvcache.v1 service (`cache_service.client.sdk`), and its transports:
the Session stream, local sessions over a Unix socket, shared-memory regions.

Imports only `cache_service.wire` (codecs shared with the server), the proto and
`cache_service.errors` besides itself: never the
engine, the API or `workers` (tests/test_import_rules.py).
"""

from cache_service.client.sdk import (
    AlreadyAppliedError,
    AppendAttendItem,
    AttendItem,
    DataLossError,
    DeadlineExceededError,
    ExportedBlocks,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    KVCacheClient,
    KVCacheError,
    LocalSessionUnavailable,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    SequenceEntry,
    SequenceHandle,
    ServiceInfo,
    ServiceLayout,
    ServiceStats,
    SharedMemoryUnavailable,
    UnauthenticatedError,
    UnavailableError,
    WorkerInfo,
    WorkerStats,
)

__all__ = [
    "AlreadyAppliedError",
    "AppendAttendItem",
    "AttendItem",
    "DataLossError",
    "DeadlineExceededError",
    "ExportedBlocks",
    "FailedPreconditionError",
    "InternalError",
    "InvalidArgumentError",
    "KVCacheClient",
    "KVCacheError",
    "LocalSessionUnavailable",
    "NotFoundError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "SequenceEntry",
    "SequenceHandle",
    "ServiceInfo",
    "ServiceLayout",
    "ServiceStats",
    "SharedMemoryUnavailable",
    "UnauthenticatedError",
    "UnavailableError",
    "WorkerInfo",
    "WorkerStats",
]
