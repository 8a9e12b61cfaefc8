"""Python client of the kvcache.v1 service: torch tensors in and out, deadlines, safe retries.

Example::

    with KVCacheClient("127.0.0.1:50051") as client:
        layout = client.info().layout
        with client.create_sequence(prompt_ids) as seq:      # freed on exit
            new = prompt_ids[seq.num_cached_tokens:]
            for layer in range(layout.num_layers):
                (out,) = client.append_attend(
                    layer, [AppendAttendItem(seq.seq_id, new, k[layer], v[layer], q[layer])]
                )

Every call has a deadline (`timeout_s` of the client, or per call). Calls that read and
change nothing are retried on UNAVAILABLE (the server or a worker was not reachable):
info, lookup, attend, export, stats. Errors surface as `KVCacheError` subclasses carrying
the gRPC status code and the server's message.

Mutating calls (create_sequence, fork, append, append_attend, append_attend_batch) carry a
request id (generated, or the caller's `request_id=`) and their deadline as the server's
commit deadline (`timeout_us`). The client waits `deadline_grace_s` beyond it for the
server's verdict: the server answers OK only for a call it committed and DEADLINE_EXCEEDED
only for one it did not (it undid it). Without a verdict within the grace (a slow or lost
reply), the client asks again with the same request id, which the server answers with the
first call's outcome without applying it twice; if even that finds no answer the call
raises UNAVAILABLE naming the request id ("outcome unknown": retry with it). creates and
forks are also retried on UNAVAILABLE with the same request id (idempotent, and durable
across a coordinator restart).

A client on the server's host sends the batch calls' tensors (`append_attend_batch`,
`attend_batch`) through a shared-memory region instead of the message when it can
(``shared_memory="auto"``, the default; `client_shared_memory`): only small messages then
cross gRPC. Elsewhere, or when the server turned it off, the calls send bytes as before.
Such a client also sends its session calls over the server's local socket rather than
the gRPC stream when the server offers one (``local_session="auto"``, the default;
`local_session_stream`): same messages and replies, without gRPC's threads.
"""

from __future__ import annotations

import functools
import itertools
import random
import secrets
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from cache_service._proto.kvcache.v1 import kvcache_pb2 as pb
from cache_service._proto.kvcache.v1 import kvcache_pb2_grpc as pb_grpc
from cache_service.client.call_stream import CallStream, StreamBroken
from cache_service.client.errors import (
    DataLossError,
    DeadlineExceededError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    KVCacheError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)
from cache_service.client.layout import ServiceLayout
from cache_service.client.local_session_stream import (
    LocalSessionStream,
    LocalSessionUnavailable,
    LocalSessionUnreachable,
)
from cache_service.client.shared_memory import SharedMemoryPath, SharedMemoryUnavailable, Staged
from cache_service.errors import DEADLINE_VERDICT
from cache_service.wire.request_codec import (
    call_fields,
    encode_append_attend,
    encode_append_attend_batch,
    encode_attend,
    encode_attend_batch,
)
from cache_service.wire.session_codec import (
    APPEND_ATTEND_BATCH,
    ATTEND_BATCH,
    session_message,
    status_from_number,
)
from cache_service.wire.tensor_codec import (
    dtype_from_proto,
    dtype_to_proto,
    tensor_from_bytes,
    tensor_from_proto,
    tensor_to_bytes,
    tensors_from_protos,
)
from cache_service.wire.tls import ClientTLSConfig, channel_credentials, channel_options

_SERVICE = pb.DESCRIPTOR.services_by_name["KVCache"].full_name

__all__ = [
    "AppendAttendItem",
    "AttendItem",
    "DataLossError",
    "DeadlineExceededError",
    "ExportedBlocks",
    "FailedPreconditionError",
    "InternalError",
    "InvalidArgumentError",
    "KVCacheClient",
    "KVCacheError",
    "LocalSessionUnavailable",
    "NotFoundError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "SequenceEntry",
    "SequenceHandle",
    "ServiceInfo",
    "ServiceLayout",
    "ServiceStats",
    "SharedMemoryUnavailable",
    "UnauthenticatedError",
    "UnavailableError",
    "WorkerInfo",
    "WorkerStats",
]

MiB = 1 << 20
_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


# ------------------------------------------------------------------------------ errors


_ERRORS: dict[grpc.StatusCode, type[KVCacheError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.DATA_LOSS: DataLossError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
}


# SessionResponse.result of each session call's reply.
_SESSION_REPLY = {APPEND_ATTEND_BATCH: "append_attend_batch", ATTEND_BATCH: "attend_batch"}


def _session_result(raw: bytes, call_id: int, field: int) -> Any:
    """The reply message of a session call from its encoded SessionResponse; its error as
    the KVCacheError the unary call would have raised."""
    reply = pb.SessionResponse.FromString(raw)
    which = reply.WhichOneof("result")
    if which == "error":
        code = status_from_number(reply.error.code)
        raise _ERRORS.get(code, InternalError)(code, reply.error.message or code.name)
    if reply.call_id != call_id or which != _SESSION_REPLY[field]:
        raise InternalError(
            grpc.StatusCode.INTERNAL,
            f"the session answered call {reply.call_id} with {which!r}; expected call "
            f"{call_id} with {_SESSION_REPLY[field]!r}",
        )
    return getattr(reply, which)


def _error_from_rpc(exc: grpc.RpcError) -> KVCacheError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return _ERRORS.get(code, InternalError)(code, details or code.name)


# ------------------------------------------------------------------------------ values


@dataclass(frozen=True)
class WorkerInfo:
    """One worker pool: id, device ("cuda:0", "cpu"), blocks, epoch, whether it serves, and
    how the coordinator's per-layer calls reach it (`data_path`: "in_process"; for a Ray
    worker the last call's "channel_unix", "channel_tcp" or "ray"; "" before the first, or
    from a server that does not say)."""

    worker_id: str
    device: str
    num_blocks: int
    epoch: str
    up: bool
    data_path: str = ""


@dataclass(frozen=True)
class ServiceInfo:
    """What `info()` returns.

    Attributes:
        layout: the cache layout (`ServiceLayout`).
        workers: the worker pools.
        total_blocks: blocks over all serving workers.
        capacity_tokens: total_blocks * block_size.
        max_message_bytes: the largest message the server accepts, bytes.
        server_version: the server package's version.
        fingerprint: the layout's fingerprint (exports carry it).
        local_session_socket: the server's local session socket ("" when it offers
            none); see `KVCacheClient`'s local_session.
    """

    layout: ServiceLayout
    workers: tuple[WorkerInfo, ...]
    total_blocks: int
    capacity_tokens: int
    max_message_bytes: int
    server_version: str
    fingerprint: str
    local_session_socket: str = ""


@dataclass(frozen=True)
class WorkerStats:
    """Block accounting of one live worker (see WorkerStats in kvcache.proto)."""

    worker_id: str
    total_blocks: int
    used_blocks: int
    cached_free_blocks: int
    free_blocks: int
    allocated_slots: int
    filled_slots: int


@dataclass(frozen=True)
class ServiceStats:
    """What `stats()` returns: utilization and fragmentation are ratios in 0..1;
    prefix maps tenant -> (prompt tokens looked up, tokens found cached)."""

    workers: tuple[WorkerStats, ...]
    utilization: float
    fragmentation: float
    prefix: dict[str, tuple[int, int]]
    evictions: int
    cow_copies: int
    pinned_blocks: int
    active_sequences: int
    lost_sequences: int

    @property
    def prefix_hit_rate(self) -> float:
        """Cached / looked-up prompt tokens over all tenants (0 when nothing was looked up)."""
        queried = sum(q for q, _ in self.prefix.values())
        return sum(h for _, h in self.prefix.values()) / queried if queried else 0.0


@dataclass(frozen=True)
class SequenceEntry:
    """One sequence of the tenant (`list_sequences`).

    seq_id: its id; num_tokens: reserved positions; written: per layer, tokens whose K/V
    are stored; lost: its blocks were on a worker that died (free it).
    """

    seq_id: str
    num_tokens: int
    written: tuple[int, ...]
    lost: bool


@dataclass(frozen=True)
class AttendItem:
    """One sequence of an attend batch: query ``[n, num_q_heads, head_dim]``."""

    seq_id: str
    query: torch.Tensor


@dataclass(frozen=True)
class AppendAttendItem:
    """One sequence of an append-and-attend batch.

    Attributes:
        seq_id: the sequence.
        token_ids: ids of the n new tokens.
        key, value: ``[n, num_kv_heads, head_dim]``, float16 / bfloat16 / float32.
        query: ``[m, num_q_heads, head_dim]``: the last m positions after the write.
    """

    seq_id: str
    token_ids: Sequence[int]
    key: torch.Tensor
    value: torch.Tensor
    query: torch.Tensor


@dataclass
class ExportedBlocks:
    """A sequence's blocks, as exported (`export_blocks`) and importable (`import_blocks`).

    Attributes:
        header: the export header (layout, token ids, block shape).
        data: the raw block bytes: ``[num_blocks, num_layers, 2, num_kv_heads, block_size,
            head_dim]`` in the layout's dtype, little-endian.
    """

    header: pb.ExportHeader
    data: bytes = field(repr=False)

    @property
    def token_ids(self) -> list[int]:
        """Token ids of the exported positions."""
        return list(self.header.token_ids)

    @property
    def num_tokens(self) -> int:
        """Exported positions."""
        return int(self.header.num_tokens)

    def blocks(self) -> torch.Tensor:
        """The blocks as a tensor ``[num_blocks, num_layers, 2, Hkv, block_size, head_dim]``."""
        dtype = dtype_from_proto(self.header.layout.kv_dtype, "header.layout.kv_dtype")
        return tensor_from_bytes(self.data, dtype, list(self.header.block_shape), "export")

    def to_bytes(self) -> bytes:
        """One self-describing byte string (4-byte header length, header, data)."""
        head = self.header.SerializeToString()
        return struct.pack("<I", len(head)) + head + self.data

    @classmethod
    def from_bytes(cls, blob: bytes) -> ExportedBlocks:
        """The inverse of `to_bytes`; raises ValueError on a truncated or foreign blob."""
        if len(blob) < 4:
            raise ValueError("exported blob is shorter than its 4-byte header length")
        (n,) = struct.unpack_from("<I", blob)
        if 4 + n > len(blob):
            raise ValueError(f"exported blob announces a {n}-byte header but has {len(blob) - 4}")
        header = pb.ExportHeader.FromString(blob[4 : 4 + n])
        data = blob[4 + n :]
        if len(data) != header.total_bytes:
            raise ValueError(
                f"exported blob holds {len(data)} data bytes, header says {header.total_bytes}"
            )
        return cls(header, data)


class SequenceHandle:
    """A sequence in the service. As a context manager it frees the sequence on exit.

    Attributes:
        seq_id: the service's id of the sequence.
        num_cached_tokens: leading tokens already cached when the handle was made (a prefix
            hit at creation, the shared tokens of a fork, the tokens of an import).
    """

    def __init__(self, client: KVCacheClient, seq_id: str, num_cached_tokens: int) -> None:
        self._client = client
        self.seq_id = seq_id
        self.num_cached_tokens = num_cached_tokens
        self._freed = False

    def __repr__(self) -> str:
        return f"SequenceHandle(seq_id={self.seq_id!r}, num_cached_tokens={self.num_cached_tokens})"

    def fork(self) -> SequenceHandle:
        """A new sequence sharing this one's blocks."""
        return self._client.fork(self.seq_id)

    def free(self) -> None:
        """Free the sequence (idempotent on this handle)."""
        if not self._freed:
            self._client.free(self.seq_id)
            self._freed = True

    def __enter__(self) -> SequenceHandle:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if self._freed:
            return
        try:
            self.free()
        except (NotFoundError, DataLossError):
            # Already gone (freed elsewhere, or lost with a worker): nothing left to release.
            self._freed = True
        except KVCacheError:
            if exc is None:
                raise


# ------------------------------------------------------------------------------ client


class KVCacheClient:
    """A blocking client of one kvcache.v1 server.

    Args:
        target: "host:port".
        token: bearer token when the server requires authentication.
        timeout_s: default deadline of every call, seconds (a call's own timeout_s wins).
        tls: TLS settings; None connects in plaintext.
        max_message_bytes: largest message sent or received, bytes (match the server's).
        stream_chunk_bytes: data bytes per message of Append / import streams.
        max_attempts: attempts of a retryable call (reads failing with UNAVAILABLE).
        shared_memory: how the batch calls (`append_attend_batch`, `attend_batch`) move
            their tensors. "auto" (default): through a shared-memory region of the server
            when this process can map it (same host, same user), else as bytes, decided
            on the first batch call. False: always bytes. True: through shared memory,
            raising `SharedMemoryUnavailable` (or the server's error) where "auto" would
            fall back; a call that finds the region busy with another thread's call
            still sends bytes.
        session: send the batch calls as messages of one `Session` stream (opened on the
            first one; `call_stream`) instead of one unary RPC each: what a model
            executor calling once per layer wants. A call that finds the stream busy with
            another thread's call, or a server without sessions, uses the unary RPC.
        local_session: where the session's messages go. "auto" (default): over the
            server's local socket (GetInfo's local_session_socket) when it offers one
            and this process can connect to it (same host, same user), else over the
            gRPC stream; decided on the first batch call, and again after the socket
            went away. False: always gRPC. True: the local socket, raising
            `LocalSessionUnavailable` where "auto" would use gRPC. Needs `session`.
        deadline_grace_s: how long a mutating call waits beyond its deadline for the
            server's verdict (see the module's docstring), seconds; also the deadline of
            each follow-up asking for it.
    """

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        timeout_s: float = 30.0,
        tls: ClientTLSConfig | None = None,
        max_message_bytes: int = 256 * MiB,
        stream_chunk_bytes: int = 2 * MiB,
        max_attempts: int = 4,
        shared_memory: bool | str = "auto",
        session: bool = True,
        local_session: bool | str = "auto",
        deadline_grace_s: float = 0.5,
    ) -> None:
        if shared_memory not in (True, False, "auto"):
            raise ValueError(f"shared_memory must be True, False or 'auto', got {shared_memory!r}")
        if local_session not in (True, False, "auto"):
            raise ValueError(f"local_session must be True, False or 'auto', got {local_session!r}")
        if local_session is True and not session:
            raise ValueError("local_session=True needs session=True (it carries the session)")
        if not (isinstance(timeout_s, int | float) and timeout_s > 0):
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
        if not (isinstance(deadline_grace_s, int | float) and deadline_grace_s > 0):
            raise ValueError(f"deadline_grace_s must be > 0 seconds, got {deadline_grace_s!r}")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts!r}")
        if stream_chunk_bytes < 1 or stream_chunk_bytes > max_message_bytes // 2:
            raise ValueError("stream_chunk_bytes must be in 1..max_message_bytes // 2")
        self.target = target
        self.timeout_s = float(timeout_s)
        self._chunk = int(stream_chunk_bytes)
        self._attempts = int(max_attempts)
        self._grace = float(deadline_grace_s)
        # Request ids: this client's random prefix and a counter (unique per tenant).
        self._id_prefix = secrets.token_hex(8)
        self._id_counter = itertools.count(1)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            # A connection of its own (gRPC shares one between channels of a process by
            # default): the server's per-client in-flight limit counts per connection.
            ("grpc.use_local_subchannel_pool", 1),
        ]
        if tls is None:
            self._channel = grpc.insecure_channel(target, options=options)
        else:
            options += channel_options(tls)
            self._channel = grpc.secure_channel(target, channel_credentials(tls), options=options)
        self._stub = pb_grpc.KVCacheStub(self._channel)
        # The per-layer calls send requests the client encodes itself (`request_codec`).
        self._append_attend_raw = self._raw_method("AppendAttend", pb.AppendAttendResponse)
        self._attend_raw = self._raw_method("Attend", pb.AttendResponse)
        self._append_attend_batch_raw = self._raw_method(
            "AppendAttendBatch", pb.AppendAttendBatchResponse
        )
        self._attend_batch_raw = self._raw_method("AttendBatch", pb.AttendBatchResponse)
        self._session = (
            CallStream(
                self._channel.stream_stream(
                    f"/{_SERVICE}/Session", request_serializer=None, response_deserializer=None
                ),
                metadata=self._metadata,
            )
            if session
            else None
        )
        self._call_ids = itertools.count(1)
        # The local session: mode, whether it was decided (resolved and connected, or
        # found unusable), and the stream when in use.
        self._local_mode: bool | str = local_session if session else False
        self._local_decided = not self._local_mode
        self._local: LocalSessionStream | None = None
        self._local_lock = threading.Lock()
        self._max_message = max_message_bytes
        self._layout: Any = None
        self._shm = (
            SharedMemoryPath(
                self._create_region, self._release_region, required=shared_memory is True
            )
            if shared_memory
            else None
        )

    def _raw_method(self, name: str, response: Any) -> Any:
        """A unary method of the service taking request bytes as they are (no serializer)."""
        return self._channel.unary_unary(
            f"/{_SERVICE}/{name}",
            request_serializer=None,
            response_deserializer=response.FromString,
        )

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        """End the session stream, release the shared-memory region (if any) and close the
        channel."""
        if self._session is not None:
            self._session.close()
        if self._local is not None:
            self._local.close()
        if self._shm is not None:
            self._shm.close()
        self._channel.close()

    @property
    def local_session_active(self) -> bool:
        """Whether the session calls currently go over the server's local socket."""
        return self._local is not None

    @property
    def shared_memory_active(self) -> bool:
        """Whether the batch calls currently move their tensors through shared memory."""
        return self._shm is not None and self._shm.active

    def __enter__(self) -> KVCacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        """Block until the channel is connected; raises UnavailableError after timeout_s."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise UnavailableError(
                grpc.StatusCode.UNAVAILABLE, f"no server answered at {self.target} in {timeout_s} s"
            ) from None

    # -- plumbing --------------------------------------------------------------------------

    def _call(
        self,
        method: Callable[..., Any],
        request: Any,
        *,
        timeout_s: float | None,
        retry: bool,
    ) -> Any:
        """Run one RPC with a deadline; retry UNAVAILABLE with backoff when `retry`."""
        budget = self.timeout_s if timeout_s is None else float(timeout_s)
        deadline = time.monotonic() + budget
        attempt = 0
        while True:
            attempt += 1
            remaining = deadline - time.monotonic()
            try:
                return method(request, timeout=max(remaining, 0.001), metadata=self._metadata)
            except grpc.RpcError as exc:
                error = _error_from_rpc(exc)
                if not (retry and isinstance(error, UnavailableError) and attempt < self._attempts):
                    raise error from None
                # Exponential backoff with jitter, never past the deadline.
                pause = min(0.05 * 2 ** (attempt - 1), 1.0) * (0.5 + random.random() / 2)
                if time.monotonic() + pause >= deadline:
                    raise error from None
                time.sleep(pause)

    def new_request_id(self) -> str:
        """A fresh request id (this client's random prefix and a counter)."""
        return f"{self._id_prefix}-{next(self._id_counter)}"

    def _mutate(
        self,
        method: Callable[..., Any],
        build: Callable[[str, int], Any],
        *,
        timeout_s: float | None,
        request_id: str | None,
        retry_unavailable: bool = False,
    ) -> Any:
        """Run one mutating RPC: `build(request_id, timeout_us)` makes its request. The
        gRPC deadline is the commit deadline plus the grace; a DEADLINE_EXCEEDED that is not
        the server's verdict asks for it (`_verdict`). retry_unavailable: retry UNAVAILABLE
        with the same request id (calls idempotent even across a restart: creates)."""
        budget = self.timeout_s if timeout_s is None else float(timeout_s)
        rid = request_id or self.new_request_id()
        deadline = time.monotonic() + budget
        attempt = 0
        while True:
            attempt += 1
            remaining = max(deadline - time.monotonic(), 1e-6)
            request = build(rid, _micros(remaining))
            try:
                return method(request, timeout=remaining + self._grace, metadata=self._metadata)
            except grpc.RpcError as exc:
                error = _error_from_rpc(exc)
            if isinstance(error, DeadlineExceededError) and DEADLINE_VERDICT not in error.message:
                return self._verdict(method, build(rid, 1), rid)
            if not (
                retry_unavailable
                and isinstance(error, UnavailableError)
                and attempt < self._attempts
            ):
                raise error from None
            pause = min(0.05 * 2 ** (attempt - 1), 1.0) * (0.5 + random.random() / 2)
            if time.monotonic() + pause >= deadline:
                raise error from None
            time.sleep(pause)

    def _verdict(self, method: Callable[..., Any], request: Any, request_id: str) -> Any:
        """The outcome of a mutating call that got no verdict in time: ask again with its
        request id and a passed deadline; the server answers the first call's outcome (or
        DEADLINE_EXCEEDED for one it never saw), never applying it twice.

        Raises:
            UnavailableError: no answer in `max_attempts` tries of `deadline_grace_s` each
                (the outcome is unknown: retry with the same request_id).
        """
        for _ in range(self._attempts):
            try:
                return method(request, timeout=self._grace, metadata=self._metadata)
            except grpc.RpcError as exc:
                error = _error_from_rpc(exc)
            if not isinstance(error, DeadlineExceededError | UnavailableError) or (
                DEADLINE_VERDICT in error.message
            ):
                raise error from None
        raise UnavailableError(
            grpc.StatusCode.UNAVAILABLE,
            f"no verdict from the server for request_id {request_id!r} within the deadline "
            "and its grace: the call may or may not have been applied; retry it with the "
            "same request_id to find out (it is never applied twice)",
        )

    def _batch_call(
        self,
        field: int,
        method: Callable[..., Any],
        request: bytes,
        *,
        timeout_s: float | None,
        retry: bool,
        request_id: str | None = None,
    ) -> Any:
        """One batch call (`field`: session_codec.APPEND_ATTEND_BATCH or ATTEND_BATCH) with
        its encoded request: a message of the session stream when there is one and it is
        free, else the unary `method`. Returns the parsed reply; raises what `_call` does.
        A call that is not `retry` (safe to repeat) is a mutating one: it carries a request
        id (`request_id`, or a fresh one) and its commit deadline (see `_mutate`).
        """
        mutating = not retry
        rid = (request_id or self.new_request_id()) if mutating else ""
        stream: CallStream | LocalSessionStream | None = self._session
        if stream is not None:
            budget = self.timeout_s if timeout_s is None else float(timeout_s)
            if not self._local_decided:
                self._choose_local(budget)
            call_id = next(self._call_ids)
            # A mutating call waits the grace beyond its commit deadline for the verdict.
            wait = budget + self._grace if mutating else budget
            body = request + call_fields(rid, _micros(budget)) if mutating else request
            message = session_message(call_id, field, body)
            try:
                local = self._local
                if local is not None:
                    try:
                        raw = local.call(message, wait)
                    except LocalSessionUnreachable:
                        # The socket went away (a restarted server has a new one): nothing
                        # was sent. Look again on the next call; this one takes gRPC.
                        self._forget_local(local)
                        raw = stream.call(message, wait)
                else:
                    raw = stream.call(message, wait)
            except StreamBroken as exc:
                if exc.code == grpc.StatusCode.UNIMPLEMENTED:
                    # A server without sessions: nothing ran; unary calls from now on.
                    self._session = None
                    stream.close()
                    raw = None
                elif mutating and exc.code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    # No verdict within the grace (the stream was dropped): ask for it.
                    return self._verdict(method, request + call_fields(rid, 1), rid)
                else:
                    error = _ERRORS.get(exc.code, InternalError)(exc.code, exc.details)
                    if not (retry and isinstance(error, UnavailableError)):
                        raise error from None
                    raw = None  # a safe call: the unary path retries it with backoff
            if raw is not None:
                return _session_result(raw, call_id, field)
        if mutating:
            return self._mutate(
                method,
                lambda rid, us: request + call_fields(rid, us),
                timeout_s=timeout_s,
                request_id=rid,
            )
        return self._call(method, request, timeout_s=timeout_s, retry=retry)

    def _choose_local(self, budget: float) -> None:
        """Decide where the session's messages go (see `local_session`): connect to the
        server's local socket if it offers one and it can be reached, else use gRPC."""
        with self._local_lock:
            if self._local_decided:
                return
            info = self._call(self._stub.GetInfo, pb.GetInfoRequest(), timeout_s=budget, retry=True)
            path = info.local_session_socket
            required = self._local_mode is True
            if not path:
                if required:
                    raise LocalSessionUnavailable(
                        "the server offers no local session (a TLS server, another version, "
                        "or server.local_sessions is false)"
                    )
                self._local_decided = True
                return
            authorization = dict(self._metadata).get("authorization", "")
            stream = LocalSessionStream(path, authorization, self._max_message)
            try:
                stream.connect(budget)
            except LocalSessionUnreachable as exc:
                if required:
                    raise LocalSessionUnavailable(str(exc)) from None
            except StreamBroken as exc:
                # Refused (too many sessions, shutting down, credentials): in "auto" the
                # gRPC stream takes the calls and reports its own status if it fails too.
                if required:
                    raise _ERRORS.get(exc.code, InternalError)(exc.code, exc.details) from None
            else:
                self._local = stream
            self._local_decided = True

    def _forget_local(self, stream: LocalSessionStream) -> None:
        """Stop using `stream` (its socket is gone); the next batch call decides again."""
        with self._local_lock:
            if self._local is stream:
                self._local = None
                self._local_decided = False
            stream.close()

    # -- service ---------------------------------------------------------------------------

    def info(self, *, timeout_s: float | None = None) -> ServiceInfo:
        """The layout, workers and capacity of the service."""
        r = self._call(self._stub.GetInfo, pb.GetInfoRequest(), timeout_s=timeout_s, retry=True)
        lay = r.layout
        layout = ServiceLayout(
            num_layers=lay.num_layers,
            num_kv_heads=lay.num_kv_heads,
            head_dim=lay.head_dim,
            block_size=lay.block_size,
            dtype=_DTYPE_NAMES[dtype_from_proto(lay.kv_dtype, "layout.kv_dtype")],
        )
        self._layout = layout
        workers = tuple(
            WorkerInfo(w.worker_id, w.device, w.num_blocks, w.epoch, w.up, w.data_path)
            for w in r.workers
        )
        return ServiceInfo(
            layout=layout,
            workers=workers,
            total_blocks=r.total_blocks,
            capacity_tokens=r.capacity_tokens,
            max_message_bytes=r.max_message_bytes,
            server_version=r.server_version,
            fingerprint=lay.fingerprint,
            local_session_socket=r.local_session_socket,
        )

    def stats(self, *, timeout_s: float | None = None) -> ServiceStats:
        """Pool utilization, fragmentation, prefix hits and counters."""
        r = self._call(self._stub.GetStats, pb.GetStatsRequest(), timeout_s=timeout_s, retry=True)
        return ServiceStats(
            workers=tuple(
                WorkerStats(
                    w.worker_id,
                    w.total_blocks,
                    w.used_blocks,
                    w.cached_free_blocks,
                    w.free_blocks,
                    w.allocated_slots,
                    w.filled_slots,
                )
                for w in r.workers
            ),
            utilization=r.utilization,
            fragmentation=r.fragmentation,
            prefix={p.tenant: (p.query_tokens, p.hit_tokens) for p in r.prefix},
            evictions=r.evictions,
            cow_copies=r.cow_copies,
            pinned_blocks=r.pinned_blocks,
            active_sequences=r.active_sequences,
            lost_sequences=r.lost_sequences,
        )

    # -- shared memory ---------------------------------------------------------------------

    def _create_region(self, size_bytes: int, timeout_s: float | None) -> Any:
        return self._call(
            self._stub.CreateSharedRegion,
            pb.CreateSharedRegionRequest(size_bytes=size_bytes),
            timeout_s=timeout_s,
            retry=False,
        )

    def _release_region(self, region_id: str, timeout_s: float | None) -> None:
        self._call(
            self._stub.ReleaseSharedRegion,
            pb.ReleaseSharedRegionRequest(region_id=region_id),
            timeout_s=timeout_s,
            retry=False,
        )

    def _stage(
        self,
        inputs: tuple[torch.Tensor, ...],
        query: torch.Tensor,
        return_lse: bool,
        timeout_s: float | None,
    ) -> Staged | None:
        """The call's tensors in the shared region (outputs: the query's dtype and shape,
        and float32 lse); None: send bytes."""
        if self._shm is None:
            return None
        outputs = [(query.dtype, tuple(query.shape))]
        if return_lse:
            outputs.append((torch.float32, tuple(query.shape[:3])))
        return self._shm.stage(inputs, outputs, timeout_s)

    def _batch(
        self,
        field: int,
        method: Callable[..., Any],
        encode: Callable[..., bytes],
        inputs: tuple[torch.Tensor, ...],
        return_lse: bool,
        timeout_s: float | None,
        retry: bool,
        request_id: str | None = None,
    ) -> Any:
        """A batch call (`field` and its unary `method`; `encode` takes `inputs`, the last
        of them the query): through the shared region when there is one, else with the
        tensors' bytes. Returns the output (and lse) as the public batch calls do.
        request_id: a mutating call's (not `retry`), or None for a fresh one."""
        if not retry and request_id is None:
            # One id for the call, also when it falls back from the region to bytes.
            request_id = self.new_request_id()
        staged = self._stage(inputs, inputs[-1], return_lse, timeout_s)
        if staged is not None:
            result = self._shared_call(
                field, method, staged, encode, return_lse, timeout_s, retry, request_id
            )
            if result is not None:
                return result
        reply = self._batch_call(
            field, method, encode(*inputs), timeout_s=timeout_s, retry=retry, request_id=request_id
        )
        return _batch_results(reply, return_lse)

    def _shared_call(
        self,
        field: int,
        method: Callable[..., Any],
        staged: Staged,
        encode: Callable[..., bytes],
        return_lse: bool,
        timeout_s: float | None,
        retry: bool,
        request_id: str | None = None,
    ) -> Any:
        """One batch call through the region; None when the server no longer knows the
        region (the caller then sends bytes: nothing happened, the region is checked
        before anything changes)."""
        try:
            lse_to = staged.outputs[1] if return_lse else None
            request = encode(*staged.inputs, output_to=staged.outputs[0], lse_to=lse_to)
            reply = self._batch_call(
                field, method, request, timeout_s=timeout_s, retry=retry, request_id=request_id
            )
            out = staged.output(reply.output, 0, "output")
            return (out, staged.output(reply.lse, 1, "lse")) if return_lse else out
        except NotFoundError as exc:
            if staged.region_id not in exc.message:
                raise
            self._shm.forget()  # type: ignore[union-attr]
            return None
        finally:
            staged.done()

    # -- sequences -------------------------------------------------------------------------

    def create_sequence(
        self,
        prompt_token_ids: Sequence[int] | None = None,
        *,
        namespace: str = "",
        timeout_s: float | None = None,
        request_id: str | None = None,
    ) -> SequenceHandle:
        """Start a sequence; with a prompt, `num_cached_tokens` of it are already cached.

        `namespace` names the model whose K/V the sequence holds: only prefixes cached in
        the same namespace are adopted ("" = the default namespace).

        Idempotent by `request_id` (a fresh one when None): retried on UNAVAILABLE (e.g. a
        coordinator restart) with the same id, which answers the sequence a first attempt
        made instead of leaving it orphaned.
        """
        ids = _ids(prompt_token_ids or ())

        def build(rid: str, timeout_us: int) -> pb.CreateSequenceRequest:
            return pb.CreateSequenceRequest(
                prompt_token_ids=ids, namespace=namespace, request_id=rid, timeout_us=timeout_us
            )

        r = self._mutate(
            self._stub.CreateSequence,
            build,
            timeout_s=timeout_s,
            request_id=request_id,
            retry_unavailable=True,
        )
        return SequenceHandle(self, r.seq_id, r.num_cached_tokens)

    def fork(
        self, seq_id: str, *, timeout_s: float | None = None, request_id: str | None = None
    ) -> SequenceHandle:
        """A new sequence sharing every block of `seq_id` (idempotent by `request_id`, as
        `create_sequence`)."""
        r = self._mutate(
            self._stub.ForkSequence,
            lambda rid, us: pb.ForkSequenceRequest(seq_id=seq_id, request_id=rid, timeout_us=us),
            timeout_s=timeout_s,
            request_id=request_id,
            retry_unavailable=True,
        )
        return SequenceHandle(self, r.seq_id, r.num_cached_tokens)

    def list_sequences(
        self, *, page_size: int = 0, timeout_s: float | None = None
    ) -> list[SequenceEntry]:
        """Every sequence of this client's tenant (live and lost), in seq_id order: to find
        and free sequences the client lost track of. Pages of `page_size` (0: the
        server's default) are fetched until the last."""
        entries: list[SequenceEntry] = []
        token = ""
        while True:
            r = self._call(
                self._stub.ListSequences,
                pb.ListSequencesRequest(page_size=page_size, page_token=token),
                timeout_s=timeout_s,
                retry=True,
            )
            entries += [
                SequenceEntry(e.seq_id, int(e.num_tokens), tuple(e.written), e.lost)
                for e in r.sequences
            ]
            token = r.next_page_token
            if not token:
                return entries

    def free(self, seq_id: str, *, timeout_s: float | None = None) -> None:
        """Release a sequence."""
        self._call(
            self._stub.FreeSequence,
            pb.FreeSequenceRequest(seq_id=seq_id),
            timeout_s=timeout_s,
            retry=False,
        )

    def lookup(
        self, token_ids: Sequence[int], *, namespace: str = "", timeout_s: float | None = None
    ) -> int:
        """Leading tokens of `token_ids` cached in `namespace` (no side effects)."""
        r = self._call(
            self._stub.Lookup,
            pb.LookupRequest(token_ids=_ids(token_ids), namespace=namespace),
            timeout_s=timeout_s,
            retry=True,
        )
        return int(r.num_cached_tokens)

    def pin(
        self, token_ids: Sequence[int], *, namespace: str = "", timeout_s: float | None = None
    ) -> None:
        """Keep the cached blocks of this prefix (in `namespace`) from eviction until `unpin`."""
        self._call(
            self._stub.Pin,
            pb.PinRequest(token_ids=_ids(token_ids), namespace=namespace),
            timeout_s=timeout_s,
            retry=False,
        )

    def unpin(
        self, token_ids: Sequence[int], *, namespace: str = "", timeout_s: float | None = None
    ) -> None:
        """Release a `pin` of this prefix in `namespace`."""
        self._call(
            self._stub.Unpin,
            pb.UnpinRequest(token_ids=_ids(token_ids), namespace=namespace),
            timeout_s=timeout_s,
            retry=False,
        )

    def publish_public(self, seq_id: str, *, timeout_s: float | None = None) -> None:
        """Make the sequence's full blocks findable by every tenant (needs the permission)."""
        self._call(
            self._stub.PublishPublic,
            pb.PublishPublicRequest(seq_id=seq_id),
            timeout_s=timeout_s,
            retry=False,
        )

    # -- data ------------------------------------------------------------------------------

    def append(
        self,
        seq_id: str,
        token_ids: Sequence[int],
        key: torch.Tensor,
        value: torch.Tensor,
        layer: int | None = None,
        *,
        timeout_s: float | None = None,
        request_id: str | None = None,
    ) -> int:
        """Write new tokens' K/V; returns the first position written (idempotent by
        `request_id`, a fresh one when None).

        Args:
            seq_id: the sequence.
            token_ids: ids of the n new tokens.
            key, value: layer None: ``[num_layers, n, num_kv_heads, head_dim]`` (every layer
                at once, e.g. a prefill computed elsewhere); else ``[n, num_kv_heads,
                head_dim]``. float16 / bfloat16 / float32.
            layer: the layer, or None for all.
        """
        messages = self._append_stream(seq_id, token_ids, key, value, layer)

        def build(rid: str, timeout_us: int) -> Iterator[pb.AppendRequest]:
            messages[0].request_id = rid
            messages[0].timeout_us = timeout_us
            return iter(messages)

        r = self._mutate(self._stub.Append, build, timeout_s=timeout_s, request_id=request_id)
        return int(r.start_position)

    def _append_stream(
        self,
        seq_id: str,
        token_ids: Sequence[int],
        key: torch.Tensor,
        value: torch.Tensor,
        layer: int | None,
    ) -> list[pb.AppendRequest]:
        head = pb.AppendRequest(
            seq_id=seq_id,
            token_ids=_ids(token_ids),
            key=pb.TensorSpec(dtype=dtype_to_proto(key.dtype), shape=list(key.shape)),
            value=pb.TensorSpec(dtype=dtype_to_proto(value.dtype), shape=list(value.shape)),
        )
        if layer is not None:
            head.layer = layer
        key_bytes, value_bytes = tensor_to_bytes(key), tensor_to_bytes(value)
        messages: list[pb.AppendRequest] = []
        msg, room = head, self._chunk
        for name, data in (("key_data", key_bytes), ("value_data", value_bytes)):
            view = memoryview(data)
            while len(view):
                if room == 0:
                    messages.append(msg)
                    msg, room = pb.AppendRequest(), self._chunk
                take = view[:room]
                setattr(msg, name, bytes(take))
                view, room = view[len(take) :], room - len(take)
        messages.append(msg)
        return messages

    def attend(
        self,
        layer: int,
        items: Sequence[AttendItem],
        return_lse: bool = False,
        *,
        timeout_s: float | None = None,
    ) -> list[Any]:
        """Attention for a batch of sequences on one layer.

        Returns, per item in order, the output ``[n, num_q_heads, head_dim]`` (the query's
        dtype), or with return_lse an ``(output, lse)`` pair, lse float32 ``[n, num_q_heads]``.

        Raises:
            InvalidArgumentError: ``items`` is empty (refused here, before sending), or
                the server refused the request.
        """
        _check_not_empty(items, "items", "attend", "item")
        req = encode_attend(layer, [i.seq_id for i in items], [i.query for i in items], return_lse)
        r = self._call(self._attend_raw, req, timeout_s=timeout_s, retry=True)
        return _results(r.results, return_lse)

    def append_attend(
        self,
        layer: int,
        items: Sequence[AppendAttendItem],
        return_lse: bool = False,
        *,
        timeout_s: float | None = None,
        request_id: str | None = None,
    ) -> list[Any]:
        """Write this layer's new K/V and attend, for a batch of sequences, in one RPC
        (idempotent by `request_id`, a fresh one when None).

        Returns what `attend` returns, one entry per item.

        Raises:
            InvalidArgumentError: ``items`` is empty (refused here, before sending), or
                the server refused the request.
        """
        _check_not_empty(items, "items", "append_attend", "item")
        # Each field of all items goes to bytes in one copy when the items' tensors are
        # rows of one tensor, as a model's batch usually is.
        req = encode_append_attend(
            layer,
            [i.seq_id for i in items],
            [_ids(i.token_ids) for i in items],
            [i.key for i in items],
            [i.value for i in items],
            [i.query for i in items],
            return_lse,
        )
        r = self._mutate(
            self._append_attend_raw,
            lambda rid, us: req + call_fields(rid, us),
            timeout_s=timeout_s,
            request_id=request_id,
        )
        return _results(r.results, return_lse)

    def append_attend_batch(
        self,
        layer: int,
        seq_ids: Sequence[str],
        token_ids: Sequence[Sequence[int]] | torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        query: torch.Tensor,
        return_lse: bool = False,
        *,
        timeout_s: float | None = None,
        request_id: str | None = None,
    ) -> Any:
        """`append_attend` for a batch in a model's layout: one RPC, row i is sequence i
        (idempotent by `request_id`, a fresh one when None).

        The fast form of the per-layer call (the AppendAttendBatch RPC): each whole-batch
        tensor travels as one tensor, with no per-sequence framing, and so does the reply.

        Args:
            layer: the layer.
            seq_ids: ``batch`` distinct sequences.
            token_ids: ``[batch, n]`` ids of the new tokens (ints or an integer tensor).
            key, value: ``[batch, n, num_kv_heads, head_dim]``, float16 / bfloat16 / float32.
            query: ``[batch, m, num_q_heads, head_dim]``: the last m positions after the
                write (m = 1 to decode).
            return_lse: also return the log-sum-exp.

        Returns:
            The output ``[batch, m, num_q_heads, head_dim]`` in the query's dtype, or with
            return_lse an ``(output, lse)`` pair, lse float32 ``[batch, m, num_q_heads]``.

        Raises:
            InvalidArgumentError: ``seq_ids`` is empty (refused here, before sending), or
                the server refused the request.
            ValueError: the tensors are not 4-D or their batch sizes differ from seq_ids.
        """
        ids = _id_rows(token_ids)
        _check_batch("append_attend_batch", seq_ids, ids, key=key, value=value, query=query)
        return self._batch(
            APPEND_ATTEND_BATCH,
            self._append_attend_batch_raw,
            functools.partial(
                encode_append_attend_batch, layer, seq_ids, ids, return_lse=return_lse
            ),
            (key, value, query),
            return_lse,
            timeout_s,
            retry=False,
            request_id=request_id,
        )

    def attend_batch(
        self,
        layer: int,
        seq_ids: Sequence[str],
        query: torch.Tensor,
        return_lse: bool = False,
        *,
        timeout_s: float | None = None,
    ) -> Any:
        """`attend` for a batch in a model's layout: query ``[batch, m, num_q_heads,
        head_dim]``, row i for sequence i. Returns the output (and lse) as
        `append_attend_batch` does; raises as it does."""
        _check_batch("attend_batch", seq_ids, None, query=query)
        return self._batch(
            ATTEND_BATCH,
            self._attend_batch_raw,
            functools.partial(encode_attend_batch, layer, seq_ids, return_lse=return_lse),
            (query,),
            return_lse,
            timeout_s,
            retry=True,
        )

    # -- export / import -------------------------------------------------------------------

    def iter_export(
        self, seq_id: str, *, chunk_bytes: int = 0, timeout_s: float | None = None
    ) -> Iterator[pb.ExportBlocksResponse]:
        """The raw export stream: the header message first, then data chunks."""
        budget = self.timeout_s if timeout_s is None else float(timeout_s)
        req = pb.ExportBlocksRequest(seq_id=seq_id, chunk_bytes=chunk_bytes)
        try:
            yield from self._stub.ExportBlocks(req, timeout=budget, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise _error_from_rpc(exc) from None

    def export_blocks(
        self, seq_id: str, *, chunk_bytes: int = 0, timeout_s: float | None = None
    ) -> ExportedBlocks:
        """Every written block of a sequence (retried on UNAVAILABLE: it reads only)."""
        for attempt in range(1, self._attempts + 1):
            try:
                header: pb.ExportHeader | None = None
                parts: list[bytes] = []
                for msg in self.iter_export(seq_id, chunk_bytes=chunk_bytes, timeout_s=timeout_s):
                    if msg.HasField("header"):
                        header = msg.header
                    parts.append(msg.data)
                break
            except UnavailableError:
                if attempt == self._attempts:
                    raise
                time.sleep(0.05 * 2 ** (attempt - 1))
        if header is None:
            raise InternalError(grpc.StatusCode.INTERNAL, "export stream carried no header")
        data = b"".join(parts)
        if len(data) != header.total_bytes:
            raise InternalError(
                grpc.StatusCode.INTERNAL,
                f"export stream carried {len(data)} bytes, header says {header.total_bytes}",
            )
        return ExportedBlocks(header, data)

    def import_blocks(
        self, exported: ExportedBlocks | bytes, *, timeout_s: float | None = None
    ) -> SequenceHandle:
        """Create a sequence holding exported blocks (from this or another service with the
        same layout). Cached leading blocks are shared instead of written."""
        if isinstance(exported, bytes | bytearray):
            exported = ExportedBlocks.from_bytes(bytes(exported))
        r = self._call(
            self._stub.ImportBlocks, self._import_stream(exported), timeout_s=timeout_s, retry=False
        )
        return SequenceHandle(self, r.seq_id, r.num_tokens)

    def _import_stream(self, exported: ExportedBlocks) -> Iterator[pb.ImportBlocksRequest]:
        view = memoryview(exported.data)
        first = pb.ImportBlocksRequest(header=exported.header, data=bytes(view[: self._chunk]))
        messages = [first]
        for start in range(self._chunk, len(view), self._chunk):
            messages.append(pb.ImportBlocksRequest(data=bytes(view[start : start + self._chunk])))
        return iter(messages)


def _micros(seconds: float) -> int:
    """A timeout_us: `seconds` in whole microseconds, at least 1 (0 would mean none)."""
    return max(1, int(seconds * 1e6))


def _ids(token_ids: Iterable[int]) -> list[int]:
    """Token ids as a list of ints (accepts lists, tuples, 1-D tensors)."""
    if isinstance(token_ids, torch.Tensor):
        if token_ids.ndim != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {tuple(token_ids.shape)}")
        return token_ids.tolist()
    return [int(t) for t in token_ids]


def _id_rows(token_ids: Sequence[Sequence[int]] | torch.Tensor) -> list[list[int]]:
    """``[batch, n]`` token ids (rows of ints, or an integer tensor) as lists of ints."""
    if isinstance(token_ids, torch.Tensor):
        if token_ids.ndim != 2:
            raise ValueError(f"token_ids must be [batch, n], got shape {tuple(token_ids.shape)}")
        return token_ids.tolist()
    rows = []
    for i, row in enumerate(token_ids):
        # A decode step's rows: lists of one int, used as they are (the request is
        # encoded from them before the call returns; nothing keeps them).
        if type(row) is list and len(row) == 1 and type(row[0]) is int:
            rows.append(row)
            continue
        if not isinstance(row, Sequence | torch.Tensor) or isinstance(row, str | bytes):
            raise ValueError(
                f"token_ids[{i}] must be the row's token ids, got {type(row).__name__}"
            )
        rows.append(_ids(row))
    return rows


def _check_not_empty(values: Sized, field: str, call: str, what: str) -> None:
    """Refuse a call with nothing in ``field`` before sending it, with the error the
    server's INVALID_ARGUMENT gives (an empty call is a caller's mistake, not a request
    for nothing), so every form of every call fails alike."""
    if len(values) == 0:
        raise InvalidArgumentError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{field} is empty: {call} needs at least one {what} (refused by the client; "
            "nothing was sent)",
        )


def _check_batch(
    call: str,
    seq_ids: Sequence[str],
    token_ids: Sequence[Sequence[int]] | None,
    **tensors: torch.Tensor,
) -> None:
    _check_not_empty(seq_ids, "seq_ids", call, "sequence")
    batch = len(seq_ids)
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.ndim != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"{name} must be a 4-D tensor [batch, rows, heads, head_dim], got {shape}"
            )
        if t.shape[0] != batch:
            raise ValueError(f"{name} holds {t.shape[0]} sequences, seq_ids {batch}")
    if token_ids is not None:
        if len(token_ids) != batch:
            raise ValueError(f"token_ids holds {len(token_ids)} sequences, seq_ids {batch}")
        # The request carries the ids flat: a ragged row would hand tokens to its neighbour.
        n = tensors["key"].shape[1]
        for i, row in enumerate(token_ids):
            if len(row) != n:
                raise ValueError(
                    f"token_ids[{i}] holds {len(row)} ids but key has {n} new tokens per "
                    "sequence (dimension 1)"
                )


def _batch_results(reply: Any, return_lse: bool) -> Any:
    """A batch reply's output ``[batch, m, Hq, D]`` (and lse), each one new tensor."""
    out = tensor_from_proto(reply.output, "output", ndim=4)
    if not return_lse:
        return out
    return out, tensor_from_proto(reply.lse, "lse", ndim=3)


def _results(results: Sequence[pb.AttendResult], return_lse: bool) -> list[Any]:
    # Every output lands in one new buffer (one copy), each item's tensor a view of it.
    outs = tensors_from_protos([r.output for r in results], "results[{}].output")
    if not return_lse:
        return outs
    lses = tensors_from_protos([r.lse for r in results], "results[{}].lse")
    return list(zip(outs, lses, strict=True))
