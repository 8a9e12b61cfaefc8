"""KV events as the client sees them (`KVCacheClient.kv_events`): typed records and the
subscription that yields them.

A subscription remembers how far it read (`position`: every event numbered up to it was
considered, including events filtered out or of other tenants); pass it back as
`from_sequence` to resume after a disconnect or a coordinator restart without a gap or a
duplicate. A different `stream_id` means the numbering restarted (a service without a
write-ahead log): drop what was built from the events and start over.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from cache_service._proto.kvcache.v1 import kvcache_pb2 as pb
from cache_service.client.errors import error_from_rpc

__all__ = [
    "AllCleared",
    "BlockRemoved",
    "BlockStored",
    "KvEvent",
    "KvEventSubscription",
    "decode_event",
]


@dataclass(frozen=True)
class BlockStored:
    """Blocks that became findable: one chain, each the parent of the next.

    hashes: their prefix keys (32 bytes each, `block_hashes` computes a prompt's);
    parent: the key before the first (32 zero bytes at a prompt's start); block_size:
    tokens per block; worker_id: where they are; medium: "gpu".
    """

    hashes: tuple[bytes, ...]
    parent: bytes
    block_size: int
    worker_id: str
    medium: str


@dataclass(frozen=True)
class BlockRemoved:
    """Keys that left the prefix index (hashes, 32 bytes each), of worker_id, medium."""

    hashes: tuple[bytes, ...]
    worker_id: str
    medium: str


@dataclass(frozen=True)
class AllCleared:
    """Every key of worker_id left the index ("" = of every worker)."""

    worker_id: str


@dataclass(frozen=True)
class KvEvent:
    """One numbered event.

    sequence: 1, 2, ... per stream; timestamp_us: microseconds since the Unix epoch;
    tenant: whose keys ("" for public keys and AllCleared); public: the keys are public;
    namespace: their prefix-cache namespace; body: what happened.
    """

    sequence: int
    timestamp_us: int
    tenant: str
    public: bool
    namespace: str
    body: BlockStored | BlockRemoved | AllCleared

    @property
    def type(self) -> str:
        """ "stored", "removed" or "cleared"."""
        if isinstance(self.body, BlockStored):
            return "stored"
        return "removed" if isinstance(self.body, BlockRemoved) else "cleared"


def decode_event(message: pb.KvEvent) -> KvEvent:
    """A `kvcache.v1.KvEvent` as a `KvEvent`."""
    kind = message.WhichOneof("event")
    body: BlockStored | BlockRemoved | AllCleared
    if kind == "stored":
        s = message.stored
        body = BlockStored(
            tuple(s.block_hashes), s.parent_block_hash, s.block_size, s.worker_id, s.medium
        )
    elif kind == "removed":
        r = message.removed
        body = BlockRemoved(tuple(r.block_hashes), r.worker_id, r.medium)
    else:
        body = AllCleared(message.cleared.worker_id)
    return KvEvent(
        int(message.sequence),
        int(message.timestamp_us),
        message.tenant,
        message.public,
        message.namespace,
        body,
    )


class KvEventSubscription:
    """An open SubscribeKvEvents stream: iterate it for `KvEvent`s (it blocks for new ones
    and ends only when `cancel()` is called or the call fails).

    Attributes:
        position: every event numbered up to here was read; resume from it.
        stream_id: the numbering's id ("" before the first batch).
        oldest_sequence: the oldest number the service kept, as of the last batch.
        newest_sequence: the newest number the service had, as of the last batch.

    Errors surface as `KVCacheError` subclasses (OUT_OF_RANGE as InvalidArgumentError,
    its message naming the newest or oldest kept number).
    """

    def __init__(self, call: Any, from_sequence: int) -> None:
        self._call = call
        self.position = from_sequence
        self.stream_id = ""
        self.oldest_sequence = 0
        self.newest_sequence = 0

    @property
    def caught_up(self) -> bool:
        """Whether every event released when the last batch was read has been read."""
        return bool(self.stream_id) and self.position >= self.newest_sequence

    def _note(self, batch: pb.KvEventBatch) -> None:
        self.stream_id = batch.stream_id
        self.oldest_sequence = int(batch.oldest_sequence)
        self.newest_sequence = int(batch.newest_sequence)

    def __iter__(self) -> Iterator[KvEvent]:
        try:
            for batch in self._call:
                self._note(batch)
                for message in batch.events:
                    event = decode_event(message)
                    self.position = event.sequence  # a caller stopping here has it
                    yield event
                self.position = int(batch.last_sequence)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED and self._call.cancelled():
                return
            raise error_from_rpc(exc) from None

    def batches(self) -> Iterator[list[KvEvent]]:
        """The events a batch at a time (a batch may be empty: everything in it was
        filtered out; `position` advanced anyway)."""
        try:
            for batch in self._call:
                self._note(batch)
                events = [decode_event(m) for m in batch.events]
                self.position = int(batch.last_sequence)
                yield events
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED and self._call.cancelled():
                return
            raise error_from_rpc(exc) from None

    def cancel(self) -> None:
        """End the stream (the iteration then stops quietly)."""
        self._call.cancel()

    def __enter__(self) -> KvEventSubscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()
