"""The decoded batch calls of a decode step, kept for its other layers (a speed-up only).

A model executor on the server's host makes one AppendAttendBatch call per layer of each
decode step, and the calls of one step differ only in their layer: the same sequences and
token ids, and the same shared-memory slices for key, value, query and output (the client
writes each layer's tensors into the same place). Decoding such a request and checking its
slices is a good part of the event loop's time for a call, so the servicer keeps what it
made of the step's first call: the batch (views of the client's region) and the output
slots. The step's other calls find it by their bytes with the layer (and each call's own
request_id and timeout_us) left out and skip the
decode and the range checks; a call that differs in anything else decodes as before. The
reply to a call whose output the coordinator produced in the client's slot is the same on
every layer too (the slot's place, dtype and shape), so it is encoded once per entry, and
so are the batch's tensors flattened to the rows the coordinator hands its worker.

Kept only where the inputs are views of regions (servers with `zero_copy` regions), never
for tensors that travel as bytes (their values are in the message). An entry holds its
regions' views, so it goes when any of its regions is dropped (released, reaped, server
stop), before the region is unmapped (`SharedRegions.add_drop_listener`); a call that
finds an entry holds its regions mapped as a fresh decode would (`users`), and a request
naming a region since dropped finds no entry and gets the decode's error.

Not thread-safe: the servicer uses it from the event loop only.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import torch

from cache_service._proto.kvcache.v1 import kvcache_pb2 as pb
from cache_service.api.request_decode import decode_append_attend_batch
from cache_service.api.shared_outputs import SharedOutputs, batch_reply, shared_outputs
from cache_service.engine.values import StackedAppendAttend
from cache_service.engine.worker_interface import AttentionResult
from cache_service.wire.shared_regions import MappedRegion, OutputSlot, RegionReader, SharedRegions
from workers.layout import KVLayout

__all__ = ["BatchDecodeMemo", "DecodedBatch"]

# Entries kept: a step's calls need one per client batch; a few steps' worth of clients.
DEFAULT_CAPACITY = 256


class DecodedBatch:
    """One call's decoded AppendAttendBatch request, its regions held mapped until `close`
    (use it as a context manager around the whole call).

    batch: the sequences, token ids and tensors (key, value ``[b, n, Hkv, D]``, query
    ``[b, m, Hq, D]``); outputs: the checked output slots; output_view: the output slot as
    ``[b * m, Hq, D]`` for the result to be produced in place, or None.
    """

    __slots__ = ("_entry", "batch", "output_view", "outputs", "reader")

    def __init__(
        self,
        batch: StackedAppendAttend,
        reader: RegionReader,
        outputs: SharedOutputs,
        output_view: torch.Tensor | None,
        entry: _Entry | None = None,
    ) -> None:
        self.batch = batch
        self.reader = reader
        self.outputs = outputs
        self.output_view = output_view
        self._entry = entry

    @property
    def rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The batch's tensors as rows, views of the same memory: query ``[b * m, Hq, D]``,
        key and value ``[b * n, Hkv, D]``; made once per entry, so every layer of a step
        shares them (three views a call fewer); None for a call with no entry."""
        entry = self._entry
        if entry is None:
            return None
        if entry.rows is None:
            batch = self.batch
            entry.rows = (
                batch.query.flatten(0, 1),
                batch.key.flatten(0, 1),
                batch.value.flatten(0, 1),
            )
        return entry.rows

    def reply(self, result: AttentionResult) -> bytes:
        """The encoded reply to the call (`shared_outputs.batch_reply`). An output produced
        in place (`result.out` is `output_view`) without lse gets the same reply on every
        layer, kept with the step's entry."""
        entry = self._entry
        if entry is None or result.out is not self.output_view or result.lse is not None:
            return batch_reply(result, self.batch.query.shape, self.outputs)
        if entry.reply is None:
            entry.reply = batch_reply(result, self.batch.query.shape, self.outputs)
        return entry.reply

    def close(self) -> None:
        """The call has ended: its regions may be unmapped (idempotent)."""
        self.outputs.close()
        self.reader.close()

    def __enter__(self) -> DecodedBatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Entry:
    """What a step's later calls reuse: the batch, the regions its tensors view (one per
    view), the output slots' places (region, offset, bytes, dtype, shape) and view, and
    every region it depends on, once each (`regions`: usually the client's one region)."""

    __slots__ = ("batch", "inputs", "lse", "out", "output_view", "regions", "reply", "rows")

    def __init__(
        self,
        batch: StackedAppendAttend,
        inputs: tuple[MappedRegion, ...],
        outputs: SharedOutputs,
        output_view: torch.Tensor | None,
    ) -> None:
        self.batch = batch
        self.inputs = inputs
        self.out = _place(outputs.out)
        self.lse = _place(outputs.lse)
        self.output_view = output_view
        self.reply: bytes | None = None  # the reply to a call whose output is in place
        self.rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        places = [p.region for p in (self.out, self.lse) if p is not None]
        self.regions = tuple(dict.fromkeys([*inputs, *places]))


def _place(slot: OutputSlot | None) -> _SlotPlace | None:
    if slot is None or slot.region is None:
        return None
    return _SlotPlace(slot.region, slot.offset, slot.nbytes, slot.dtype, slot.shape)


class _SlotPlace(NamedTuple):
    """Where an output slot lies (`OutputSlot`'s arguments)."""

    region: MappedRegion
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


class BatchDecodeMemo:
    """Decodes AppendAttendBatch requests, reusing the decode of an earlier call that
    differed only in its layer.

    Args:
        regions: the server's shared-memory regions (entries are kept only where it
            reads inputs as views, `SharedRegions.zero_copy`).
        layout: the service's layout (the decode checks shapes against it).
        capacity: entries kept (least recently used go first).
    """

    def __init__(
        self, regions: SharedRegions, layout: KVLayout, capacity: int = DEFAULT_CAPACITY
    ) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self._regions = regions
        self._layout = layout
        self._capacity = capacity
        self._entries: OrderedDict[tuple[str, bytes], _Entry] = OrderedDict()
        self.hits = 0
        self.misses = 0
        regions.add_drop_listener(self._forget_region)

    def __len__(self) -> int:
        return len(self._entries)

    def decode(self, tenant: str, request: pb.AppendAttendBatchRequest) -> DecodedBatch:
        """The decoded call (close it when the call ends).

        Raises:
            what `decode_append_attend_batch` and `shared_outputs` raise; nothing is held
            then.
        """
        key = self._key(tenant, request)
        if key is not None:
            decoded = self._hit(tenant, key)
            if decoded is not None:
                return decoded
        decoded = self._decode(tenant, request)
        if key is not None:
            self.misses += 1
            inputs = decoded.reader.held
            if len(inputs) == 3:  # key, value and query are all views of regions
                entry = _Entry(decoded.batch, inputs, decoded.outputs, decoded.output_view)
                self._entries[key] = decoded._entry = entry
                if len(self._entries) > self._capacity:
                    self._entries.popitem(last=False)
        return decoded

    def kept(self, tenant: str, request: pb.AppendAttendBatchRequest) -> DecodedBatch | None:
        """The call decoded from a kept entry (as `decode` would return it, its regions
        held: close it), or None without decoding anything when no entry applies."""
        key = self._key(tenant, request)
        return None if key is None else self._hit(tenant, key)

    def _key(self, tenant: str, request: pb.AppendAttendBatchRequest) -> tuple[str, bytes] | None:
        """The request's memo key, or None where nothing is kept (see `_memo_key`)."""
        if not (self._capacity and self._regions.zero_copy):
            return None
        return _memo_key(tenant, request)

    def _hit(self, tenant: str, key: tuple[str, bytes]) -> DecodedBatch | None:
        """The entry under `key` as a call, its regions held; None if there is none, or if
        one of its regions is no longer held by `tenant` (the entry goes: a full decode
        says why)."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        decoded = self._reuse(tenant, entry)
        if decoded is None:
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return decoded

    def _decode(self, tenant: str, request: pb.AppendAttendBatchRequest) -> DecodedBatch:
        reader = self._regions.reader(tenant)
        try:
            batch = decode_append_attend_batch(request, self._layout, reader)
            # Output ranges are checked before the coordinator changes anything.
            outputs = shared_outputs(
                self._regions, tenant, request, batch.query.shape, batch.query.dtype
            )
        except BaseException:
            reader.close()
            raise
        return DecodedBatch(batch, reader, outputs, outputs.output_view())

    def _reuse(self, tenant: str, entry: _Entry) -> DecodedBatch | None:
        """The entry's call, its regions held; None if one of them is no longer held by
        `tenant` (then the full decode says why)."""
        regions = self._regions
        for region in entry.regions:
            if not regions.touch(tenant, region):
                return None
        reader = regions.reader(tenant)
        for region in entry.inputs:
            reader.hold(region)
        out = None if entry.out is None else OutputSlot(*entry.out)
        lse = None if entry.lse is None else OutputSlot(*entry.lse)
        return DecodedBatch(entry.batch, reader, SharedOutputs(out, lse), entry.output_view, entry)

    def _forget_region(self, region_id: str) -> None:
        """A region is being dropped: its views must go before it is unmapped."""
        stale = [
            k for k, e in self._entries.items() if any(r.region_id == region_id for r in e.regions)
        ]
        for k in stale:
            del self._entries[k]


def _memo_key(tenant: str, request: pb.AppendAttendBatchRequest) -> tuple[str, bytes] | None:
    """The request's bytes without its layer, request id and timeout (each call has its
    own), for a request whose three tensors all lie in shared memory; None for one that
    carries bytes (never kept)."""
    if not (
        request.key.HasField("shared")
        and request.value.HasField("shared")
        and request.query.HasField("shared")
    ):
        return None
    layer, request_id, timeout_us = request.layer, request.request_id, request.timeout_us
    request.layer = 0
    request.request_id = ""
    request.timeout_us = 0
    try:
        return tenant, request.SerializeToString(deterministic=True)
    finally:
        request.layer = layer
        request.request_id = request_id
        request.timeout_us = timeout_us
