"""The gRPC front of the service, by its public names: the servicer (`api.servicer`), the
process that serves it (`api.service`: `start_service`, `RunningService`) and the log
format (`api.log_format`). Tests, the CLI and integrations import them from here."""

from cache_service.api.log_format import configure_logging
from cache_service.api.service import RunningService, server_torch_threads, start_service
from cache_service.api.servicer import (
    DEFAULT_TENANT,
    METHOD_PERMISSIONS,
    SERVICE_NAME,
    KVCacheServicer,
)

__all__ = [
    "DEFAULT_TENANT",
    "METHOD_PERMISSIONS",
    "SERVICE_NAME",
    "KVCacheServicer",
    "RunningService",
    "configure_logging",
    "server_torch_threads",
    "start_service",
]
