"""A co-located client's side of a worker's lease socket (the worker's side and the wire
format: `workers.lease_server`; what a lease is: `workers.step_leases`).

A :class:`LeaseClient` connects once per session and worker and maps the worker's pool:
the pool tensor and its slot fingerprints (CUDA IPC memory on a GPU, a shared memory file
on a CPU; the very tensors when the worker lives in this process), wrapped in a `KVPool`
of this process. A leased step is then run here, with the pool's own kernels:
:meth:`LeaseClient.open` takes the step's plan from the StepLease reply (the request named
:attr:`LeaseClient.connection`) or fetches it (one message), each layer is
a `KVPool.bind_step` layer on the caller's stream (a CUDA graph replay once the step's
shape was seen), and :meth:`LeaseClient.end` reports the layers written (one message); a lease of several
decode steps goes from one to the next with :meth:`LeaseClient.advance` (the lengths
plus one and the next row of slots, on the device), its report naming the steps run and
their tokens. No tensor
crosses a process boundary and nothing waits for the other process per layer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import socket
import struct
import threading
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from workers.errors import InvalidWorkerRequest, PoolAllocationError, WorkerUnavailable
from workers.layout import KVLayout
from workers.lease_server import (
    CHUNK,
    END,
    END_HEAD,
    ENDED,
    OK,
    OPEN,
    REPLY,
    REQUEST,
    VERSION,
    layer_mask,
    local_pool,
    register_local_event,
)
from workers.metadata_cache import CachedMetadata
from workers.pool import KVPool, MappedPool, StepLayers
from workers.pool_memory import Exported, map_exported
from workers.step_leases import LeaseEnded, LeaseReport, StepPlan

__all__ = ["LeaseClient", "LeasedStep", "leading_rows"]


@dataclass(eq=False)
class LeasedStep:
    """An opened lease: its step on this process's view of the pool.

    Attributes:
        lease_id: the lease.
        step: the current step's metadata on the pool's device.
        num_tokens: a step's new tokens; num_q_heads: its query heads.
        layers: the layers the current step may still write.
        flags: layer -> its finite flag on the device (None: nothing to write), in order,
            for the current step.
        staged: the step's inputs' shapes, the staging buffers for them and the step's
            layers bound to those, set at its first layer (`LeaseClient._staged`).
        steps: the decode steps the lease covers; index: the current one (from 0).
        first: the first step's metadata (the later steps' are derived from it and
            `slots_by_step`, `LeaseClient.advance`).
        slots_by_step: every step's slots ``[steps, n]`` on the pool's device.
        tokens: the token ids of the steps after the first, as `advance` named them.
        refused: the current step's refused layers once its flags were read.
        fetched: the current step's flags on their way to the host (`fetch_flags`): the
            layers, the pinned host tensor and the event recorded after the copy.
        flags_host: the page-locked buffer and event the lease's steps fetch their flags
            through (made at the first fetch, reused by the later steps).
    """

    lease_id: bytes
    step: CachedMetadata
    num_tokens: int
    num_q_heads: int
    layers: set[int]
    flags: dict[int, torch.Tensor | None] = field(default_factory=dict)
    staged: _Staging | None = None
    steps: int = 1
    index: int = 0
    first: CachedMetadata | None = None
    slots_by_step: torch.Tensor | None = None
    all_layers: frozenset[int] = frozenset()
    tokens: list[int] = field(default_factory=list)
    refused: tuple[int, ...] | None = None
    fetched: tuple[list[int], torch.Tensor, torch.cuda.Event] | None = None
    flags_host: tuple[torch.Tensor, torch.cuda.Event] | None = None

    @property
    def more_steps(self) -> bool:
        """Whether the lease covers a step after the current one."""
        return self.index + 1 < self.steps

    def served_flags(self) -> list[tuple[int, torch.Tensor]]:
        """(layer, finite flag) of the current step's layers that had something to
        write, in the order they ran."""
        return [(layer, f) for layer, f in self.flags.items() if f is not None]


class _Staging(NamedTuple):
    """A step's staging (`LeaseClient._staged`): the inputs' shapes, the buffers viewed in
    those shapes, the span of the buffers the three fill (key, value, query one after the
    other), and the step's layers bound to the buffers."""

    shapes: tuple[torch.Size, torch.Size, torch.Size]
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    span: torch.Tensor
    layers: StepLayers


class LeaseClient:
    """One connection to a worker's lease socket, with the worker's pool mapped (a context
    manager: closed on exit).

    Args:
        path: the socket (StepLeaseResponse.socket).
        device: where the caller's tensors live (a CUDA device for a GPU pool).

    Raises:
        WorkerUnavailable: the socket cannot be reached, the worker refused the
            connection, or its pool cannot be mapped here (the message says why).
    """

    def __init__(self, path: str, device: torch.device) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._token = ""
        self._event: torch.cuda.Event | None = None
        hello: dict[str, object] = {"version": VERSION, "pid": os.getpid(), "cuda_event": None}
        local = local_pool(path)
        if device.type == "cuda":
            if local is not None:
                self._token = secrets.token_hex(8)
                self._event = torch.cuda.Event()
                register_local_event(self._token, self._event)
                hello["cuda_event"] = self._token
            else:
                self._event = torch.cuda.Event(interprocess=True)
                self._event.record(torch.cuda.current_stream(device))
                hello["cuda_event"] = self._event.ipc_handle().hex()
        try:
            self._sock.connect(path)
            self._sock.send(json.dumps(hello).encode())
            message, fds, _, _ = socket.recv_fds(self._sock, 1 << 16, 4)
            reply = json.loads(message or b"{}")
        except (OSError, ValueError) as exc:
            self.close()
            raise WorkerUnavailable(path, f"lease socket: {exc}") from None
        try:
            if not reply.get("ok"):
                raise ValueError(f"the worker refused: {reply.get('error', 'closed')}")
            self.pool, self._worker_event = self._map(reply, fds, local, device)
            # Named in a StepLeaseRequest's lease_connections: the grant opens the lease
            # for this connection and the reply carries the plan.
            self.connection = bytes.fromhex(str(reply["connection"]))
        except (ValueError, KeyError, TypeError, RuntimeError, PoolAllocationError) as exc:
            for fd in fds:  # those not mapped (a mapped one is closed already)
                with contextlib.suppress(OSError):
                    os.close(fd)
            self.close()
            raise WorkerUnavailable(path, f"lease socket: {exc}") from None
        self._width = (self.pool.layout.num_layers + 7) // 8
        # Reports sent whose answers are not read yet (the next request reads them).
        self._unanswered = 0
        # A layer's key, value and query in one buffer, reused so that decode graphs
        # replay on them (`_buffers`).
        self._staging: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        """The pool's device."""
        return self.pool.device

    def open(self, lease_id: bytes, plan: bytes = b"") -> LeasedStep | None:
        """Open a granted lease: its step, ready for :meth:`run_layer`; None when it ended
        before it was opened (its layers go by call). The caller must :meth:`end` an
        opened lease, whatever happens to its forward.

        Args:
            lease_id: StepLeaseResponse.lease_id.
            plan: StepLeaseResponse.plan: set when the grant opened the lease for this
                connection (the request named :attr:`connection`); then nothing is asked
                of the worker. Empty: the plan is fetched with an OPEN.

        Raises:
            InvalidWorkerRequest: the worker refused (the lease is open already).
            LeaseEnded: the previous step's report (:meth:`end`) came too late: the worker
                had revoked that lease, so none of its layers was kept.
            WorkerUnavailable: the connection broke.
        """
        with self._lock:
            if plan:
                self._settle()
                body = plan
            else:
                code, body = self._request(REQUEST.pack(OPEN, lease_id))
                if code == ENDED:
                    return None
                if code != OK:
                    raise InvalidWorkerRequest(body.decode(errors="replace"))
        try:
            granted = StepPlan.unpack(body)
        except (ValueError, struct.error) as exc:
            raise InvalidWorkerRequest(f"a malformed step plan: {exc}") from None
        step = self.pool.planned_step(
            granted.block_tables, granted.seq_lens, granted.query_start_loc, granted.slot_mapping
        )
        steps = granted.steps
        per_step = granted.slot_mapping.numel() // steps
        slots_by_step = None
        if steps > 1 and step.slots is not None:
            slots_by_step = step.slots.view(steps, per_step)
            step = dataclasses.replace(step, slots=slots_by_step[0])
        if self._worker_event is not None:
            # The step's blocks as the worker left them (copies, earlier writes).
            torch.cuda.current_stream(self.device).wait_event(self._worker_event)
        layers = frozenset(granted.layers)
        return LeasedStep(
            lease_id,
            step,
            per_step,
            granted.num_q_heads,
            set(layers),
            steps=steps,
            first=step,
            slots_by_step=slots_by_step,
            all_layers=layers,
        )

    def fetch_flags(self, leased: LeasedStep) -> None:
        """Start reading the current step's finite flags to the host without waiting for
        the device (:meth:`step_refused` then waits only if they have not arrived): the
        caller's later work (a model's sampling, whose own wait for the device comes
        anyway) overlaps the step's last kernels."""
        if leased.refused is not None or leased.fetched is not None:
            return
        served = leased.served_flags()
        if not served or served[0][1].device.type != "cuda":
            return  # on the host already: read when asked
        flags = torch.stack([f for _, f in served])
        if leased.flags_host is None or leased.flags_host[0].numel() < flags.numel():
            # One buffer for every step of the lease: the last step's flags were read
            # (`step_refused`, before `advance`) before the next step fetches its own.
            size = max(flags.numel(), len(leased.all_layers))
            leased.flags_host = (
                torch.empty(size, dtype=flags.dtype, pin_memory=True),
                torch.cuda.Event(),
            )
        buffer, done = leased.flags_host
        host = buffer[: flags.numel()]
        host.copy_(flags, non_blocking=True)
        done.record(torch.cuda.current_stream(flags.device))
        leased.fetched = ([layer for layer, _ in served], host, done)

    def step_refused(self, leased: LeasedStep) -> tuple[int, ...]:
        """The current step's layers refused for non-finite inputs (nothing written for
        them), ascending: its finite flags read from the device (a wait for it, unless
        :meth:`fetch_flags` brought them already), once."""
        if leased.refused is None:
            if leased.fetched is not None:
                layers, host, done = leased.fetched
                done.synchronize()
                ok = host.tolist()
            else:
                served = leased.served_flags()
                layers = [layer for layer, _ in served]
                ok = torch.stack([f for _, f in served]).cpu().tolist() if served else []
            refused = [layer for layer, good in zip(layers, ok, strict=True) if not good]
            leased.refused = tuple(sorted(refused))
            leased.fetched = None
        return leased.refused

    def advance(self, leased: LeasedStep, token_ids: list[int]) -> None:
        """Go on to the lease's next decode step: its lengths one more per sequence, its
        row of slots; `token_ids` are its new tokens (one per sequence, in the step's
        order), which the report names. The current step must have run every layer of
        the lease, none refused.

        Raises:
            InvalidWorkerRequest: no step left, the current one not complete (or a
                layer refused), or not one token id per sequence; nothing changed.
        """
        with self._lock:
            first, slots_by_step = leased.first, leased.slots_by_step
            if first is None or slots_by_step is None or not leased.more_steps:
                raise InvalidWorkerRequest(f"the lease's {leased.steps} step(s) are all run")
            if leased.layers or self.step_refused(leased):
                raise InvalidWorkerRequest(
                    f"step {leased.index} of the lease is not complete: layers "
                    f"{sorted(leased.layers)} not run, {list(leased.refused or ())} refused"
                )
            if len(token_ids) != first.num_rows or any(
                type(t) is not int or t < 0 for t in token_ids
            ):
                raise InvalidWorkerRequest(
                    f"a step of the lease names one token id (an int >= 0) for each of its "
                    f"{first.num_rows} sequences, got {len(token_ids)}"
                )
            leased.index += 1
            leased.step = CachedMetadata(
                first.block_tables,
                first.seq_lens + leased.index,
                first.query_start_loc,
                first.num_rows,
                None,
                slots_by_step[leased.index],
            )
            leased.tokens.extend(token_ids)
            leased.layers = set(leased.all_layers)
            leased.flags = {}
            leased.refused = None
            leased.fetched = None
            if leased.staged is not None:
                # Same shapes, same buffers: the bound layers go on to the new metadata.
                leased.staged.layers.advance(leased.step)

    def run_layer(
        self,
        leased: LeasedStep,
        layer: int,
        key: torch.Tensor,
        value: torch.Tensor,
        query: torch.Tensor,
    ) -> torch.Tensor:
        """Write one layer's new K/V and attend its queries, on the caller's stream
        (nothing waits for the device).

        Args:
            key, value: ``[n, Hkv, D]``; query: ``[rows, Hq, D]`` (any float dtype, on the
                pool's device; cast to the pool's), n and rows the step's; or each with
                its leading dimension split in two (``[b, n / b, ...]``, views of any
                strides).

        Returns:
            ``[rows, Hq, D]`` in the pool's dtype, valid until this layer runs again (a
            step later; `StepLayers.run`): consume it before, or clone it.

        Raises:
            InvalidWorkerRequest: a layer the lease does not cover or already ran, or
                inputs of other sizes than the step's; nothing written.
        """
        if layer not in leased.layers:
            raise InvalidWorkerRequest(
                f"layer {layer} is not the lease's to write (outside it, or written already)"
            )
        shapes = (key.shape, value.shape, query.shape)
        with self._lock:
            staged = leased.staged
            if staged is None or staged.shapes != shapes:
                # A step's layers come in one shape: checked, and the buffers viewed in
                # it, once (views cost microseconds of host time each, per layer).
                staged = leased.staged = self._staged(leased, key, value, query)
            span = staged.span
            dtype = span.dtype
            if (
                key.dtype == dtype
                and value.dtype == dtype
                and query.dtype == dtype
                and key.is_contiguous()
                and value.is_contiguous()
                and query.is_contiguous()
            ):
                # One copy for the three (a decode step's inputs are contiguous).
                torch.cat([key.reshape(-1), value.reshape(-1), query.reshape(-1)], out=span)
            else:
                for dst, src in zip(staged.inputs, (key, value, query), strict=True):
                    dst.copy_(src)
            out, leased.flags[layer] = staged.layers.run(layer)
            leased.layers.discard(layer)
            return out

    def _staged(
        self, leased: LeasedStep, key: torch.Tensor, value: torch.Tensor, query: torch.Tensor
    ) -> _Staging:
        """The step's inputs checked against it, and the buffers they are copied into.

        Raises:
            InvalidWorkerRequest: inputs of other sizes than the step's.
        """
        lay = self.pool.layout
        rows, tokens = leading_rows(query), leading_rows(key)
        heads = query.shape[-2]
        if (
            rows != leased.step.num_rows
            or tokens != leased.num_tokens
            or heads != leased.num_q_heads
            or leading_rows(value) != tokens
            or tuple(key.shape[-2:]) != (lay.num_kv_heads, lay.head_dim)
            or tuple(value.shape[-2:]) != (lay.num_kv_heads, lay.head_dim)
            or query.shape[-1] != lay.head_dim
        ):
            raise InvalidWorkerRequest(
                f"the lease's step has {leased.step.num_rows} query rows of {leased.num_q_heads} "
                f"heads and {leased.num_tokens} new tokens of [{lay.num_kv_heads}, "
                f"{lay.head_dim}]; got query {tuple(query.shape)}, key {tuple(key.shape)}, "
                f"value {tuple(value.shape)}"
            )
        span, k, v, q = self._buffers(rows, tokens, heads)
        return _Staging(
            (key.shape, value.shape, query.shape),
            (k.view(key.shape), v.view(value.shape), q.view(query.shape)),
            span,
            self.pool.bind_step(leased.step, k, v, q),
        )

    def end(self, leased: LeasedStep) -> LeaseReport:
        """Report what the lease wrote (waits for the device to finish its layers): the
        steps run, all before the current one complete, and of the current one the
        layers run with finite inputs (written) and the others (refused, nothing
        written); the later steps' token ids. The report is sent without waiting for the
        worker's answer, which the next :meth:`open` or :meth:`end` on this connection
        reads (and raises if the report came too late).

        Raises:
            LeaseEnded / InvalidWorkerRequest: the answer to an earlier report said the
                worker had revoked that lease / refused the report (this one was sent).
            WorkerUnavailable: the connection broke (nothing counts as written).
        """
        refused = self.step_refused(leased)
        written = sorted(set(leased.flags) - set(refused))
        tokens = tuple(leased.tokens)
        report = LeaseReport(tuple(written), refused, leased.index + 1, tokens)
        message = (
            END_HEAD.pack(END, leased.lease_id, self._width, report.steps, len(tokens))
            + layer_mask(report.written, self._width)
            + layer_mask(report.refused, self._width)
            + struct.pack(f"<{len(tokens)}q", *tokens)
        )
        with self._lock:
            if self._event is not None:
                self._event.record(torch.cuda.current_stream(self.device))
            # Sent before the earlier answers are read: this lease ends whatever they say.
            self._send(message)
            self._unanswered += 1
            self._settle(keep=1)
        return report

    def __enter__(self) -> LeaseClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """End the connection (the worker ends its unreported leases, nothing written)."""
        self._sock.close()
        if self._token:
            register_local_event(self._token, None)

    def _map(
        self,
        reply: dict[str, object],
        fds: list[int],
        local: tuple[KVPool, object] | None,
        device: torch.device,
    ) -> tuple[KVPool, torch.cuda.Event | None]:
        """This process's view of the worker's pool, and the worker's event."""
        layout = KVLayout(**reply["layout"])  # type: ignore[arg-type]
        backend = str(reply["backend"])
        if reply["local"]:
            if local is None:
                raise ValueError("the worker says it shares this process, which has no pool there")
            pool, leases = local
            mapped = MappedPool(pool.data, pool.fingerprint_sums)
            event = getattr(leases, "event", None)
        else:
            exported = Exported.from_json(reply["pool"])  # type: ignore[arg-type]
            sums_exported = reply["fingerprints"]
            per = 1 if exported.kind == "memfd" else 0
            data = map_exported(exported, fds[:per], device)
            sums = None
            if sums_exported is not None:
                sums = map_exported(
                    Exported.from_json(sums_exported),  # type: ignore[arg-type]
                    fds[per : 2 * per],
                    device,
                )
            mapped = MappedPool(data, sums)
            event = None
            if reply["event"] is not None:
                event = torch.cuda.Event.from_ipc_handle(device, bytes.fromhex(str(reply["event"])))
        view = KVPool(
            layout,
            int(reply["num_blocks"]),  # type: ignore[arg-type]
            mapped.data.device,
            backend=backend,
            mapped=mapped,
        )
        return view, event

    def _buffers(self, rows: int, tokens: int, heads: int) -> tuple[torch.Tensor, ...]:
        """Staging for a step of these sizes, one buffer (grown when a step needs more):
        the key, value and query laid out one after the other from its start, so that one
        copy fills them (their span first)."""
        lay = self.pool.layout
        kv = tokens * lay.num_kv_heads * lay.head_dim
        qo = rows * heads * lay.head_dim
        need = 2 * kv + qo
        if self._staging is None or self._staging.numel() < need:
            self._staging = torch.zeros(need, dtype=lay.torch_dtype(), device=self.device)
        flat = self._staging
        kv_shape = (tokens, lay.num_kv_heads, lay.head_dim)
        return (
            flat[:need],
            flat[:kv].view(kv_shape),
            flat[kv : 2 * kv].view(kv_shape),
            flat[2 * kv : need].view(rows, heads, lay.head_dim),
        )

    def _request(self, message: bytes) -> tuple[int, bytes]:
        """Send one request (after reading the answers to earlier reports); its reply
        (code, body)."""
        self._settle()
        self._send(message)
        return self._reply()

    def _settle(self, keep: int = 0) -> None:
        """Read the answers to the reports sent without waiting (:meth:`end`), all but the
        last `keep`.

        Raises:
            LeaseEnded: the worker had revoked a reported lease; InvalidWorkerRequest: it
                refused a report.
        """
        while self._unanswered > keep:
            self._unanswered -= 1
            code, body = self._reply()
            if code == ENDED:
                raise LeaseEnded(
                    "the worker revoked the previous step's lease before its report (the "
                    f"step took longer than the lease's timeout): none of it was kept; {body.decode(errors='replace')}"
                )
            if code != OK:
                raise InvalidWorkerRequest(body.decode(errors="replace"))

    def _send(self, message: bytes) -> None:
        try:
            self._sock.send(message)
        except OSError as exc:
            raise WorkerUnavailable(self.path, f"lease socket: {exc}") from None

    def _reply(self) -> tuple[int, bytes]:
        """The next reply (code, body), reassembled from its datagrams."""
        try:
            first = self._sock.recv(CHUNK)
            if len(first) < REPLY.size:
                raise OSError("the worker closed the connection")
            code, length = REPLY.unpack_from(first)
            parts = [first[REPLY.size :]]
            got = len(parts[0])
            while got < length:
                part = self._sock.recv(CHUNK)
                if not part:
                    raise OSError("the worker closed the connection")
                parts.append(part)
                got += len(part)
        except OSError as exc:
            raise WorkerUnavailable(self.path, f"lease socket: {exc}") from None
        return code, b"".join(parts)


def leading_rows(t: torch.Tensor) -> int:
    """Rows of `t` once its leading dimensions are flattened (all but the last two)."""
    n = 1
    for size in t.shape[:-2]:
        n *= size
    return n
