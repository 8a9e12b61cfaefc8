"""Errors of the control plane (block manager, shared-memory regions). Every one leaves the
state unchanged.

The gRPC servicer maps them to status codes; the mapping lives there, not here, so these
modules stay free of grpc imports.
"""

from __future__ import annotations

__all__ = [
    "DEADLINE_VERDICT",
    "AlreadyApplied",
    "CacheError",
    "DeadlinePassed",
    "EventsOutOfRange",
    "IntegrityError",
    "InvalidRequest",
    "LayerNotWritten",
    "PermissionDenied",
    "PoolExhausted",
    "QuotaExceeded",
    "SequenceLost",
    "SequenceNotFound",
    "SharedMemoryDisabled",
    "SharedMemoryLimit",
    "SharedRegionNotFound",
]


class CacheError(Exception):
    """Base of every control-plane error. A call that raises one changed nothing."""


class SequenceNotFound(CacheError):
    """No such sequence for this tenant.

    Raised both for ids that were never issued (or were freed) and for ids that belong to
    another tenant, with the same message, so a tenant cannot probe other tenants' ids.
    """


class PermissionDenied(SequenceNotFound):
    """The caller may not act on this object.

    A subclass of SequenceNotFound so that code catching "not found" also catches it and a
    service maps both to the same status (NOT_FOUND), leaking nothing about ids. The block
    manager itself raises SequenceNotFound for a sequence of another tenant; this class is
    for layers above it (e.g. an auth check) that want a distinct type with the same
    outward behaviour.
    """


class InvalidRequest(CacheError):
    """The arguments are malformed or inconsistent with the sequence's state."""


class LayerNotWritten(CacheError):
    """Attention was asked for a layer with nothing written yet (its length is 0)."""


class QuotaExceeded(CacheError):
    """The tenant would exceed its block or sequence quota."""


class PoolExhausted(CacheError):
    """Not enough blocks even after evicting every cached-free block that could go."""


class SequenceLost(CacheError):
    """A worker holding some of the sequence's blocks was lost; the client must recompute.

    Every call on the sequence raises this until the client frees it.
    """


class IntegrityError(CacheError):
    """`check_integrity` found the bookkeeping inconsistent (a bug, never a caller error).

    The message names each invariant that failed with the counts that disagree.
    """


class SharedRegionNotFound(CacheError):
    """No such shared-memory region for this tenant: never created, released, reaped after
    its idle timeout, or another tenant's (the same message for all, so region ids cannot
    be probed across tenants). A client recovers by creating a new region."""


class SharedMemoryLimit(CacheError):
    """Creating a shared-memory region would exceed a configured limit (per region, per
    tenant or in total) or the room of the shared-memory file system; the message names it."""


class SharedMemoryDisabled(CacheError):
    """The server has shared memory turned off (``shared_memory.enabled: false``): tensors
    travel as bytes."""


class NotColocated(CacheError):
    """A call only a client on the server's host can use (a step lease) came over the
    network."""


# Every DEADLINE_EXCEEDED the server itself answers says this: a client tells the server's
# verdict ("not applied") from its own transport's timeout (no verdict) by it.
DEADLINE_VERDICT = "passed before it could commit; nothing was changed"


class DeadlinePassed(CacheError):
    """The call's commit deadline passed before it could commit; what it reserved was
    undone (DEADLINE_EXCEEDED). Its message contains DEADLINE_VERDICT."""


class AlreadyApplied(CacheError):
    """A retried request id whose first call was applied and whose reply is no longer
    kept (ALREADY_EXISTS): nothing was applied again."""


class EventsOutOfRange(CacheError):
    """A KV event subscription asked for a position the service cannot serve: a number
    newer than its newest event, or older than the oldest it keeps (OUT_OF_RANGE; the
    message names the newest or the oldest kept number)."""
