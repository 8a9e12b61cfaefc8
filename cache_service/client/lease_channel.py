"""A co-located client's side of a worker's lease socket (the worker's side and the wire
format: `workers.lease_server`).

A :class:`LeaseChannel` is opened once per session and worker: the worker allocates the
connection's staging buffers on its pool's device and this process maps them (CUDA IPC
memory on a GPU pool, a shared file on a CPU pool). A leased layer is then a copy of the
query, key and value into the staging buffers on the caller's stream, one small message,
and the output copied back out.

On a GPU nothing waits: the caller's stream and the worker's are ordered by two counters
in device memory (`workers.stream_values`), so the caller's host goes on with its model
while the worker's host enqueues the layer. The worker's answers are read when the next
layer is sent and at `check`: a layer the worker refused (its lease ended, NaN, ...) is
reported there, and the forward that used its output must be dropped. On a CPU pool the
caller waits for each answer, the output in place.
"""

from __future__ import annotations

import collections
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
from workers import stream_values

__all__ = ["LeaseChannel", "LeaseEndedError"]

# The wire format of workers.lease_server (a test checks the two agree).
_VERSION = 2
_SERVE, _CHECK = 1, 2
_OK, _ENDED, _REFUSED = 0, 1, 2
_REQUEST = struct.Struct("<B16sII")
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
        # CUDA: this side's counter (the worker's stream writes it), the worker's (mapped
        # here), the last count sent and the layers whose answers are unread.
        self._done: torch.Tensor | None = None
        self._ready: torch.Tensor | None = None
        self._count = 0
        self._unanswered: collections.deque[int] = collections.deque()
        hello: dict[str, object] = {
            "version": _VERSION,
            "rows": rows,
            "tokens": tokens,
            "q_heads": num_q_heads,
            "pid": os.getpid(),
            "done": None,
        }
        if device.type == "cuda":
            if not stream_values.available():
                raise UnavailableError(
                    grpc.StatusCode.UNAVAILABLE,
                    "this process's CUDA driver has no stream memory operations",
                )
            self._done = torch.zeros(1, dtype=torch.int32, device=device)
            hello["done"] = bytes(_pickler().dumps(self._done)).hex()
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
        if reply["device"] == "cuda":
            if device.type != "cuda":
                self._sock.close()
                raise UnavailableError(
                    grpc.StatusCode.UNAVAILABLE,
                    "the worker's pool is on a GPU and the caller's tensors are not",
                )
            flat = _pickler().loads(bytes.fromhex(reply["memory"]))
        else:
            flat = torch.from_file(
                reply["path"], shared=True, size=reply["nbytes"], dtype=torch.uint8
            )
        dtype = getattr(torch, reply["dtype"])
        views = {}
        for name, shape in reply["shapes"].items():
            kind = torch.int32 if name == "ready" else dtype
            start = reply["offsets"][name]
            count = kind.itemsize
            for size in shape:
                count *= size
            views[name] = flat[start : start + count].view(kind).view(shape)
        self.dtype = dtype
        self._query, self._key, self._value, self._out = (
            views[n] for n in ("query", "key", "value", "out")
        )
        self._ready = views.get("ready")

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
            LeaseEndedError: (CPU pool) the lease ended; nothing written (send the layer
                by call).
            InvalidArgumentError: the worker refused the layer (a layer outside the lease
                or sent twice, shapes that do not fit); nothing written. On a GPU pool
                this and an ended lease are reported for an earlier layer (a
                FailedPreconditionError for the latter), whose output was not valid.
            UnavailableError: the connection broke (whether the layer ran is unknown).
        """
        rows, tokens = _leading(query), _leading(key)
        with self._lock:
            self._query[:rows].view(query.shape).copy_(query)
            self._key[:tokens].view(key.shape).copy_(key)
            self._value[:tokens].view(value.shape).copy_(value)
            if self._done is None:
                self._send(_SERVE, lease_id, layer, 0)
                self._answer(self._receive(), layer, current=True)
                return self._out[:rows].clone()
            stream = torch.cuda.current_stream(query.device)
            self._count = (self._count + 1) & 0xFFFFFFFF
            stream_values.write(stream, self._ready, self._count)  # type: ignore[arg-type]
            self._send(_SERVE, lease_id, layer, self._count)
            self._unanswered.append(layer)
            stream_values.wait(stream, self._done, self._count)
            out = self._out[:rows].clone()
            self._read_answers(wait=False, last_is_current=True)
            return out

    def check(self, lease_id: bytes) -> None:
        """Read every answer outstanding, then wait for the lease's layers and raise if
        any was refused.

        Raises:
            InvalidArgumentError: a layer's inputs held NaN or infinity (nothing written
                for it), or the worker refused one; FailedPreconditionError: the lease
                ended before one of the layers (LeaseEndedError when no layer was sent
                since the last answer read).
        """
        with self._lock:
            self._read_answers(wait=True)
            self._send(_CHECK, lease_id, 0, 0)
            self._answer(self._receive(), None, current=True)

    def close(self) -> None:
        """End the connection (the worker frees its staging)."""
        self._sock.close()

    def _read_answers(self, wait: bool, last_is_current: bool = False) -> None:
        """The answers of layers sent on a GPU pool: those already here, or (`wait`) all.
        `last_is_current`: the last layer sent is the one being sent (its output unused)."""
        while self._unanswered:
            try:
                if wait:
                    reply = self._receive()
                else:
                    reply = self._sock.recv(1 << 12, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError as exc:
                raise self._broken(str(exc)) from None
            layer = self._unanswered.popleft()
            self._answer(reply, layer, current=last_is_current and not self._unanswered)

    def _answer(self, reply: bytes, layer: int | None, current: bool) -> None:
        """Raise for a refusal. `current`: the answer is about the layer just sent, whose
        output has not been used (an ended lease then raises LeaseEndedError: send the
        layer by call); otherwise its output was used, so the forward must fail."""
        if not reply:
            raise self._broken("closed the connection")
        code, message = reply[0], reply[1:].decode(errors="replace")
        if code == _OK:
            return
        where = "" if layer is None else f"layer {layer}: "
        if code == _ENDED:
            if current:
                raise LeaseEndedError(where + message)
            raise FailedPreconditionError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{where}{message} (its output was already used: drop this forward)",
            )
        raise InvalidArgumentError(grpc.StatusCode.INVALID_ARGUMENT, where + message)

    def _send(self, op: int, lease_id: bytes, layer: int, count: int) -> None:
        try:
            self._sock.send(_REQUEST.pack(op, lease_id, layer, count))
        except OSError as exc:
            raise self._broken(str(exc)) from None

    def _receive(self) -> bytes:
        """The worker's next answer, polled for during `_POLL_S` before waiting for it: a
        layer's answer comes within tens of microseconds, and waking a sleeping thread
        costs as much again."""
        deadline = time.perf_counter() + _POLL_S
        try:
            while True:
                try:
                    return self._sock.recv(1 << 12, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    if time.perf_counter() > deadline:
                        return self._sock.recv(1 << 12)
        except OSError as exc:
            raise self._broken(str(exc)) from None

    def _broken(self, why: str) -> UnavailableError:
        """The connection failed: on a GPU, release this stream's waits for the worker
        (they would never end), then the error to raise."""
        if self._done is not None and self._count:
            side = torch.cuda.Stream(self._done.device)
            stream_values.write(side, self._done, self._count)
            side.synchronize()
        return UnavailableError(grpc.StatusCode.UNAVAILABLE, f"lease socket {self.path}: {why}")


def _leading(t: torch.Tensor) -> int:
    """Rows of `t` once its leading dimensions are flattened (all but the last two)."""
    n = 1
    for size in t.shape[:-2]:
        n *= size
    return n


def _pickler():  # type: ignore[no-untyped-def]
    """multiprocessing's pickler, with torch's CUDA tensor reduction registered (CUDA IPC
    maps the worker's staging and this side's counter across the processes)."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers the reduction)

    return ForkingPickler
