"""Attention metadata validated once and kept on the pool's device across calls.

A decode step calls the pool once per layer with the same block tables, sequence lengths
and query offsets (the coordinator plans the step once: cache_service.engine.steps).
Checking them (every block id inside the pool, lengths within the tables, offsets ordered)
and copying them to the device on every call would cost more host time than the GPU spends
on the whole write-and-attend of a decode layer. The caller names such
metadata with a step key (`Round.step_key`) it never reuses for other content (a random 63-bit id per
kernel batch); the pool validates and copies it on the first call and keeps the device
copies under the key, least recently used dropped first.

What a hit still checks: that the call has as many query rows as the cached offsets end
with, and the shapes of the tensors passed (a caller bug is refused, never served stale).
A write's slots are kept too, and reused only when the call passes equal slots (a list
comparison, cheap for a decode batch); other slots are validated as usual.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from workers.checks import check_query
from workers.errors import InvalidWorkerRequest
from workers.layout import KVLayout

__all__ = ["CachedMetadata", "MetadataCache"]


@dataclass(frozen=True)
class CachedMetadata:
    """Validated attention metadata on the pool's device.

    Attributes:
        block_tables: int32 ``[S, max_blocks]``.
        seq_lens: int32 ``[S]``.
        query_start_loc: int32 ``[S + 1]``; its last entry is ``num_rows``.
        num_rows: query rows of the calls it serves.
        slot_source, slots: the write's slot mapping as a caller passed it (a copy) and
            validated on the device as int64 ``[n]``, when the key's calls write (every
            layer of a decode step writes the same slots); None before the first write.
        derived: what the pool derives from this metadata once for all the layers it
            serves (keyed by what it is for: a torch attention plan, the write's rows).
    """

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    num_rows: int
    slot_source: list[int] | torch.Tensor | None = None
    slots: torch.Tensor | None = None
    derived: dict[object, object] = field(default_factory=dict, compare=False, repr=False)

    def same_slots(self, slot_mapping: object) -> bool:
        """Whether `slot_mapping` holds the slots kept here (validated, on the device as
        `slots`): a list equal to the kept one, or a host tensor equal to it."""
        source = self.slot_source
        if type(slot_mapping) is list and type(source) is list:
            return slot_mapping == source
        if isinstance(slot_mapping, torch.Tensor) and isinstance(source, torch.Tensor):
            return (
                slot_mapping.device == source.device
                and slot_mapping.shape == source.shape
                and slot_mapping.dtype == source.dtype
                and torch.equal(slot_mapping, source)
            )
        return False

    def tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(block_tables, seq_lens, query_start_loc): the attention's index tensors."""
        return self.block_tables, self.seq_lens, self.query_start_loc

    def shapes(self) -> tuple[torch.Size, torch.Size, torch.Size]:
        return self.block_tables.shape, self.seq_lens.shape, self.query_start_loc.shape


class MetadataCache:
    """Keyed :class:`CachedMetadata` of one pool, at most `capacity` entries."""

    def __init__(self, capacity: int = 16) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._capacity = capacity
        self._entries: OrderedDict[int, CachedMetadata] = OrderedDict()
        # Lookups answered from a kept entry (a planned step's later rounds).
        self.hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: int) -> CachedMetadata | None:
        """The entry stored under `key` (now the most recently used), or None."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: int, entry: CachedMetadata) -> None:
        """Store `entry` under `key`, dropping the least recently used beyond capacity."""
        self._entries[key] = entry
        self._entries.move_to_end(key)
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()

    def lookup(
        self,
        step_key: int | None,
        layout: KVLayout,
        query: torch.Tensor,
        block_tables: object,
        seq_lens: object,
        query_start_loc: object,
    ) -> CachedMetadata | None:
        """The device copies kept under `step_key`, after checking that this call fits
        them (query shape and rows, the shapes of the index tensors passed); None when the
        key is None or unknown (validate and stage as usual). A call passing no index
        tensors (all None) asks for the key's: they must be kept.

        Raises:
            InvalidWorkerRequest: a malformed key, a call that does not fit the metadata
                its key names (a caller reusing a key for other content), or one without
                index tensors whose key names none kept here.
        """
        given_none = block_tables is None and seq_lens is None and query_start_loc is None
        if step_key is None:
            if given_none:
                raise InvalidWorkerRequest(
                    "a round without a step key must carry its block tables, lengths and "
                    "query offsets"
                )
            return None
        if type(step_key) is not int:
            raise InvalidWorkerRequest(
                f"step key must be an int or None, got {type(step_key).__name__}"
            )
        entry = self.get(step_key)
        if entry is None:
            if given_none:
                raise InvalidWorkerRequest(
                    f"step key {step_key} names no metadata kept on this worker (never "
                    "sent, or dropped since): send the round with its block tables"
                )
            return None
        check_query(layout, query)
        # Compared as torch.Size (a tuple: equal to the tuples they hold); tuples for the
        # message only.
        given = (_shape(block_tables), _shape(seq_lens), _shape(query_start_loc))
        if given_none:
            given = entry.shapes()
        if query.shape[0] != entry.num_rows or given != entry.shapes():
            shown = tuple(None if s is None else tuple(s) for s in given)
            raise InvalidWorkerRequest(
                f"step key {step_key} names metadata of {entry.num_rows} query rows "
                f"and index shapes {[list(x) for x in entry.shapes()]}; this call has "
                f"{query.shape[0]} rows and {shown}: a key must name one content"
            )
        self.hits += 1
        return entry

    def remember(
        self,
        step_key: int | None,
        staged: Sequence[torch.Tensor],
        num_rows: int,
        slot_mapping: object = None,
        slots: torch.Tensor | None = None,
    ) -> None:
        """Keep validated index tensors (already on the device: views the next staged copy
        overwrites, hence the copies) under `step_key`, with a write's slots as in
        :meth:`keep`."""
        if step_key is not None:
            tables, lens, starts = (t.clone() for t in staged)
            entry = CachedMetadata(tables, lens, starts, num_rows)
            self.keep(step_key, entry, slot_mapping, slots)

    def keep(
        self,
        step_key: int | None,
        entry: CachedMetadata,
        slot_mapping: object = None,
        slots: torch.Tensor | None = None,
    ) -> None:
        """Store `entry` under `step_key` (None: nothing is kept); with a write's
        `slot_mapping` as passed and its validated device `slots` (a staged view, hence the
        copy), those too, so the key's other layers skip validating and copying them."""
        if step_key is None:
            return
        if slots is not None and (source := _slot_source(slot_mapping)) is not None:
            entry = replace(entry, slot_source=source, slots=slots.clone(), derived={})
        self.put(step_key, entry)


def _shape(t: object) -> torch.Size | None:
    """A tensor's shape; None for anything else (a list of ints, say)."""
    return t.shape if isinstance(t, torch.Tensor) else None


def _slot_source(slot_mapping: object) -> list[int] | torch.Tensor | None:
    """A copy of a write's slot mapping as its caller passed it (a list or a tensor), to
    recognise the same slots in a later call (CachedMetadata.same_slots); None otherwise."""
    if type(slot_mapping) is list:
        return list(slot_mapping)
    if isinstance(slot_mapping, torch.Tensor):
        return slot_mapping.clone()
    return None
