"""A model's step leases: a forward's later layers sent straight to the worker.

When the model's process shares a host with the service (a local session), each forward
asks the service to plan the step of its new tokens (:meth:`StepLeaser.request` when it
begins, :meth:`StepLeaser.granted` at its first attention layer: one call, no tensors),
and every layer goes to the worker holding the batch over its lease socket (:class:`~cache_service.client.lease_channel.LeaseChannel`):
on a GPU the query, key and value are copied into the worker's staging memory on the
model's own stream and the output comes back the same way, with no host copy and no wait
for the device. A lease that ended (the service took the step back) makes the layer go as
a call instead; nothing else changes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from cache_service.client.errors import UnavailableError
from cache_service.client.lease_channel import LeaseChannel, LeaseEndedError, leading_rows

__all__ = ["ActiveLease", "StepLeaser"]

log = logging.getLogger("kvcache.step_leases")


@dataclass
class ActiveLease:
    """A granted lease: its id, the worker's socket and the layers it may still write."""

    lease_id: bytes
    socket: str
    layers: set[int]


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
        self._channels: dict[str, LeaseChannel] = {}
        # Sockets that refused a connection (another host's, a GPU pool for CPU tensors).
        self._unusable: set[str] = set()

    def request(self, seq_ids: list[str], token_ids: list[list[int]]) -> Any:
        """Ask the service to plan the step of these new tokens (per sequence, any
        counts) for a lease, without waiting: :meth:`granted` reads the answer (the
        caller's work between the two overlaps the service's planning) and must be called.
        None: no lease to ask for (no local session, or it is busy)."""
        if self._start_lease_step is None:
            return None
        return self._start_lease_step(seq_ids, self._num_q_heads, token_ids)

    def granted(self, requested: Any) -> ActiveLease | None:
        """The lease :meth:`request` asked for; or None (none was asked, the step does not
        qualify, or its worker cannot be reached from here): the layers then go as calls.

        Raises:
            KVCacheError: the service refused the request (nothing is held then).
        """
        if requested is None:
            return None
        reply = requested.result()
        if not reply.granted or reply.socket in self._unusable:
            return None
        return ActiveLease(reply.lease_id, reply.socket, set(reply.layers))

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
        when the layer must go as a call (the lease ended, or its worker's socket cannot
        be used from here): nothing was written then.

        Raises:
            KVCacheError: the worker refused the layer (nothing written).
        """
        rows, tokens = leading_rows(query), leading_rows(key)
        channel = self._channel(lease.socket, rows, tokens, query.device)
        if channel is None:
            return None
        try:
            out = channel.run_layer(lease.lease_id, layer, key, value, query)
        except LeaseEndedError:
            lease.layers.clear()
            return None
        lease.layers.discard(layer)
        return out.view(query.shape)

    def check(self, lease: ActiveLease) -> None:
        """At the end of a forward: raise if a layer sent under `lease` was refused by the
        worker for non-finite values (nothing written for it).

        Raises:
            InvalidArgumentError: which layers; LeaseEndedError never (an ended lease's
                layers went as calls).
        """
        channel = self._channels.get(lease.socket)
        if channel is None:
            return
        try:
            channel.check(lease.lease_id)
        except LeaseEndedError:
            # Ended after its last layer: each layer's refusal, if any, was counted by
            # the service, which committed only the written ones; the forward's later
            # calls find a refused layer short and fail there.
            return

    def close(self) -> None:
        """Close every lease connection."""
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()

    def _channel(
        self, socket: str, rows: int, tokens: int, device: torch.device
    ) -> LeaseChannel | None:
        """The connection to `socket` with staging for `rows` and `tokens` (a larger one
        replaces a smaller), or None if the socket cannot be used from here."""
        channel = self._channels.get(socket)
        if channel is not None and channel.fits(rows, tokens, self._num_q_heads):
            return channel
        if channel is not None:
            rows, tokens = max(rows, channel.rows), max(tokens, channel.tokens)
            channel.close()
            del self._channels[socket]
        try:
            channel = LeaseChannel(socket, rows, tokens, self._num_q_heads, device)
        except UnavailableError as exc:
            log.warning("step leases off for this model: %s; layers go as calls", exc.message)
            self._unusable.add(socket)
            return None
        self._channels[socket] = channel
        return channel
