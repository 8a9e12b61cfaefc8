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

A lease of several decode steps (`StepPlan.steps`) carries every step's slots; the client
runs step i with the first step's lengths plus i, and its report names the steps it ran
(all but the last on every layer) and the later steps' token ids, which the coordinator
learns only then.

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

__all__ = ["LEASE_ID_BYTES", "MAX_STEPS", "LeaseEnded", "LeaseReport", "StepLeases", "StepPlan"]

LEASE_ID_BYTES = 16
# The most decode steps one lease covers (the report carries its step count in 16 bits).
MAX_STEPS = 256
# The plan's header: sequences, block-table width, slots, query heads, layers, steps.
_HEADER = struct.Struct("<6I")
# The dtypes of the plan's arrays on the wire: tables, lengths, offsets, slots, layers.
_DTYPES = (torch.int32, torch.int32, torch.int32, torch.int64, torch.int32)


class LeaseEnded(InvalidWorkerRequest):
    """The lease is unknown or ended (the coordinator took the step back): nothing was
    written; the client sends the step's layers by call instead."""


@dataclass(frozen=True)
class LeaseReport:
    """What a lease did, when it ended.

    Attributes:
        written: layers whose K/V the lease wrote, ascending: in its last step run.
        refused: layers run but refused for a NaN or infinite input (nothing written).
        steps: the steps the client ran (a multi-step lease's decode steps), the last
            one writing `written`; each before it wrote every layer of the lease.
        tokens: the token ids of steps 2..`steps` (`steps - 1` rows of one per
            sequence, flat, step by step): the first step's the coordinator knew.
    """

    written: tuple[int, ...]
    refused: tuple[int, ...]
    steps: int = 1
    tokens: tuple[int, ...] = ()


@dataclass(frozen=True)
class StepPlan:
    """A granted step as the client runs it (host tensors, validated by the worker).

    Attributes:
        block_tables: int32 ``[S, max_blocks]``; seq_lens: int32 ``[S]``;
            query_start_loc: int32 ``[S + 1]`` (as `KVPool.step_metadata` takes them).
        slot_mapping: int64 ``[steps * n]``: the new tokens' flat slots, none negative,
            step by step.
        num_q_heads: query heads of the step's layers.
        layers: the layers the lease may write, ascending.
        steps: decode steps the lease covers: step i (from 0) attends with lengths
            ``seq_lens + i`` over the same tables (which hold every step's blocks) and
            writes ``slot_mapping[i * n:(i + 1) * n]``; each sequence sends one token a
            step when steps > 1.
    """

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    slot_mapping: torch.Tensor
    num_q_heads: int
    layers: tuple[int, ...]
    steps: int = 1

    def pack(self) -> bytes:
        """The plan as bytes (little-endian: the header, then the int32 tables, lengths
        and offsets, the int64 slots, the int32 layers)."""
        s, width = self.block_tables.shape
        head = _HEADER.pack(
            s, width, self.slot_mapping.numel(), self.num_q_heads, len(self.layers), self.steps
        )
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
        s, width, n, heads, count, steps = _HEADER.unpack_from(data)
        if steps < 1 or n % steps:
            raise ValueError(f"a step plan of {steps} steps and {n} slots")
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
        return cls(tables.view(s, width), lens, starts, slots, heads, tuple(layers.tolist()), steps)


@dataclass(eq=False)
class _Lease:
    layers: frozenset[int]
    packed: bytes  # the plan, as OPEN answers it (`StepPlan.pack`)
    steps: int
    rows: int  # sequences: a report names steps - 1 rows of this many tokens
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
        steps: int = 1,
    ) -> bytes | None:
        """Register a lease on a planned step, validated as a round's metadata is.

        Args:
            lease_id: `LEASE_ID_BYTES` random bytes.
            layers: the layers the lease may write, each at most once.
            block_tables, seq_lens, query_start_loc, slot_mapping, num_q_heads: the step
                (as `KVPool.step_metadata` takes them); with several steps, the first
                step's lengths and every step's slots, step by step (`StepPlan`).
            connection: the token of the client's lease connection (`connect`), or None.
            steps: decode steps the lease covers (one new token per sequence each when
                more than one); the tables must hold the last step's keys.

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
        if type(steps) is not int or not 1 <= steps <= MAX_STEPS:
            raise InvalidWorkerRequest(f"a lease covers 1 to {MAX_STEPS} steps, got {steps!r}")
        lens = torch.as_tensor(seq_lens)
        rows = lens.numel()
        if steps > 1:
            starts = torch.as_tensor(query_start_loc)
            if len(slot_mapping) != steps * rows or not torch.equal(
                starts.to(torch.int64), torch.arange(rows + 1)
            ):
                raise InvalidWorkerRequest(
                    f"a lease of {steps} steps sends one token per sequence a step: "
                    f"query_start_loc 0..{rows} and {steps * rows} slots, got "
                    f"{len(slot_mapping)} slots"
                )
            # Checked as its last step, whose keys the tables must hold.
            lens = lens + (steps - 1)
        tables, last_lens, starts, slots = self._pool.check_step(
            block_tables, lens, query_start_loc, slot_mapping, num_q_heads
        )
        first_lens = last_lens - (steps - 1)
        plan = StepPlan(tables, first_lens, starts, slots, num_q_heads, tuple(allowed), steps)
        with self._changed:
            if lease_id in self._leases:
                raise InvalidWorkerRequest("that lease id is in use")
            if len(self._leases) >= self._capacity:
                raise InvalidWorkerRequest(f"this worker holds {self._capacity} leases already")
            opener = None if connection is None else self._connections.get(connection)
            lease = _Lease(frozenset(plan.layers), plan.pack(), steps, rows, opener)
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
        self,
        lease_id: bytes,
        connection: object,
        written: Iterable[int],
        refused: Iterable[int],
        steps: int = 1,
        tokens: Sequence[int] = (),
    ) -> None:
        """What the client did under a lease it opened (`LeaseReport`): the steps it ran,
        the layers of the last one it wrote and refused, the later steps' token ids; the
        lease counts as done (no more layers).

        Raises:
            LeaseEnded: no such lease. InvalidWorkerRequest: not opened by `connection`,
            reported already, layers outside the lease or in both sets, more steps than
            the lease's, or not one token per sequence for each step after the first.
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
            if not 1 <= steps <= lease.steps or len(tokens) != (steps - 1) * lease.rows:
                raise InvalidWorkerRequest(
                    f"a report of {steps} steps with {len(tokens)} token ids; the lease "
                    f"covers {lease.steps} steps of {lease.rows} sequences"
                )
            if any(t < 0 for t in tokens):
                raise InvalidWorkerRequest("a report's token ids must be non-negative")
            lease.report = LeaseReport(tuple(done), tuple(bad), steps, tuple(tokens))
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
