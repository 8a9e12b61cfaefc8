"""Step leases: the layers of a planned step, served to a co-located client directly.

A model's decode step sends every layer the same sequences, tokens and slots; the
coordinator plans the step once, and a *lease* lets the client send the step's layers
straight to this worker (`workers.lease_server`), without the coordinator on
the per-layer path. The coordinator grants a lease with the step's validated metadata and
the layers it may write, holds the step's sequences meanwhile, and ends it: the worker then
reports which layers it wrote, and the coordinator commits exactly those.

What a lease can do is what the coordinator planned: write the step's slots and attend
over the step's block tables, each allowed layer at most once. A layer whose inputs are
not all finite writes nothing (the write is masked on the device, no wait for the host);
the client learns it from :meth:`StepLeases.refused` at the end of its step, and the
coordinator from :meth:`StepLeases.end`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from workers.errors import InvalidWorkerRequest
from workers.metadata_cache import CachedMetadata
from workers.pool import IndexLike, KVPool

__all__ = ["LEASE_ID_BYTES", "LeaseEnded", "LeaseReport", "StepBuffers", "StepLeases"]

LEASE_ID_BYTES = 16


class LeaseEnded(InvalidWorkerRequest):
    """The lease is unknown or ended (the coordinator took the step back): nothing was
    written; the client sends the layer through the coordinator instead."""


@dataclass(frozen=True)
class LeaseReport:
    """What a lease did, when it ended.

    Attributes:
        written: layers whose K/V the lease wrote, ascending.
        refused: layers served but refused for a NaN or infinite input (nothing written).
    """

    written: tuple[int, ...]
    refused: tuple[int, ...]


class StepBuffers(Protocol):
    """Where a connection's client puts a layer's inputs and finds its output: tensors on
    the pool's device in its dtype, made by the lease server (`workers.lease_server`).

    Attributes:
        key, value: ``[tokens, Hkv, D]``; query, out: ``[rows, Hq, D]`` (a step uses their
            leading rows).
    """

    key: torch.Tensor
    value: torch.Tensor
    query: torch.Tensor
    out: torch.Tensor


@dataclass
class _Lease:
    step: CachedMetadata
    layers: frozenset[int]
    num_q_heads: int
    num_tokens: int
    # layer -> its finite flag on the device (None: nothing to write), in serving order.
    served: dict[int, torch.Tensor | None] = field(default_factory=dict)
    # The buffers last served from and the step's views of them (key, value, query, out),
    # checked once: a lease's layers come from one connection.
    buffers: StepBuffers | None = None
    views: tuple[torch.Tensor, ...] = ()
    # (layers served when last checked, those refused): an end after the client's check
    # reports without waiting for the device again.
    checked: tuple[int, list[int]] = (-1, [])


class StepLeases:
    """The leases of one pool. Thread-safe: grants and ends come from the coordinator's
    calls, layers from the lease server's threads; every pool operation holds `lock`.

    Args:
        pool: the pool the leases write.
        lock: the lock every call on `pool` holds.
        capacity: leases held at once (a grant beyond it is refused).
    """

    def __init__(self, pool: KVPool, lock: threading.Lock, capacity: int = 1024) -> None:
        self._pool = pool
        self._lock = lock
        self._capacity = capacity
        self._leases: dict[bytes, _Lease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def grant(
        self,
        lease_id: bytes,
        layers: Iterable[int],
        block_tables: torch.Tensor | Sequence[Sequence[int]],
        seq_lens: IndexLike,
        query_start_loc: IndexLike,
        slot_mapping: Sequence[int],
        num_q_heads: int,
    ) -> None:
        """Register a lease on a planned step. The caller holds the pool's lock.

        Args:
            lease_id: `LEASE_ID_BYTES` random bytes.
            layers: the layers the lease may write, each at most once.
            block_tables, seq_lens, query_start_loc, slot_mapping, num_q_heads: the step
                (as `KVPool.step_metadata` takes them).

        Raises:
            InvalidWorkerRequest: a malformed id, layer or step, an id in use, or too many
                leases; nothing registered.
        """
        if type(lease_id) is not bytes or len(lease_id) != LEASE_ID_BYTES:
            raise InvalidWorkerRequest(f"a lease id is {LEASE_ID_BYTES} bytes")
        if lease_id in self._leases:
            raise InvalidWorkerRequest("that lease id is in use")
        if len(self._leases) >= self._capacity:
            raise InvalidWorkerRequest(f"this worker holds {self._capacity} leases already")
        num_layers = self._pool.layout.num_layers
        allowed = frozenset(layers)
        if not allowed or any(type(x) is not int or not 0 <= x < num_layers for x in allowed):
            raise InvalidWorkerRequest(f"a lease's layers must be ints in [0, {num_layers})")
        step = self._pool.step_metadata(
            block_tables, seq_lens, query_start_loc, slot_mapping, num_q_heads
        )
        self._leases[lease_id] = _Lease(step, allowed, num_q_heads, len(slot_mapping))

    def serve(self, lease_id: bytes, layer: int, buffers: StepBuffers) -> None:
        """Write and attend one layer of the lease's step (`KVPool.run_step_layer`) from
        and into `buffers`, enqueued on the current stream.

        Raises:
            LeaseEnded: no such lease (ended, or never granted).
            InvalidWorkerRequest: a layer the lease does not allow or already served, or
                buffers too small or of other heads for the step; nothing written.
        """
        with self._lock:
            lease = self._get(lease_id)
            if lease.buffers is not buffers:
                lease.views = self._views(lease, buffers)
                lease.buffers = buffers
            if layer not in lease.layers:
                raise InvalidWorkerRequest(f"the lease does not cover layer {layer}")
            if layer in lease.served:
                raise InvalidWorkerRequest(f"layer {layer} was already written under this lease")
            lease.served[layer] = self._pool.run_step_layer(lease.step, layer, *lease.views)

    def refused(self, lease_id: bytes) -> list[int]:
        """The lease's layers served so far whose inputs were not all finite (nothing
        written for them); waits for the device to finish them.

        Raises:
            LeaseEnded: no such lease.
        """
        with self._lock:
            lease = self._get(lease_id)
            served = list(lease.served.items())
        refused = _refused(served)
        lease.checked = (len(served), refused)
        return refused

    def end(self, lease_id: bytes) -> LeaseReport:
        """End a lease (later layers on it raise LeaseEnded) and report what it wrote;
        waits for the device to finish its layers unless the client's last check
        (:meth:`refused`) saw them all. An unknown id reports nothing written.
        """
        with self._lock:
            lease = self._leases.pop(lease_id, None)
        if lease is None:
            return LeaseReport((), ())
        served = list(lease.served.items())
        count, refused = lease.checked
        if count != len(served):
            refused = _refused(served)
        written = tuple(sorted(layer for layer, _ in served if layer not in refused))
        return LeaseReport(written, tuple(sorted(refused)))

    def _views(self, lease: _Lease, buffers: StepBuffers) -> tuple[torch.Tensor, ...]:
        """The step's leading rows of `buffers` (key, value, query, out), checked to fit."""
        rows, tokens, heads = lease.step.num_rows, lease.num_tokens, lease.num_q_heads
        if rows > buffers.query.shape[0] or tokens > buffers.key.shape[0]:
            raise InvalidWorkerRequest(
                f"the lease's step has {rows} query rows and {tokens} new tokens; this "
                f"connection stages {buffers.query.shape[0]} and {buffers.key.shape[0]}"
            )
        if heads != buffers.query.shape[1]:
            raise InvalidWorkerRequest(
                f"the lease's step has {heads} query heads, the connection {buffers.query.shape[1]}"
            )
        return (
            buffers.key[:tokens],
            buffers.value[:tokens],
            buffers.query[:rows],
            buffers.out[:rows],
        )

    def clear(self) -> None:
        """End every lease without a report (a newer coordinator claimed the pool: the old
        grants mean nothing). The caller holds the pool's lock."""
        self._leases.clear()

    def _get(self, lease_id: bytes) -> _Lease:
        lease = self._leases.get(lease_id)
        if lease is None:
            raise LeaseEnded("the lease ended (or was never granted): send the layer by call")
        return lease


def _refused(served: list[tuple[int, torch.Tensor | None]]) -> list[int]:
    """The layers whose finite flag says False (one wait for all of them)."""
    flags = [(layer, f) for layer, f in served if f is not None]
    if not flags:
        return []
    values = torch.stack([f for _, f in flags]).cpu().tolist()
    return [layer for (layer, _), ok in zip(flags, values, strict=True) if not ok]
