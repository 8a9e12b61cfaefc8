"""SubscribeKvEvents: a request's filters checked, the coordinator's KV event feed
followed, each page encoded as a `KvEventBatch`.

Who sees what: a tenant sees its own blocks' events, public keys' events and AllCleared;
an admin, or every caller of a server without authentication, sees every event.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from cache_service._proto.kvcache.v1 import kvcache_pb2 as pb
from cache_service.control.kv_events import AllCleared, BlockStored, KvEvent
from cache_service.control.validation import check_namespace
from cache_service.engine.errors import ServiceUnavailable
from cache_service.engine.kv_event_feed import DEFAULT_PAGE_EVENTS, KvEventPage
from cache_service.errors import InvalidRequest

if TYPE_CHECKING:
    from cache_service.engine.coordinator import Coordinator

__all__ = ["encode_event", "kv_event_batches"]


async def kv_event_batches(
    coordinator: Coordinator,
    request: pb.SubscribeKvEventsRequest,
    tenant: str,
    sees_all: bool,
    stop: asyncio.Event,
) -> AsyncIterator[pb.KvEventBatch]:
    """The batches of one subscription, until `stop` is set or the caller stops.

    Args:
        coordinator: a started coordinator.
        request: the subscription (position and filters).
        tenant: the caller's tenant.
        sees_all: the caller may see every tenant's events (admin, or no authentication).
        stop: set when the server shuts down.

    Raises:
        InvalidRequest: a bad filter or position; EventsOutOfRange: see the RPC.
    """
    feed = coordinator.kv_events
    if feed is None:
        raise ServiceUnavailable("the coordinator is not serving yet")
    after = int(request.from_sequence)
    if request.only_new:
        if after:
            raise InvalidRequest("only_new starts after the newest event: from_sequence must be 0")
        after = feed.log.last_released
    elif after == 0:  # from the oldest event kept
        after = feed.log.oldest_kept - 1
    worker = request.worker_id
    if worker and worker not in {w.worker_id for w in coordinator.workers()}:
        raise InvalidRequest(f"unknown worker_id {worker!r}")
    namespace = request.namespace if request.HasField("namespace") else None
    if namespace is not None:
        check_namespace(namespace)
    visible = _visibility(tenant, sees_all, worker, namespace)
    page_events = int(request.max_batch_events) or DEFAULT_PAGE_EVENTS
    async for page in feed.follow(after, visible, page_events, stop):
        yield _batch(page)


def _visibility(
    tenant: str, sees_all: bool, worker: str, namespace: str | None
) -> Callable[[KvEvent], bool]:
    def visible(event: KvEvent) -> bool:
        body = event.body
        if isinstance(body, AllCleared):
            return not worker or not body.worker_id or body.worker_id == worker
        if not sees_all and event.owner is not None and event.owner != tenant:
            return False
        if worker and body.worker_id != worker:
            return False
        return namespace is None or event.namespace == namespace

    return visible


def _batch(page: KvEventPage) -> pb.KvEventBatch:
    return pb.KvEventBatch(
        stream_id=page.stream_id,
        events=[encode_event(e) for e in page.events],
        last_sequence=page.last_sequence,
        oldest_sequence=page.oldest_sequence,
        newest_sequence=page.newest_sequence,
    )


def encode_event(event: KvEvent) -> pb.KvEvent:
    """One event as its `kvcache.v1.KvEvent`."""
    message = pb.KvEvent(
        sequence=event.sequence,
        timestamp_us=event.timestamp_us,
        tenant=event.owner or "",
        public=event.owner is None and not isinstance(event.body, AllCleared),
        namespace=event.namespace,
    )
    body = event.body
    if isinstance(body, BlockStored):
        message.stored.CopyFrom(
            pb.BlockStored(
                block_hashes=list(body.hashes),
                parent_block_hash=body.parent,
                block_size=body.block_size,
                worker_id=body.worker_id,
                medium=body.medium,
            )
        )
    elif isinstance(body, AllCleared):
        message.cleared.CopyFrom(pb.AllCleared(worker_id=body.worker_id))
    else:
        message.removed.CopyFrom(
            pb.BlockRemoved(
                block_hashes=list(body.hashes), worker_id=body.worker_id, medium=body.medium
            )
        )
    return message
