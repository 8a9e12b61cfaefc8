"""KV events: what the prefix index gained and lost, numbered, in a bounded ring.

The prefix index (`prefix_index.PrefixIndex`) reports every change here: a chain of blocks
published (`BlockStored`), blocks that left it (`BlockRemoved`), every block of a worker
gone at once (`AllCleared`). Each event gets the next sequence number (1, 2, ...; one
counter per service) and the wall-clock time it happened.

Numbering is a pure function of the manager's calls: the same calls replayed from the
write-ahead log give the same events with the same numbers, which is how a restarted
coordinator continues the numbering without a gap or a duplicate (the checkpoint carries
the ring; replay regenerates what came after it). Timestamps are the one exception: an
event rebuilt by replay carries the time it was replayed.

Events are *pending* until `release()`: with a write-ahead log the coordinator releases
them once the call that made them is durable, so a subscriber never sees an event a crash
could take back and renumber. Without a log, `auto_release` makes them visible at once.

Pure: no asyncio, torch, Ray or gRPC. Subscribers are woken through plain callbacks
(`add_listener`).
"""

from __future__ import annotations

import secrets
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from cache_service.errors import EventsOutOfRange, InvalidRequest

__all__ = [
    "DEFAULT_KV_EVENT_RING",
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "AllCleared",
    "BlockRemoved",
    "BlockStored",
    "KvEvent",
    "KvEventLog",
]

# Events kept for resuming subscribers when the service config does not say.
DEFAULT_KV_EVENT_RING = 4096
# Where a block's KV lives: a worker's GPU pool, or its host tier (control.host_tier).
MEDIUM_GPU = "gpu"
MEDIUM_CPU = "cpu"

EventType = Literal["stored", "removed", "cleared"]


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks that became findable in the prefix index: one chain, each block's parent is
    the one before it (the first one's is `parent`).

    Attributes:
        hashes: the blocks' prefix keys (32-byte salted chain hashes), in prompt order.
        parent: key of the block before the first (32 zero bytes at a prompt's start).
        block_size: tokens per block (every published block is full).
        worker_id: the worker holding them.
        medium: where the KV lives ("gpu", or "cpu" for a host tier).
    """

    hashes: tuple[bytes, ...]
    parent: bytes
    block_size: int
    worker_id: str
    medium: str = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Keys that left the prefix index (the block was evicted or reused).

    Attributes:
        hashes: the keys, 32 bytes each.
        worker_id: the worker that held the block.
        medium: where the KV was ("gpu" or "cpu").
    """

    hashes: tuple[bytes, ...]
    worker_id: str
    medium: str = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class AllCleared:
    """Every key of one worker left the index at once (the worker was lost); worker_id ""
    means every worker."""

    worker_id: str = ""


@dataclass(frozen=True, slots=True)
class KvEvent:
    """One numbered event.

    Attributes:
        sequence: 1, 2, ... per service, gap-free across restarts with a write-ahead log.
        timestamp_us: wall-clock microseconds since the Unix epoch when it happened.
        owner: the tenant whose salt the keys were hashed with; None for public keys and
            for `AllCleared` (which every subscriber sees).
        namespace: the prefix-cache namespace of the keys ("" = the default).
        body: what happened.
    """

    sequence: int
    timestamp_us: int
    owner: str | None
    namespace: str
    body: BlockStored | BlockRemoved | AllCleared

    @property
    def type(self) -> EventType:
        """ "stored", "removed" or "cleared"."""
        return _TYPE_OF[type(self.body)]


_TYPE_OF: dict[type, EventType] = {
    BlockStored: "stored",
    BlockRemoved: "removed",
    AllCleared: "cleared",
}


class KvEventLog:
    """The numbered events of one service: a bounded ring of the most recent ones.

    Args:
        capacity: events kept for resuming subscribers (>= 1).
        stream_id: names this numbering; a subscriber seeing another id knows the numbers
            restarted (a service without a write-ahead log restarts at 1). Random if None.
    """

    def __init__(self, capacity: int = DEFAULT_KV_EVENT_RING, stream_id: str | None = None):
        _check_capacity(capacity)
        self._ring: deque[KvEvent] = deque(maxlen=capacity)
        self._last = 0  # sequence of the newest event, released or not
        self._released = 0  # sequence of the newest event subscribers may see
        self.stream_id = stream_id or secrets.token_hex(8)
        # Without a write-ahead log nothing can take an event back: visible at once.
        self.auto_release = True
        self._listeners: list[Callable[[list[KvEvent]], None]] = []

    # ---- numbers -------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """How many events the ring keeps."""
        return self._ring.maxlen or 0

    @property
    def last_sequence(self) -> int:
        """The newest event's number (0 before the first), released or not."""
        return self._last

    @property
    def last_released(self) -> int:
        """The newest number subscribers may see (0 before the first)."""
        return self._released

    @property
    def oldest_kept(self) -> int:
        """The oldest number still in the ring; last_sequence + 1 when it is empty."""
        return self._ring[0].sequence if self._ring else self._last + 1

    def set_capacity(self, capacity: int) -> None:
        """Keep at most `capacity` events from now on (the oldest go first)."""
        _check_capacity(capacity)
        if capacity != self.capacity:
            self._ring = deque(self._ring, maxlen=capacity)

    # ---- recording (the prefix index calls these) ------------------------------------------

    def stored(
        self,
        hashes: Sequence[bytes],
        parent: bytes,
        owner: str | None,
        namespace: str,
        worker_id: str,
        block_size: int,
        medium: str = MEDIUM_GPU,
    ) -> None:
        """Record a chain of keys published on one worker (nothing if `hashes` is empty)."""
        if hashes:
            body = BlockStored(tuple(hashes), parent, block_size, worker_id, medium)
            self._append(owner, namespace, body)

    def removed(
        self,
        hashes: Sequence[bytes],
        owner: str | None,
        namespace: str,
        worker_id: str,
        medium: str = MEDIUM_GPU,
    ) -> None:
        """Record keys of one owner and worker that left the index (nothing if empty)."""
        if hashes:
            self._append(owner, namespace, BlockRemoved(tuple(hashes), worker_id, medium))

    def cleared(self, worker_id: str = "") -> None:
        """Record that every key of `worker_id` ("" = of every worker) left the index."""
        self._append(None, "", AllCleared(worker_id))

    def _append(self, owner: str | None, namespace: str, body: Any) -> None:
        self._last += 1
        stamp = time.time_ns() // 1000
        self._ring.append(KvEvent(self._last, stamp, owner, namespace, body))
        if self.auto_release:
            self.release()

    # ---- publishing ------------------------------------------------------------------------

    def release(self) -> int:
        """Make every recorded event visible to subscribers; returns how many became so."""
        count = self._last - self._released
        if count <= 0:
            return 0
        self._released = self._last
        if self._listeners:
            # Events pushed out of the ring before their release (one call recording more
            # events than the ring holds) are not passed on.
            start = max(0, len(self._ring) - count)
            released = [self._ring[i] for i in range(start, len(self._ring))]
            for listener in list(self._listeners):
                listener(released)
        return count

    def add_listener(self, listener: Callable[[list[KvEvent]], None]) -> None:
        """Call `listener(events)` with the events each release made visible."""
        self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[list[KvEvent]], None]) -> None:
        """Stop calling `listener` (no error if it was not added)."""
        if listener in self._listeners:
            self._listeners.remove(listener)

    def check_position(self, after: int) -> None:
        """Check that released events after number `after` can be read from the ring.

        Raises:
            InvalidRequest: `after` is not an int >= 0.
            EventsOutOfRange: `after` is past the newest released number, or events after
                it were already dropped from the ring (the message names the oldest kept).
        """
        if type(after) is not int or after < 0:
            raise InvalidRequest(f"from_sequence must be an int >= 0, got {after!r}")
        if after > self._released:
            raise EventsOutOfRange(
                f"from_sequence {after} is in the future: the newest event of stream "
                f"{self.stream_id} is {self._released}"
            )
        if after + 1 < self.oldest_kept:
            raise EventsOutOfRange(
                f"events after {after} are no longer kept: the oldest kept is "
                f"{self.oldest_kept} (the ring holds {self.capacity}); resubscribe with "
                "from_sequence 0 and rebuild your view"
            )

    def read(self, after: int, limit: int) -> list[KvEvent]:
        """Released events numbered after `after`, oldest first, at most `limit` of them.

        Raises:
            InvalidRequest / EventsOutOfRange: see `check_position`.
        """
        self.check_position(after)
        if not self._ring or after >= self._released:
            return []
        first = self._ring[0].sequence
        start = max(0, after + 1 - first)
        stop = min(len(self._ring), self._released - first + 1, start + limit)
        return [self._ring[i] for i in range(start, stop)]

    # ---- snapshots -------------------------------------------------------------------------

    def to_records(self) -> dict[str, Any]:
        """The ring and the counter as JSON-able data (keys hex); pending events included
        (a checkpoint is written with the calls that made them)."""
        return {
            "last": self._last,
            "events": [_event_record(e) for e in self._ring],
        }

    @classmethod
    def from_records(
        cls, records: dict[str, Any], capacity: int = DEFAULT_KV_EVENT_RING
    ) -> KvEventLog:
        """A log continuing `to_records()` output; every event in it counts as released.

        Raises:
            InvalidRequest: malformed records.
        """
        log = cls(capacity)
        try:
            events = [_event_from_record(r) for r in records["events"]]
            last = int(records["last"])
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRequest(f"malformed kv event records: {exc!r}") from None
        numbers = [e.sequence for e in events]
        if numbers != list(range(last - len(events) + 1, last + 1)) or last < 0:
            raise InvalidRequest("malformed kv event records: numbers are not consecutive")
        log._ring.extend(events)
        log._last = log._released = last
        return log


def _check_capacity(capacity: int) -> None:
    if type(capacity) is not int or capacity < 1:
        raise ValueError(f"the kv event ring must hold at least 1 event, got {capacity!r}")


def _event_record(e: KvEvent) -> dict[str, Any]:
    body = e.body
    record: dict[str, Any] = {
        "seq": e.sequence,
        "ts": e.timestamp_us,
        "owner": e.owner,
        "ns": e.namespace,
        "type": e.type,
    }
    if isinstance(body, AllCleared):
        record["worker_id"] = body.worker_id
        return record
    record.update(hashes=[h.hex() for h in body.hashes], worker_id=body.worker_id)
    record["medium"] = body.medium
    if isinstance(body, BlockStored):
        record.update(parent=body.parent.hex(), block_size=body.block_size)
    return record


def _event_from_record(r: dict[str, Any]) -> KvEvent:
    kind = r["type"]
    body: BlockStored | BlockRemoved | AllCleared
    if kind == "cleared":
        body = AllCleared(str(r["worker_id"]))
    elif kind == "removed":
        hashes = tuple(bytes.fromhex(h) for h in r["hashes"])
        body = BlockRemoved(hashes, str(r["worker_id"]), str(r["medium"]))
    elif kind == "stored":
        hashes = tuple(bytes.fromhex(h) for h in r["hashes"])
        body = BlockStored(
            hashes,
            bytes.fromhex(r["parent"]),
            int(r["block_size"]),
            str(r["worker_id"]),
            str(r["medium"]),
        )
    else:
        raise ValueError(f"unknown event type {kind!r}")
    owner = r["owner"]
    return KvEvent(
        int(r["seq"]), int(r["ts"]), None if owner is None else str(owner), str(r["ns"]), body
    )
