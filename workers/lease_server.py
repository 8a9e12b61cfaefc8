"""The lease socket: a co-located client's per-layer handoff to the worker holding its step.

A client on this host connects once per session (a Unix ``SOCK_SEQPACKET`` socket in a
folder only this user can enter) and says how large its layers are. The worker allocates
that connection's staging buffers on the pool's device (query, key, value, output) and
hands them over: on CUDA as an IPC memory handle (the client maps the very device memory,
so no tensor crosses host memory) with an IPC event each way; on CPU as a shared file.

Then each layer is one small message: ``(op, lease id, layer)``. For ``SERVE`` the client
has put the layer's query, key and value into the staging buffers and (CUDA) recorded its
event after those copies; the worker makes its stream wait for that event, enqueues the
write and the attention (`StepLeases.serve`, a CUDA graph replay where the step's shape
was seen), records its own event and answers at once, without waiting for the device. The
client's stream waits for the worker's event before it reads the output. ``CHECK`` waits
for the lease's layers and answers the layers whose inputs were not finite.

Wire format (one message per datagram; integers little-endian):

- hello, client -> worker: UTF-8 JSON ``{"version": 1, "rows": R, "tokens": T,
  "q_heads": H, "cuda_event": hex or null, "pid": the client's process id}``; reply: JSON ``{"ok": true, "device":
  "cuda" | "cpu", "dtype", "nbytes", "offsets": {name: byte offset}, "shapes": {name:
  shape}, "path": shared file or null, "memory": hex of the CUDA IPC handle pickle or null,
  "cuda_event": hex or null}`` or ``{"ok": false, "error": message}``.
- request: ``<B16sI``: op (1 SERVE, 2 CHECK), lease id, layer.
- reply: ``<B`` code (0 OK, 1 ENDED: send the layer by call, 2 REFUSED) then a UTF-8
  message (for CHECK: the refused layers, comma-separated).
The client's side is `cache_service.client.lease_channel`; `tests/test_step_leases.py`
checks the two agree.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import struct
import tempfile
import threading
from dataclasses import dataclass
from typing import Any

import torch

from workers.errors import InvalidWorkerRequest
from workers.layout import KVLayout
from workers.owned_files import make_owned_dir, reclaim_orphans, remove_owned_dir
from workers.step_leases import LEASE_ID_BYTES, LeaseEnded, StepLeases

__all__ = ["CHECK", "ENDED", "OK", "REFUSED", "REQUEST", "SERVE", "LeaseServer"]

log = logging.getLogger("kvcache.lease_server")

VERSION = 1
# The socket's folder: "<tmp>/kvcache-lease-<owner>-<random>" (workers.owned_files).
DIR_PREFIX = "kvcache-lease-"
SERVE, CHECK = 1, 2
OK, ENDED, REFUSED = 0, 1, 2
REQUEST = struct.Struct("<B16sI")
# The most rows or new tokens one connection's staging holds.
MAX_ROWS = 1 << 16
_ALIGN = 256


@dataclass
class _Staging:
    """A connection's buffers on the pool's device (views of one allocation)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    out: torch.Tensor
    reply: dict[str, Any]
    ready: torch.cuda.Event | None  # the client's event: its inputs are in place
    done: torch.cuda.Event | None  # ours: the output is written
    path: str | None = None
    stream: torch.cuda.Stream | None = None  # where this connection's layers run (CUDA)


class LeaseServer:
    """Serves the leases of one pool on a Unix socket (threads: one accepting, one per
    connection).

    Args:
        leases: the pool's leases.
        layout: the pool's layout; device: its device.
        name: part of the socket folder's name (the worker id).
    """

    def __init__(
        self, leases: StepLeases, layout: KVLayout, device: torch.device, name: str
    ) -> None:
        self._leases = leases
        self._layout = layout
        self._device = device
        reclaim_orphans(tempfile.gettempdir(), DIR_PREFIX)  # folders of killed workers
        self._dir, self._dir_fd = make_owned_dir(None, DIR_PREFIX)
        self.path = os.path.join(self._dir, "lease.sock")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock.bind(self.path)
        self._sock.listen(64)
        self._closed = False
        self._connections: set[socket.socket] = set()
        self._count = 0
        self._guard = threading.Lock()
        threading.Thread(target=self._accept, name=f"lease-accept-{name}", daemon=True).start()

    def close(self) -> None:
        """Stop accepting and end every connection (their staging goes with them)."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with self._guard:
            for conn in list(self._connections):
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
        remove_owned_dir(self._dir, self._dir_fd)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._guard:
                self._connections.add(conn)
                self._count += 1
                number = self._count
            threading.Thread(
                target=self._serve_connection, args=(conn, number), daemon=True
            ).start()

    def _serve_connection(self, conn: socket.socket, number: int) -> None:
        staging = None
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)  # this thread's kernels and events
        try:
            hello = conn.recv(1 << 16)
            if not hello:
                return
            try:
                staging = self._staging(json.loads(hello), number)
            except (InvalidWorkerRequest, ValueError, TypeError, KeyError) as exc:
                conn.send(json.dumps({"ok": False, "error": str(exc)}).encode())
                return
            conn.send(json.dumps(staging.reply).encode())
            while True:
                message = conn.recv(64)
                if not message:
                    return
                conn.send(self._answer(message, staging))
        except OSError:
            return
        except Exception:  # a bug must end this connection, not the worker
            log.exception("lease connection %d failed", number)
        finally:
            with self._guard:
                self._connections.discard(conn)
            conn.close()
            if staging is not None and staging.path is not None:
                with contextlib.suppress(OSError):
                    os.unlink(staging.path)

    def _answer(self, message: bytes, staging: _Staging) -> bytes:
        """The reply to one request."""
        if len(message) != REQUEST.size:
            return _reply(REFUSED, f"a request is {REQUEST.size} bytes, got {len(message)}")
        op, lease_id, layer = REQUEST.unpack(message)
        try:
            if op == CHECK:
                refused = self._leases.refused(lease_id)
                if refused:
                    layers = ",".join(str(x) for x in refused)
                    return _reply(REFUSED, f"non-finite inputs on layers {layers}")
                return _OK
            if op != SERVE:
                return _reply(REFUSED, f"unknown op {op}")
            if staging.stream is not None:
                staging.stream.wait_event(staging.ready)
            self._leases.serve(lease_id, layer, staging)
            if staging.stream is not None:
                staging.done.record(staging.stream)
            return _OK
        except LeaseEnded as exc:
            return _reply(ENDED, str(exc))
        except InvalidWorkerRequest as exc:
            return _reply(REFUSED, str(exc))

    def _staging(self, hello: dict[str, Any], number: int) -> _Staging:
        """A connection's buffers, sized by its hello."""
        if hello.get("version") != VERSION:
            raise InvalidWorkerRequest(f"lease protocol version {VERSION} only")
        rows, tokens, heads = (hello[k] for k in ("rows", "tokens", "q_heads"))
        lay = self._layout
        if not all(type(x) is int and 0 < x <= MAX_ROWS for x in (rows, tokens)):
            raise InvalidWorkerRequest(f"rows and tokens must be ints in [1, {MAX_ROWS}]")
        if type(heads) is not int or heads < 1 or heads % lay.num_kv_heads:
            raise InvalidWorkerRequest(
                f"q_heads must be a positive multiple of {lay.num_kv_heads}, got {heads!r}"
            )
        dtype = lay.torch_dtype()
        shapes = {
            "query": (rows, heads, lay.head_dim),
            "key": (tokens, lay.num_kv_heads, lay.head_dim),
            "value": (tokens, lay.num_kv_heads, lay.head_dim),
            "out": (rows, heads, lay.head_dim),
        }
        offsets, nbytes = {}, 0
        for name, shape in shapes.items():
            offsets[name] = nbytes
            size = dtype.itemsize * shape[0] * shape[1] * shape[2]
            nbytes += -(-size // _ALIGN) * _ALIGN
        reply: dict[str, Any] = {
            "ok": True,
            "device": self._device.type,
            "dtype": str(dtype).removeprefix("torch."),
            "nbytes": nbytes,
            "offsets": offsets,
            "shapes": shapes,
            "path": None,
            "memory": None,
            "cuda_event": None,
        }
        ready = done = None
        path = None
        if self._device.type == "cuda":
            if hello.get("pid") == os.getpid():
                # CUDA IPC maps another process's memory only: a client in this process
                # (an embedded service) makes its calls instead.
                raise InvalidWorkerRequest(
                    "the client runs in the worker's process: CUDA IPC cannot map memory "
                    "into its own process; send the layers by call"
                )
            flat = torch.zeros(nbytes, dtype=torch.uint8, device=self._device)
            reply["memory"] = _cuda_handle(flat).hex()
            event = hello.get("cuda_event")
            if not isinstance(event, str):
                raise InvalidWorkerRequest("a CUDA pool's lease connection needs cuda_event")
            ready = torch.cuda.Event.from_ipc_handle(self._device, bytes.fromhex(event))
            done = torch.cuda.Event(interprocess=True)
            reply["cuda_event"] = done.ipc_handle().hex()
        else:
            path = os.path.join(self._dir, f"stage-{number}")
            with open(path, "wb") as f:
                f.truncate(nbytes)
            flat = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
            reply["path"] = path
        views = {
            name: flat[offsets[name] : offsets[name] + dtype.itemsize * _numel(shape)]
            .view(dtype)
            .view(shape)
            for name, shape in shapes.items()
        }
        stream = torch.cuda.current_stream(self._device) if ready is not None else None
        return _Staging(
            views["query"],
            views["key"],
            views["value"],
            views["out"],
            reply,
            ready,
            done,
            path,
            stream,
        )


def _numel(shape: tuple[int, int, int]) -> int:
    return shape[0] * shape[1] * shape[2]


def _reply(code: int, message: str = "") -> bytes:
    return bytes([code]) + message.encode()


_OK = _reply(OK)


def _cuda_handle(flat: torch.Tensor) -> bytes:
    """The pickle a client's `torch.multiprocessing` unpickles into the same device memory
    (torch's CUDA IPC reduction: a memory handle, the allocation's offset and size)."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers the CUDA tensor reduction)

    return bytes(ForkingPickler.dumps(flat))


assert REQUEST.size == 1 + LEASE_ID_BYTES + 4
