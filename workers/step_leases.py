"""Step leases: a planned step that a co-located client runs on the worker's pool itself.

A model's step sends every layer the same sequences, tokens and slots; the coordinator
plans the step once and *grants* a lease on it: the step's validated metadata (block
tables, lengths, query offsets, the new tokens' slots) and the layers it may write. The
client, on this host, has mapped the pool (`workers.lease_server`, `workers.pool_memory`):
it *opens* the lease, receives the plan, runs the step's layers with the pool's own
kernels in its process (`KVPool.bind_step` on its view of the pool), and *reports*
which layers it wrote and which it refused (inputs not all finite: nothing written). When
the coordinator *ends* the lease, it commits exactly the reported layers. A grant that
names the client's lease connection (its token, from the connection's hello) opens the
lease for that connection at once: the plan goes back with the grant, and the client
needs no OPEN round trip.

Between the open and the report the client writes the step's slots, so an opened lease
ends only once it is reported, once its connection closes (the client is gone), or, after
`wait`'s bound, by *revoking* it: its connection is closed and nothing counts as written.
A lease ended before it was opened is simply gone: the client's open answers ENDED and
its layers go as calls.

Ordering on a GPU: the grant records the pool's event on the worker's stream (the
step's copy-on-write copies and earlier writes are before it) and the client's stream
waits for it before the step's first layer; the report arrives after the worker's stream
was made to wait for the client's event, so whatever the worker does with those blocks
afterwards comes after the client's writes.
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from workers.errors import InvalidWorkerRequest
from workers.pool import IndexLike, KVPool

__all__ = ["LEASE_ID_BYTES", "LeaseEnded", "LeaseReport", "StepLeases", "StepPlan"]

LEASE_ID_BYTES = 16
# The plan's header: sequences, block-table width, new tokens, query heads, layers.
_HEADER = struct.Struct("<5I")
# The dtypes of the plan's arrays on the wire: tables, lengths, offsets, slots, layers.
_DTYPES = (torch.int32, torch.int32, torch.int32, torch.int64, torch.int32)


class LeaseEnded(InvalidWorkerRequest):
    """The lease is unknown or ended (the coordinator took the step back): nothing was
    written; the client sends the step's layers by call instead."""


@dataclass(frozen=True)
class LeaseReport:
    """What a lease did, when it ended.

    Attributes:
        written: layers whose K/V the lease wrote, ascending.
        refused: layers run but refused for a NaN or infinite input (nothing written).
    """

    written: tuple[int, ...]
    refused: tuple[int, ...]


@dataclass(frozen=True)
class StepPlan:
    """A granted step as the client runs it (host tensors, validated by the worker).

    Attributes:
        block_tables: int32 ``[S, max_blocks]``; seq_lens: int32 ``[S]``;
            query_start_loc: int32 ``[S + 1]`` (as `KVPool.step_metadata` takes them).
        slot_mapping: int64 ``[n]``: the new tokens' flat slots, none negative.
        num_q_heads: query heads of the step's layers.
        layers: the layers the lease may write, ascending.
    """

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    slot_mapping: torch.Tensor
    num_q_heads: int
    layers: tuple[int, ...]

    def pack(self) -> bytes:
        """The plan as bytes (little-endian: the header, then the int32 tables, lengths
        and offsets, the int64 slots, the int32 layers)."""
        s, width = self.block_tables.shape
        head = _HEADER.pack(s, width, self.slot_mapping.numel(), self.num_q_heads, len(self.layers))
        arrays = (
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            self.slot_mapping,
            torch.tensor(self.layers),
        )
        return head + b"".join(
            a.to(d).contiguous().numpy().tobytes() for a, d in zip(arrays, _DTYPES, strict=True)
        )

    @classmethod
    def unpack(cls, data: bytes) -> StepPlan:
        """The plan :meth:`pack` wrote.

        Raises:
            ValueError: bytes of another length than the header says.
        """
        s, width, n, heads, count = _HEADER.unpack_from(data)
        counts = (s * width, s, s + 1, n, count)
        total = _HEADER.size + sum(c * d.itemsize for c, d in zip(counts, _DTYPES, strict=True))
        if len(data) != total:
            raise ValueError(f"a step plan of {len(data)} bytes, expected {total}")
        buf = bytearray(data)  # writable: the tensors below are views of it
        offset = _HEADER.size
        out = []
        for c, dtype in zip(counts, _DTYPES, strict=True):
            out.append(
                torch.frombuffer(buf, dtype=dtype, count=c, offset=offset)
                if c
                else torch.empty(0, dtype=dtype)
            )
            offset += c * dtype.itemsize
        tables, lens, starts, slots, layers = out
        return cls(tables.view(s, width), lens, starts, slots, heads, tuple(layers.tolist()))


@dataclass(eq=False)
class _Lease:
    layers: frozenset[int]
    packed: bytes  # the plan, as OPEN answers it (`StepPlan.pack`)
    # The connection that opened it (None: not opened) and what it reported.
    opened_by: object | None = None
    report: LeaseReport | None = None


class StepLeases:
    """The leases of one pool. Thread-safe: grants and ends come from the coordinator's
    calls, opens and reports from the lease server's connection threads.

    Args:
        pool: the pool the leases are on.
        capacity: leases held at once (a grant beyond it is refused).
    """

    def __init__(self, pool: KVPool, capacity: int = 1024) -> None:
        self._pool = pool
        self._capacity = capacity
        self._leases: dict[bytes, _Lease] = {}
        # Lease connections by the token their hello gave (`connect`).
        self._connections: dict[bytes, object] = {}
        self._changed = threading.Condition()
        # Called with a connection whose lease is revoked (the lease server closes it).
        self.on_revoke: Callable[[object], None] | None = None
        # Recorded on the worker's stream at each grant: a client's stream waits for it
        # before a step's first layer (CUDA pools only).
        self.event = torch.cuda.Event(interprocess=True) if pool.device.type == "cuda" else None

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
        connection: bytes | None = None,
    ) -> bytes | None:
        """Register a lease on a planned step, validated as a round's metadata is.

        Args:
            lease_id: `LEASE_ID_BYTES` random bytes.
            layers: the layers the lease may write, each at most once.
            block_tables, seq_lens, query_start_loc, slot_mapping, num_q_heads: the step
                (as `KVPool.step_metadata` takes them).
            connection: the token of the client's lease connection (`connect`), or None.

        Returns:
            The packed plan (`StepPlan.pack`) when `connection` names a live connection:
            the lease is then open for it, as if it had sent OPEN. None: the client opens
            the lease itself (no such connection, or it closed meanwhile).

        Raises:
            InvalidWorkerRequest: a malformed id, layer or step, an id in use, or too many
                leases; nothing registered.
        """
        if type(lease_id) is not bytes or len(lease_id) != LEASE_ID_BYTES:
            raise InvalidWorkerRequest(f"a lease id is {LEASE_ID_BYTES} bytes")
        num_layers = self._pool.layout.num_layers
        allowed = sorted(set(layers))
        if not allowed or any(type(x) is not int or not 0 <= x < num_layers for x in allowed):
            raise InvalidWorkerRequest(f"a lease's layers must be ints in [0, {num_layers})")
        step = self._pool.check_step(
            block_tables, seq_lens, query_start_loc, slot_mapping, num_q_heads
        )
        plan = StepPlan(*step, num_q_heads, tuple(allowed))
        with self._changed:
            if lease_id in self._leases:
                raise InvalidWorkerRequest("that lease id is in use")
            if len(self._leases) >= self._capacity:
                raise InvalidWorkerRequest(f"this worker holds {self._capacity} leases already")
            opener = None if connection is None else self._connections.get(connection)
            lease = _Lease(frozenset(plan.layers), plan.pack(), opener)
            self._leases[lease_id] = lease
        if self.event is not None:
            self.event.record(torch.cuda.current_stream(self._pool.device))
        return lease.packed if opener is not None else None

    def connect(self, token: bytes, connection: object) -> None:
        """Register a lease connection under `token` (its hello's): a grant naming the
        token opens its lease for `connection` (until :meth:`disconnected`)."""
        with self._changed:
            self._connections[token] = connection

    def open(self, lease_id: bytes, connection: object) -> bytes:
        """Open a granted lease for `connection`: its packed plan (`StepPlan.pack`).

        Raises:
            LeaseEnded: no such lease (ended, or never granted).
            InvalidWorkerRequest: the lease is open already.
        """
        with self._changed:
            lease = self._get(lease_id)
            if lease.opened_by is not None:
                raise InvalidWorkerRequest("the lease is open already")
            lease.opened_by = connection
            return lease.packed

    def report(
        self, lease_id: bytes, connection: object, written: Iterable[int], refused: Iterable[int]
    ) -> None:
        """What the client did under a lease it opened: the layers it wrote and those it
        refused; the lease counts as done (no more layers).

        Raises:
            LeaseEnded: no such lease. InvalidWorkerRequest: not opened by `connection`,
            reported already, or layers outside the lease or in both sets.
        """
        done, bad = sorted(set(written)), sorted(set(refused))
        with self._changed:
            lease = self._get(lease_id)
            if lease.opened_by is not connection:
                raise InvalidWorkerRequest("the lease was not opened on this connection")
            if lease.report is not None:
                raise InvalidWorkerRequest("the lease was reported already")
            allowed = lease.layers
            if not allowed.issuperset(done + bad) or set(done) & set(bad):
                raise InvalidWorkerRequest(
                    f"a report names layers the lease does not cover or twice: written "
                    f"{done}, refused {bad}, the lease's {sorted(allowed)}"
                )
            lease.report = LeaseReport(tuple(done), tuple(bad))
            self._changed.notify_all()

    def end(self, lease_id: bytes) -> LeaseReport | None:
        """End a lease without waiting: what it wrote, or None while it is open and not
        yet reported (then :meth:`wait`). An unknown id reports nothing written."""
        with self._changed:
            lease = self._leases.get(lease_id)
            if lease is None:
                return LeaseReport((), ())
            if lease.opened_by is not None and lease.report is None:
                return None
            del self._leases[lease_id]
            return lease.report or LeaseReport((), ())

    def wait(self, lease_id: bytes, timeout_s: float) -> LeaseReport:
        """End a lease, waiting up to `timeout_s` for its client's report; past that the
        lease is revoked: its connection is closed and nothing counts as written."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                report = self.end(lease_id)
                left = deadline - time.monotonic()
                if report is not None or left <= 0:
                    break
                self._changed.wait(left)
            if report is not None:
                return report
            lease = self._leases.pop(lease_id)
        if self.on_revoke is not None:
            self.on_revoke(lease.opened_by)
        return LeaseReport((), ())

    def disconnected(self, connection: object) -> None:
        """`connection` closed: its open leases that never reported count as writing
        nothing (whatever their client wrote lies beyond what the coordinator commits)."""
        with self._changed:
            for token in [t for t, c in self._connections.items() if c is connection]:
                del self._connections[token]
            for lease in self._leases.values():
                if lease.opened_by is connection and lease.report is None:
                    lease.report = LeaseReport((), ())
            self._changed.notify_all()

    def clear(self) -> None:
        """End every lease without a report (a newer coordinator claimed the pool: the old
        grants mean nothing)."""
        with self._changed:
            self._leases.clear()
            self._changed.notify_all()

    def _get(self, lease_id: bytes) -> _Lease:
        lease = self._leases.get(lease_id)
        if lease is None:
            raise LeaseEnded("the lease ended (or was never granted): send the layers by call")
        return lease
