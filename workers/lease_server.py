"""The lease socket: how a co-located client maps a worker's pool and takes its leases.

A client on this host connects once per session (a Unix ``SOCK_SEQPACKET`` socket in a
folder only this user can enter). The worker answers with its pool: the layout and how
to map the pool tensor and its slot fingerprints (`workers.pool_memory`: a CUDA IPC
handle, or a memory file's descriptor passed with the reply), and on a GPU the pool's
interprocess event. The client then runs each leased step itself, on the pool's memory,
with the pool's kernels (`workers.lease_client`): per step the plan the coordinator
granted (in the StepLease reply when the request named this connection's token, which
the hello reply gives; else by one ``OPEN``) and one ``END`` (the layers written and
refused; on a GPU the worker's stream first waits for the client's event). Nothing
crosses the socket per layer. A client in the worker's own process (an embedded service)
takes the pool's tensors from this process instead (`local_pool`).

Wire format (one message per datagram; integers little-endian):

- hello, client -> worker: UTF-8 JSON ``{"version": 3, "pid": the client's process id,
  "cuda_event": hex of its interprocess event or null}``; reply: JSON ``{"ok": true,
  "layout": {KVLayout fields}, "num_blocks", "pool": exported, "fingerprints": exported or
  null, "backend", "event": hex of the pool's interprocess event or null, "local": true
  when the client shares this process, "connection": hex of this connection's token (a
  StepLeaseRequest naming it gets its lease opened for this connection at the grant)}``
  (exported: `workers.pool_memory.Exported`, its memory file's descriptors passed with
  the message, the pool's first) or ``{"ok": false, "error": message}``.
- OPEN: ``<B16s`` (1, lease id); reply: ``<BI`` code (0 OK, 1 ENDED, 2 REFUSED) and the
  length of what follows, then the message (OK: `StepPlan.pack`; else UTF-8 text), cut
  into datagrams of at most `CHUNK` bytes.
- END: ``<B16sHHI`` (2, lease id, bytes per bitmask, steps run, token ids that follow)
  then two bitmasks of the layers written and refused in the last step run (bit ``i % 8``
  of byte ``i // 8``), then the token ids of the steps after the first as int64 (one per
  sequence a step, step by step; `step_leases.LeaseReport`); reply as OPEN's, with text
  only (the client reads it before its next request's reply, not when it sends the END).

The client's side is `workers.lease_client`; `tests/test_step_leases.py` checks the two
agree.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket
import struct
import tempfile
import threading
from dataclasses import asdict
from typing import Any

import torch

from workers.errors import InvalidWorkerRequest
from workers.owned_files import make_owned_dir, reclaim_orphans, remove_owned_dir
from workers.pool import KVPool
from workers.pool_memory import export
from workers.step_leases import LEASE_ID_BYTES, LeaseEnded, StepLeases

__all__ = [
    "CHUNK",
    "END",
    "ENDED",
    "END_HEAD",
    "OK",
    "OPEN",
    "REFUSED",
    "REPLY",
    "REQUEST",
    "VERSION",
    "LeaseServer",
    "layer_mask",
    "local_pool",
    "register_local_event",
]

log = logging.getLogger("kvcache.lease_server")

VERSION = 3
# The socket's folder: "<tmp>/kvcache-lease-<owner>-<random>" (workers.owned_files).
DIR_PREFIX = "kvcache-lease-"
OPEN, END = 1, 2
OK, ENDED, REFUSED = 0, 1, 2
REQUEST = struct.Struct("<B16s")
END_HEAD = struct.Struct("<B16sHHI")
REPLY = struct.Struct("<BI")
# The largest datagram of a reply (a big plan goes in several).
CHUNK = 1 << 16

# Socket path -> (the pool, its leases) of this process's lease servers, and token -> the
# CUDA event of a client in this process: CUDA IPC opens no handle in the process that
# made it, so such a client takes these objects directly.
_LOCAL_POOLS: dict[str, tuple[KVPool, StepLeases]] = {}
_LOCAL_EVENTS: dict[str, torch.cuda.Event] = {}


def local_pool(path: str) -> tuple[KVPool, StepLeases] | None:
    """The pool and leases served on `path` by this process, if any."""
    return _LOCAL_POOLS.get(path)


def register_local_event(token: str, event: torch.cuda.Event | None) -> None:
    """Make a client's CUDA event known to this process's lease servers under `token`
    (None: forget it)."""
    if event is None:
        _LOCAL_EVENTS.pop(token, None)
    else:
        _LOCAL_EVENTS[token] = event


class LeaseServer:
    """Serves the leases of one pool on a Unix socket (threads: one accepting, one per
    connection).

    Args:
        pool: the pool the leases are on (mapped by each client).
        leases: its leases.
        backend: the kernels' backend the clients use (the pool's).
        name: part of the socket folder's name (the worker id).
    """

    def __init__(self, pool: KVPool, leases: StepLeases, backend: str, name: str) -> None:
        self._pool = pool
        self._leases = leases
        self._backend = backend
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
        leases.on_revoke = self._revoke
        _LOCAL_POOLS[self.path] = (pool, leases)
        threading.Thread(target=self._accept, name=f"lease-accept-{name}", daemon=True).start()

    def close(self) -> None:
        """Stop accepting and end every connection."""
        self._closed = True
        _LOCAL_POOLS.pop(self.path, None)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with self._guard:
            for conn in list(self._connections):
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
        remove_owned_dir(self._dir, self._dir_fd)

    def _revoke(self, connection: object) -> None:
        """A lease of `connection` was revoked: end the connection (its client's next
        request fails; it must not write the lease's slots any more)."""
        log.warning("a step lease was not reported in time: closing its client's connection")
        if isinstance(connection, socket.socket):
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)

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
        device = self._pool.device
        if device.type == "cuda":
            torch.cuda.set_device(device)  # this thread's events
        try:
            hello = conn.recv(1 << 16)
            if not hello:
                return
            try:
                reply, fds, client_event = self._hello(json.loads(hello))
            except (InvalidWorkerRequest, ValueError, TypeError, KeyError) as exc:
                conn.send(json.dumps({"ok": False, "error": str(exc)}).encode())
                return
            token = secrets.token_bytes(16)
            reply["connection"] = token.hex()
            self._leases.connect(token, conn)
            socket.send_fds(conn, [json.dumps(reply).encode()], fds)
            while True:
                message = conn.recv(CHUNK)
                if not message:
                    return
                code, body = self._answer(message, conn, client_event)
                _send_reply(conn, code, body)
        except OSError:
            return
        except Exception:  # a bug must end this connection, not the worker
            log.exception("lease connection %d failed", number)
        finally:
            self._leases.disconnected(conn)
            with self._guard:
                self._connections.discard(conn)
            conn.close()

    def _answer(
        self, message: bytes, conn: socket.socket, client_event: torch.cuda.Event | None
    ) -> tuple[int, bytes]:
        """The reply (code, body) to one request."""
        try:
            if message[:1] == bytes([OPEN]) and len(message) == REQUEST.size:
                _, lease_id = REQUEST.unpack(message)
                return OK, self._leases.open(lease_id, conn)
            if message[:1] == bytes([END]) and len(message) >= END_HEAD.size:
                _, lease_id, width, steps, count = END_HEAD.unpack_from(message)
                body = message[END_HEAD.size :]
                if len(body) != 2 * width + 8 * count:
                    raise InvalidWorkerRequest(
                        f"END carries two bitmasks of {width} bytes and {count} token ids"
                    )
                masks = body[: 2 * width]
                tokens = struct.unpack_from(f"<{count}q", body, 2 * width)
                if client_event is not None:
                    # Whatever this worker does with the step's blocks next comes after
                    # the client's writes.
                    torch.cuda.current_stream(self._pool.device).wait_event(client_event)
                self._leases.report(
                    lease_id, conn, _layers(masks[:width]), _layers(masks[width:]), steps, tokens
                )
                return OK, b""
            raise InvalidWorkerRequest(
                f"a request is OPEN ({REQUEST.size} bytes) or END; got {len(message)} bytes "
                f"starting {message[:1].hex()}"
            )
        except LeaseEnded as exc:
            return ENDED, str(exc).encode()
        except InvalidWorkerRequest as exc:
            return REFUSED, str(exc).encode()

    def _hello(
        self, hello: dict[str, Any]
    ) -> tuple[dict[str, Any], list[int], torch.cuda.Event | None]:
        """The reply to a client's hello, the descriptors to send with it, and the
        client's CUDA event."""
        if hello.get("version") != VERSION:
            raise InvalidWorkerRequest(f"lease protocol version {VERSION} only")
        pool, device = self._pool, self._pool.device
        local = hello.get("pid") == os.getpid()
        reply: dict[str, Any] = {
            "ok": True,
            "layout": asdict(pool.layout),
            "num_blocks": pool.num_blocks,
            "backend": self._backend,
            "pool": None,
            "fingerprints": None,
            "event": None,
            "local": local,
        }
        fds: list[int] = []
        client_event = None
        if device.type == "cuda":
            event = hello.get("cuda_event")
            if not isinstance(event, str):
                raise InvalidWorkerRequest("a CUDA pool's lease connection needs cuda_event")
            if local:
                client_event = _LOCAL_EVENTS.get(event)
                if client_event is None:
                    raise InvalidWorkerRequest("no CUDA event of this process under that token")
            else:
                client_event = torch.cuda.Event.from_ipc_handle(device, bytes.fromhex(event))
                assert self._leases.event is not None
                reply["event"] = self._leases.event.ipc_handle().hex()
        if not local:
            exported, fds = export(pool.data)
            reply["pool"] = exported.as_json()
            sums = pool.fingerprint_sums
            if sums is not None:
                exported, more = export(sums)
                reply["fingerprints"] = exported.as_json()
                fds += more
        return reply, fds, client_event


def _layers(mask: bytes) -> list[int]:
    """The layers whose bits are set in `mask`."""
    return [i for i in range(len(mask) * 8) if mask[i // 8] >> (i % 8) & 1]


def layer_mask(layers: list[int] | tuple[int, ...], width: int) -> bytes:
    """`width` bytes with the bits of `layers` set (the inverse of `_layers`)."""
    mask = bytearray(width)
    for i in layers:
        mask[i // 8] |= 1 << (i % 8)
    return bytes(mask)


def _send_reply(conn: socket.socket, code: int, body: bytes) -> None:
    """A reply: its head and body, cut into datagrams of at most CHUNK bytes."""
    first = REPLY.pack(code, len(body)) + body[: CHUNK - REPLY.size]
    conn.send(first)
    for start in range(CHUNK - REPLY.size, len(body), CHUNK):
        conn.send(body[start : start + CHUNK])


assert REQUEST.size == 1 + LEASE_ID_BYTES
