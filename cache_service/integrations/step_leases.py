"""A model's step leases: a forward's layers run on the worker's pool from the model's
process.

When the model's process shares a host with the service (a local session), a forward
that holds no lease asks the service to plan the step of its new tokens (:meth:`StepLeaser.request` when it
begins, :meth:`StepLeaser.granted` at its first attention layer: one call, no tensors).
The model's process has mapped the pool of the worker holding the batch
(`workers.lease_client`: CUDA IPC memory on a GPU, a shared memory file on a CPU) and runs
every layer of the step there itself, with the pool's kernels on the model's own stream:
no tensor is copied to another process and nothing waits for one. At the forward's end
:meth:`StepLeaser.end` reports the layers written, which the service commits. A decode
forward's lease covers the next ones too (up to `SessionConfig.lease_steps`): the
session keeps it between forwards (:meth:`StepLeaser.keeps`) and takes its next step for
the next forward (:meth:`StepLeaser.next_step`, no call to the service), and the report
at its end names their tokens. A lease that
ended before its first layer makes the layers go as calls instead; nothing else changes.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import grpc
import torch

from cache_service.client.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    KVCacheError,
    UnavailableError,
)
from workers.errors import InvalidWorkerRequest, WorkerUnavailable
from workers.lease_client import LeaseClient, LeasedStep
from workers.step_leases import LeaseEnded

__all__ = ["ActiveLease", "LeaseRequest", "StepLeaser"]

log = logging.getLogger("kvcache.step_leases")


@dataclass
class ActiveLease:
    """A granted lease: its id, the worker's socket, the layers it may still write, its
    plan when the grant opened it for this process's connection, its step once opened
    (at its first layer; it knows the decode steps the lease covers) and the time after
    which it starts no other step (`time.monotonic()` seconds)."""

    lease_id: bytes
    socket: str
    layers: set[int]
    plan: bytes = b""
    opened: LeasedStep | None = None
    deadline: float = math.inf


class LeaseRequest(NamedTuple):
    """A lease request in flight (:meth:`StepLeaser.request`): the client's pending
    answer and when it was sent (`time.monotonic()` seconds)."""

    pending: Any
    sent: float


class StepLeaser:
    """The leases and lease connections of one model (one per worker socket).

    Args:
        client: the service client (its `start_lease_step`; a client without one never
            leases).
        num_q_heads: the model's query heads.
    """

    def __init__(self, client: Any, num_q_heads: int) -> None:
        self._start_lease_step = getattr(client, "start_lease_step", None)
        self._num_q_heads = num_q_heads
        self._clients: dict[str, LeaseClient] = {}
        # Sockets that cannot be used from here (another host's, a GPU pool for CPU
        # tensors, a pool this process cannot map).
        self._unusable: set[str] = set()

    def request(
        self, seq_ids: list[str], token_ids: list[list[int]], steps: int = 1
    ) -> LeaseRequest | None:
        """Ask the service to plan the step of these new tokens (per sequence, any
        counts; with `steps` > 1, one each and that many decode steps) for a lease,
        without waiting: :meth:`granted` reads the answer (the caller's work between the
        two overlaps the service's planning) and must be called. None: no lease to ask
        for (no local session, or it is busy)."""
        if self._start_lease_step is None:
            return None
        # The grant opens the lease for our connection to its worker, if we have one, and
        # sends the plan with the answer: no OPEN round trip at the first layer.
        connections = {path: client.connection for path, client in self._clients.items()}
        sent = time.monotonic()
        pending = self._start_lease_step(
            seq_ids, self._num_q_heads, token_ids, lease_connections=connections, steps=steps
        )
        return None if pending is None else LeaseRequest(pending, sent)

    def granted(self, requested: LeaseRequest | None) -> ActiveLease | None:
        """The lease :meth:`request` asked for; or None (none was asked, the step does not
        qualify, or its worker cannot be reached from here): the layers then go as calls.

        Raises:
            KVCacheError: the service refused the request (nothing is held then).
        """
        if requested is None:
            return None
        reply = requested.pending.result()
        if not reply.granted or reply.socket in self._unusable:
            return None
        return ActiveLease(
            reply.lease_id,
            reply.socket,
            set(reply.layers),
            reply.plan,
            # Half its time: a step begun later might outlive the lease (the worker
            # revokes an opened one only after as long again).
            deadline=requested.sent + reply.timeout_us / 2e6,
        )

    def next_step(self, lease: ActiveLease, token_ids: list[int]) -> bool:
        """Run the lease's next decode step (its new tokens, one per sequence in the
        lease's order) if it has one and the last step completed with none of its layers
        refused: True; False when not (or the lease was never opened, or its time is half
        gone: a step begun later might outlive it): then :meth:`end` it (which raises
        for refused layers) and ask for another.

        Raises:
            InvalidArgumentError: not one token id per sequence (nothing changed).
        """
        opened = lease.opened
        if (
            opened is None
            or not opened.more_steps
            or opened.layers
            or time.monotonic() > lease.deadline
        ):
            return False
        client = self._clients[lease.socket]
        if client.step_refused(opened):
            return False
        try:
            client.advance(opened, token_ids)
        except InvalidWorkerRequest as exc:
            raise self._client_error(lease.socket, exc) from None
        lease.layers = set(opened.all_layers)
        return True

    def keeps(self, lease: ActiveLease) -> bool:
        """At the end of a forward that ran every layer under `lease`: whether the lease
        may go on to another step (it has one); False: :meth:`end` it now. Whether the
        step's layers were all written is read on the way (`LeaseClient.fetch_flags`,
        without waiting for the device) and settled by :meth:`next_step` or :meth:`end`."""
        opened = lease.opened
        if opened is None or not opened.more_steps or opened.layers:
            return False
        self._clients[lease.socket].fetch_flags(opened)
        return True

    def run(
        self,
        lease: ActiveLease,
        layer: int,
        key: torch.Tensor,
        value: torch.Tensor,
        query: torch.Tensor,
    ) -> torch.Tensor | None:
        """One layer under `lease`: key/value ``[b, n, Hkv, D]``, query ``[b, n, Hq, D]``
        (views are fine), or ``[n, H, D]`` each (a ragged step's rows joined). Returns the
        output shaped as the query, in the pool's dtype on the query's device, or None
        when the layer must go as a call (the lease ended before its first layer, or its
        worker's socket cannot be used from here): nothing was written then. Once a layer
        ran, :meth:`end` must follow at the forward's end.

        Raises:
            InvalidArgumentError: inputs that do not fit the step (nothing written).
            FailedPreconditionError: the previous forward's report reached the worker after
                it had revoked that lease (the forward outlived the lease's timeout twice):
                none of that forward was kept.
            UnavailableError: the lease connection broke.
        """
        try:
            if lease.opened is None:
                client = self._client(lease.socket, query.device)
                opened = client.open(lease.lease_id, lease.plan) if client is not None else None
                lease.plan = b""
                if opened is None:
                    lease.layers.clear()
                    return None
                lease.opened = opened
            out = self._clients[lease.socket].run_layer(lease.opened, layer, key, value, query)
        except (InvalidWorkerRequest, WorkerUnavailable) as exc:
            raise self._client_error(lease.socket, exc) from None
        lease.layers.discard(layer)
        return out.view(query.shape)

    def end(self, lease: ActiveLease) -> None:
        """At the end of a forward (also one that failed): report the layers run under
        `lease` to the service, which commits those written; raise if a layer was refused
        for non-finite inputs (nothing written for it). A lease the grant opened for this
        process that ran no layer reports none; one never opened needs nothing (the
        service ends it at the batch's next call).

        Raises:
            InvalidArgumentError: which layers were refused.
            FailedPreconditionError: an earlier report came after its lease was revoked.
            UnavailableError: the connection broke: nothing was kept.
        """
        opened, lease.opened = lease.opened, None
        plan, lease.plan = lease.plan, b""
        try:
            if opened is None:
                client = self._clients.get(lease.socket)
                if not plan or client is None:
                    return
                # Opened for us at its grant: the worker waits for its report.
                opened = client.open(lease.lease_id, plan)
                if opened is None:
                    return
            report = self._clients[lease.socket].end(opened)
        except (InvalidWorkerRequest, WorkerUnavailable) as exc:
            raise self._client_error(lease.socket, exc) from None
        if report.refused:
            layers = ",".join(str(x) for x in report.refused)
            raise InvalidArgumentError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"non-finite inputs on layers {layers}: nothing written for them",
            )

    def close(self) -> None:
        """Close every lease connection."""
        for client in self._clients.values():
            client.close()
        self._clients.clear()

    def _client_error(
        self, socket: str, exc: InvalidWorkerRequest | WorkerUnavailable
    ) -> KVCacheError:
        """The lease client's error as the service client's: a report that came after
        its lease was gone FAILED_PRECONDITION, a refusal INVALID_ARGUMENT, a broken
        connection UNAVAILABLE (and the connection dropped)."""
        if isinstance(exc, LeaseEnded):
            return FailedPreconditionError(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        if isinstance(exc, InvalidWorkerRequest):
            return InvalidArgumentError(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self._drop(socket)
        return UnavailableError(grpc.StatusCode.UNAVAILABLE, str(exc))

    def _drop(self, socket: str) -> None:
        client = self._clients.pop(socket, None)
        if client is not None:
            client.close()

    def _client(self, socket: str, device: torch.device) -> LeaseClient | None:
        """The connection to `socket`, made on first use; None if it cannot be used from
        here (logged once)."""
        client = self._clients.get(socket)
        if client is not None:
            return client
        if socket in self._unusable:
            return None
        try:
            client = LeaseClient(socket, device)
            if client.device != device:
                client.close()
                raise WorkerUnavailable(
                    socket, f"the pool is on {client.device}, the model's tensors on {device}"
                )
        except WorkerUnavailable as exc:
            log.warning("step leases off for this model: %s; layers go as calls", exc)
            self._unusable.add(socket)
            return None
        self._clients[socket] = client
        return client
