"""Subscriptions to the coordinator's KV events (`control.kv_events`), for the event loop.

`KvEventFeed.follow` reads the released events after a position and then waits for each
release, yielding pages of what the subscriber may see; it counts the released events and
the subscribers in the service metrics (`kvcache_kv_events_total`,
`kvcache_kv_event_subscribers`). The filter (tenant scoping, worker, namespace) is the
caller's: the API knows who is asking.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from cache_service.control.kv_events import KvEvent, KvEventLog
from cache_service.errors import InvalidRequest

__all__ = ["DEFAULT_PAGE_EVENTS", "MAX_PAGE_EVENTS", "KvEventFeed", "KvEventPage"]

# Events per page when the subscriber does not say, and the most it may ask for.
DEFAULT_PAGE_EVENTS = 256
MAX_PAGE_EVENTS = 4096


@dataclass(frozen=True, slots=True)
class KvEventPage:
    """What one read found for a subscriber.

    Attributes:
        events: the events it may see, oldest first (may be empty: all filtered out).
        last_sequence: every event numbered up to here was read; resume after it.
        oldest_sequence: the oldest number the ring still keeps.
        newest_sequence: the newest released number when the page was read (the
            subscriber has caught up when last_sequence reaches it).
        stream_id: the numbering's id (`KvEventLog.stream_id`).
    """

    events: list[KvEvent]
    last_sequence: int
    oldest_sequence: int
    newest_sequence: int
    stream_id: str


class KvEventFeed:
    """Follows one `KvEventLog` for any number of subscribers on one event loop.

    Args:
        log: the coordinator's event log (after recovery: the log it continues).
        metrics: a `ServiceMetrics` to count events and subscribers in (optional).
    """

    def __init__(self, log: KvEventLog, metrics: Any = None) -> None:
        self.log = log
        self._metrics = metrics
        self._wakers: set[asyncio.Event] = set()
        self.subscribers = 0
        log.add_listener(self._released)

    def _released(self, events: list[KvEvent]) -> None:
        if self._metrics is not None:
            self._metrics.add_kv_events(events)
        for waker in self._wakers:
            waker.set()

    def close(self) -> None:
        """Stop following the log (the coordinator shuts down)."""
        self.log.remove_listener(self._released)

    async def follow(
        self,
        after: int,
        visible: Callable[[KvEvent], bool],
        page_events: int = DEFAULT_PAGE_EVENTS,
        stop: asyncio.Event | None = None,
    ) -> AsyncIterator[KvEventPage]:
        """Pages of the events after number `after` that `visible` accepts, the kept ones
        first and then each new one as it is released, until `stop` is set or the caller
        stops iterating. A page with no events is yielded when everything read was
        filtered out, so the subscriber's resume position keeps up, and first of all when
        there is nothing to read yet (the subscriber learns the stream id and the newest
        number at once).

        Args:
            after: resume after this event number (`KvEventLog.check_position` rules).
            visible: whether the subscriber may see an event.
            page_events: most events read per page, 1..MAX_PAGE_EVENTS.
            stop: ends the iteration when set (server shutdown).

        Raises:
            InvalidRequest / EventsOutOfRange: `after` cannot be served, checked before the
                first page; EventsOutOfRange later if the subscriber falls so far behind
                that the ring dropped events it had not read.
        """
        if type(page_events) is not int or not 1 <= page_events <= MAX_PAGE_EVENTS:
            raise InvalidRequest(
                f"max_batch_events must be 1..{MAX_PAGE_EVENTS} (0: {DEFAULT_PAGE_EVENTS}), "
                f"got {page_events!r}"
            )
        log = self.log
        log.check_position(after)
        waker = asyncio.Event()
        self._wakers.add(waker)
        self._set_subscribers(1)
        stopper = None if stop is None else asyncio.ensure_future(stop.wait())
        first = True
        try:
            while stop is None or not stop.is_set():
                waker.clear()
                events = log.read(after, page_events)
                if events or first:
                    first = False
                    after = events[-1].sequence if events else after
                    shown = [e for e in events if visible(e)]
                    yield KvEventPage(
                        shown, after, log.oldest_kept, log.last_released, log.stream_id
                    )
                    continue
                await _wait(waker, stopper)
        finally:
            if stopper is not None:
                stopper.cancel()
            self._wakers.discard(waker)
            self._set_subscribers(-1)

    def _set_subscribers(self, change: int) -> None:
        self.subscribers += change
        if self._metrics is not None:
            self._metrics.set_kv_event_subscribers(self.subscribers)


async def _wait(waker: asyncio.Event, stopper: asyncio.Future[Any] | None) -> None:
    """Until the next release, or until `stopper` completes."""
    if stopper is None:
        await waker.wait()
        return
    woken = asyncio.ensure_future(waker.wait())
    try:
        await asyncio.wait({woken, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        woken.cancel()
