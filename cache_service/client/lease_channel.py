"""A co-located client's side of a worker's lease socket (the worker's side and the wire
format: `workers.lease_server`).

A :class:`LeaseChannel` is opened once per session and worker: the worker allocates the
connection's staging buffers on its pool's device and this process maps them (CUDA IPC
memory on a GPU pool, a shared file on a CPU pool). A leased layer is then a copy of the
query, key and value into the staging buffers on the caller's stream, one small message,
and the output read back after the worker's event: on a GPU nothing crosses host memory
and nothing waits for the device.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import time

import grpc
import torch

from cache_service.client.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    UnavailableError,
)

__all__ = ["LeaseChannel", "LeaseEndedError", "leading_rows"]

# The wire format of workers.lease_server (a test checks the two agree).
_VERSION = 1
_SERVE, _CHECK = 1, 2
_OK, _ENDED, _REFUSED = 0, 1, 2
_REQUEST = struct.Struct("<B16sI")
# How long a request polls for its reply before sleeping on the socket, seconds.
_POLL_S = 200e-6


class LeaseEndedError(FailedPreconditionError):
    """The lease ended before this layer (the service took the step back, or it idled):
    nothing was written; send the layer with an append-and-attend call."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.FAILED_PRECONDITION, message)


class LeaseChannel:
    """One connection to a worker's lease socket, with its staging buffers mapped.

    Args:
        path: the socket (StepLeaseResponse.socket).
        rows, tokens: the most query rows and new tokens a layer will send.
        num_q_heads: query heads of every layer.
        device: where the caller's tensors live (a CUDA device for a GPU pool).

    Raises:
        UnavailableError: the socket cannot be reached or the worker refused the
            connection (the message says why).
    """

    def __init__(
        self, path: str, rows: int, tokens: int, num_q_heads: int, device: torch.device
    ) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._ready: torch.cuda.Event | None = None
        hello: dict[str, object] = {
            "version": _VERSION,
            "rows": rows,
            "tokens": tokens,
            "q_heads": num_q_heads,
            "cuda_event": None,
            "pid": os.getpid(),
        }
        if device.type == "cuda":
            self._ready = torch.cuda.Event(interprocess=True)
            self._ready.record(torch.cuda.current_stream(device))
            hello["cuda_event"] = self._ready.ipc_handle().hex()
        try:
            self._sock.connect(path)
            self._sock.send(json.dumps(hello).encode())
            reply = json.loads(self._sock.recv(1 << 16) or b"{}")
        except (OSError, ValueError) as exc:
            self._sock.close()
            raise UnavailableError(
                grpc.StatusCode.UNAVAILABLE, f"lease socket {path}: {exc}"
            ) from None
        if not reply.get("ok"):
            self._sock.close()
            raise UnavailableError(
                grpc.StatusCode.UNAVAILABLE,
                f"lease socket {path} refused the connection: {reply.get('error', 'closed')}",
            )
        self.device = torch.device(reply["device"]) if reply["device"] == "cpu" else device
        self._done: torch.cuda.Event | None = None
        if reply["device"] == "cuda":
            if device.type != "cuda":
                self._sock.close()
                raise UnavailableError(
                    grpc.StatusCode.UNAVAILABLE,
                    "the worker's pool is on a GPU and the caller's tensors are not",
                )
            flat = _cuda_memory(bytes.fromhex(reply["memory"]))
            self._done = torch.cuda.Event.from_ipc_handle(
                device, bytes.fromhex(reply["cuda_event"])
            )
        else:
            flat = torch.from_file(
                reply["path"], shared=True, size=reply["nbytes"], dtype=torch.uint8
            )
        dtype = getattr(torch, reply["dtype"])
        views = {}
        for name, shape in reply["shapes"].items():
            start = reply["offsets"][name]
            count = shape[0] * shape[1] * shape[2]
            views[name] = flat[start : start + count * dtype.itemsize].view(dtype).view(shape)
        self.dtype = dtype
        self._query, self._key, self._value, self._out = (
            views[n] for n in ("query", "key", "value", "out")
        )

    @property
    def rows(self) -> int:
        """Query rows the staging holds."""
        return self._query.shape[0]

    @property
    def tokens(self) -> int:
        """New tokens the staging holds."""
        return self._key.shape[0]

    def fits(self, rows: int, tokens: int, num_q_heads: int) -> bool:
        """Whether a layer of this many query rows, new tokens and heads fits the staging."""
        return (
            rows <= self._query.shape[0]
            and tokens <= self._key.shape[0]
            and num_q_heads == self._query.shape[1]
        )

    def run_layer(
        self,
        lease_id: bytes,
        layer: int,
        key: torch.Tensor,
        value: torch.Tensor,
        query: torch.Tensor,
    ) -> torch.Tensor:
        """Write one layer's new K/V and attend its queries under a lease.

        Args:
            key, value: ``[n, Hkv, D]``; query: ``[rows, Hq, D]`` (any float dtype, on the
                caller's device; cast to the pool's); or each with its leading dimension
                split in two (``[b, n / b, ...]``, views of any strides).

        Returns:
            ``[rows, Hq, D]`` in the pool's dtype on the caller's device (ready once the
            caller's stream reaches it: the stream waits for the worker).

        Raises:
            LeaseEndedError: the lease ended; nothing written (send the layer by call).
            InvalidArgumentError: the worker refused the layer (a layer outside the lease
                or sent twice, shapes that do not fit); nothing written.
            UnavailableError: the connection broke (whether the layer ran is unknown).
        """
        rows, tokens = leading_rows(query), leading_rows(key)
        with self._lock:
            self._query[:rows].view(query.shape).copy_(query)
            self._key[:tokens].view(key.shape).copy_(key)
            self._value[:tokens].view(value.shape).copy_(value)
            stream = None
            if self._ready is not None:
                stream = torch.cuda.current_stream(query.device)
                self._ready.record(stream)
            self._request(_SERVE, lease_id, layer)
            if stream is not None and self._done is not None:
                stream.wait_event(self._done)
            return self._out[:rows].clone()

    def check(self, lease_id: bytes) -> None:
        """Wait for the lease's layers so far and raise if any was refused.

        Raises:
            InvalidArgumentError: a layer's inputs held NaN or infinity (nothing written
                for it); LeaseEndedError: the lease ended meanwhile.
        """
        with self._lock:
            self._request(_CHECK, lease_id, 0)

    def close(self) -> None:
        """End the connection (the worker frees its staging)."""
        self._sock.close()

    def _request(self, op: int, lease_id: bytes, layer: int) -> None:
        try:
            self._sock.send(_REQUEST.pack(op, lease_id, layer))
            reply = self._receive()
        except OSError as exc:
            raise UnavailableError(
                grpc.StatusCode.UNAVAILABLE, f"lease socket {self.path}: {exc}"
            ) from None
        if not reply:
            raise UnavailableError(
                grpc.StatusCode.UNAVAILABLE, f"lease socket {self.path} closed the connection"
            )
        code, message = reply[0], reply[1:].decode(errors="replace")
        if code == _ENDED:
            raise LeaseEndedError(message)
        if code != _OK:
            raise InvalidArgumentError(grpc.StatusCode.INVALID_ARGUMENT, message)

    def _receive(self) -> bytes:
        """The worker's reply; on a GPU pool polled for during `_POLL_S` before waiting
        for it: a leased layer's answer comes within tens of microseconds there, and waking
        a sleeping thread costs as much again. A CPU pool's answer comes after the layer's
        attention, on cores a polling thread would take from it."""
        if self.device.type != "cuda":
            return self._sock.recv(1 << 12)
        deadline = time.perf_counter() + _POLL_S
        while True:
            try:
                return self._sock.recv(1 << 12, socket.MSG_DONTWAIT)
            except BlockingIOError:
                if time.perf_counter() > deadline:
                    return self._sock.recv(1 << 12)


def leading_rows(t: torch.Tensor) -> int:
    """Rows of `t` once its leading dimensions are flattened (all but the last two)."""
    n = 1
    for size in t.shape[:-2]:
        n *= size
    return n


def _cuda_memory(handle: bytes) -> torch.Tensor:
    """The worker's staging allocation, mapped into this process (CUDA IPC)."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers the CUDA tensor reduction)

    return ForkingPickler.loads(handle)
