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
import time
from collections.abc import Iterator, Sequence
from typing import Any

import grpc
import torch

from cache_service._proto.kvcache.v1 import kvcache_pb2 as pb
from cache_service._proto.kvcache.v1 import kvcache_pb2_grpc as pb_grpc
from cache_service.client.arguments import (
    check_batch,
    check_not_empty,
    token_id_list,
    token_id_rows,
)
from cache_service.client.batch_path import BatchPath
from cache_service.client.errors import (
    AlreadyAppliedError,
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
    error_from_rpc,
)
from cache_service.client.kv_events import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventSubscription,
)
from cache_service.client.layout import ServiceLayout
from cache_service.client.local_session_stream import LocalSessionUnavailable
from cache_service.client.prefix_hashes import block_hashes
from cache_service.client.replies import attention_results
from cache_service.client.shared_memory import SharedMemoryUnavailable
from cache_service.client.transport import open_channel, raw_unary
from cache_service.client.values import (
    AppendAttendItem,
    AttendItem,
    ExportedBlocks,
    SequenceEntry,
    ServiceInfo,
    ServiceStats,
    WorkerInfo,
    WorkerStats,
)
from cache_service.prefix_keys import shared_prefix_length
from cache_service.wire.request_codec import (
    call_fields,
    encode_append_attend,
    encode_append_attend_batch,
    encode_attend,
    encode_attend_batch,
)
from cache_service.wire.session_codec import APPEND_ATTEND_BATCH, ATTEND_BATCH
from cache_service.wire.tensor_codec import dtype_from_proto, dtype_to_proto, tensor_to_bytes
from cache_service.wire.tls import ClientTLSConfig

__all__ = [
    "AllCleared",
    "AlreadyAppliedError",
    "AppendAttendItem",
    "AttendItem",
    "BlockRemoved",
    "BlockStored",
    "DataLossError",
    "DeadlineExceededError",
    "ExportedBlocks",
    "FailedPreconditionError",
    "InternalError",
    "InvalidArgumentError",
    "KVCacheClient",
    "KVCacheError",
    "KvEvent",
    "KvEventSubscription",
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
    "block_hashes",
]

MiB = 1 << 20
_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def _check_options(
    shared_memory: bool | str,
    session: bool,
    local_session: bool | str,
    timeout_s: float,
    deadline_grace_s: float,
    max_attempts: int,
    stream_chunk_bytes: int,
    max_message_bytes: int,
) -> None:
    """Refuse `KVCacheClient` arguments out of their range (ValueError naming the one)."""
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


class KVCacheClient(BatchPath):
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
        _check_options(
            shared_memory,
            session,
            local_session,
            timeout_s,
            deadline_grace_s,
            max_attempts,
            stream_chunk_bytes,
            max_message_bytes,
        )
        self.target = target
        self._chunk = int(stream_chunk_bytes)
        self._init_call_policy(timeout_s, max_attempts, deadline_grace_s, token)
        self._channel = open_channel(target, tls, max_message_bytes)
        self._stub = pb_grpc.KVCacheStub(self._channel)
        # The per-layer calls send requests the client encodes itself (`request_codec`).
        channel = self._channel
        self._append_attend_raw = raw_unary(channel, "AppendAttend", pb.AppendAttendResponse)
        self._attend_raw = raw_unary(channel, "Attend", pb.AttendResponse)
        self._append_attend_batch_raw = raw_unary(
            channel, "AppendAttendBatch", pb.AppendAttendBatchResponse
        )
        self._attend_batch_raw = raw_unary(channel, "AttendBatch", pb.AttendBatchResponse)
        self._layout: Any = None
        self._init_batch_path(session, local_session, shared_memory, max_message_bytes)

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
                    w.host_tier_blocks,
                    w.host_tier_used_blocks,
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
            host_hit_tokens=r.host_hit_tokens,
            host_evictions=r.host_evictions,
        )

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
        ids = token_id_list(prompt_token_ids or ())

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

    def create_sequences(
        self,
        prompts: Sequence[Sequence[int] | None],
        *,
        namespace: str = "",
        timeout_s: float | None = None,
        request_ids: Sequence[str] | None = None,
    ) -> list[SequenceHandle]:
        """`create_sequence` of every prompt (None: an empty sequence) in one call, all or
        nothing: when one cannot be created, those the call made are freed again and the
        error names the item (``sequences[i]``).

        Each item is idempotent by its request id (`request_ids`, one per prompt; fresh
        ones when None): the call is retried on UNAVAILABLE with the same ids, which
        answer the sequences a first attempt made.
        """
        shared, rests = _shared_prefix(prompts)
        items = [_prompt_ids(i, p) for i, p in enumerate(rests)]
        if request_ids is None:
            rids = [self.new_request_id() for _ in items]
        elif len(request_ids) == len(items):
            rids = list(request_ids)
        else:
            raise ValueError(f"{len(request_ids)} request ids for {len(items)} prompts")

        def build(_: str, timeout_us: int) -> pb.CreateSequencesRequest:
            return pb.CreateSequencesRequest(
                sequences=items, shared_prompt_token_ids=shared, timeout_us=timeout_us
            )

        for item, rid in zip(items, rids, strict=True):
            item.namespace, item.request_id = namespace, rid

        r = self._mutate(
            self._stub.CreateSequences,
            build,
            timeout_s=timeout_s,
            request_id=rids[0] if rids else None,
            retry_unavailable=True,
        )
        return [SequenceHandle(self, c.seq_id, c.num_cached_tokens) for c in r.sequences]

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

    def free_sequences(self, seq_ids: Sequence[str], *, timeout_s: float | None = None) -> None:
        """`free` of every sequence in one call, all or nothing: an id naming none of this
        tenant's sequences raises NotFoundError naming it, and nothing is freed."""
        self._call(
            self._stub.FreeSequences,
            pb.FreeSequencesRequest(seq_ids=list(seq_ids)),
            timeout_s=timeout_s,
            retry=False,
        )

    def lookup(
        self, token_ids: Sequence[int], *, namespace: str = "", timeout_s: float | None = None
    ) -> int:
        """Leading tokens of `token_ids` cached in `namespace` (no side effects)."""
        r = self._call(
            self._stub.Lookup,
            pb.LookupRequest(token_ids=token_id_list(token_ids), namespace=namespace),
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
            pb.PinRequest(token_ids=token_id_list(token_ids), namespace=namespace),
            timeout_s=timeout_s,
            retry=False,
        )

    def unpin(
        self, token_ids: Sequence[int], *, namespace: str = "", timeout_s: float | None = None
    ) -> None:
        """Release a `pin` of this prefix in `namespace`."""
        self._call(
            self._stub.Unpin,
            pb.UnpinRequest(token_ids=token_id_list(token_ids), namespace=namespace),
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
            token_ids=token_id_list(token_ids),
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
        check_not_empty(items, "items", "attend", "item")
        req = encode_attend(layer, [i.seq_id for i in items], [i.query for i in items], return_lse)
        r = self._call(self._attend_raw, req, timeout_s=timeout_s, retry=True)
        return attention_results(r.results, return_lse)

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
        check_not_empty(items, "items", "append_attend", "item")
        # Each field of all items goes to bytes in one copy when the items' tensors are
        # rows of one tensor, as a model's batch usually is.
        req = encode_append_attend(
            layer,
            [i.seq_id for i in items],
            [token_id_list(i.token_ids) for i in items],
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
        return attention_results(r.results, return_lse)

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
        ids = token_id_rows(token_ids)
        check_batch("append_attend_batch", seq_ids, ids, key=key, value=value, query=query)
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
        check_batch("attend_batch", seq_ids, None, query=query)
        return self._batch(
            ATTEND_BATCH,
            self._attend_batch_raw,
            functools.partial(encode_attend_batch, layer, seq_ids, return_lse=return_lse),
            (query,),
            return_lse,
            timeout_s,
            retry=True,
        )

    # -- KV events -------------------------------------------------------------------------

    def kv_events(
        self,
        from_sequence: int = 0,
        *,
        only_new: bool = False,
        worker_id: str = "",
        namespace: str | None = None,
        max_batch_events: int = 0,
        timeout_s: float | None = None,
    ) -> KvEventSubscription:
        """Subscribe to the prefix index's events (docs/contracts.md "KV events").

        Args:
            from_sequence: resume after this event number (a subscription's `position`);
                0: from the oldest event the service keeps.
            only_new: start after the newest event instead (from_sequence must be 0).
            worker_id: only this worker's events ("" = every worker).
            namespace: only this prefix-cache namespace's events (None = every one).
            max_batch_events: most events per message, 1..4096 (0: the server's 256).
            timeout_s: end the stream after this long (None: never; `cancel()` ends it).

        Returns:
            A `KvEventSubscription`; iterate it for `KvEvent`s.

        Raises:
            ValueError: a negative from_sequence or max_batch_events (the server checks
                the rest: INVALID_ARGUMENT / OUT_OF_RANGE, raised while iterating).
        """
        if type(from_sequence) is not int or from_sequence < 0:
            raise ValueError(f"from_sequence must be an int >= 0, got {from_sequence!r}")
        if type(max_batch_events) is not int or max_batch_events < 0:
            raise ValueError(f"max_batch_events must be an int >= 0, got {max_batch_events!r}")
        request = pb.SubscribeKvEventsRequest(
            from_sequence=from_sequence,
            only_new=only_new,
            worker_id=worker_id,
            max_batch_events=max_batch_events,
        )
        if namespace is not None:
            request.namespace = namespace
        call = self._stub.SubscribeKvEvents(request, timeout=timeout_s, metadata=self._metadata)
        return KvEventSubscription(call, from_sequence)

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
            raise error_from_rpc(exc) from None

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


def _shared_prefix(
    prompts: Sequence[Sequence[int] | torch.Tensor | None],
) -> tuple[list[int], list[Sequence[int] | None]]:
    """The token ids every prompt begins with (sent once, as
    CreateSequencesRequest.shared_prompt_token_ids) and what follows them in each prompt;
    none shared for fewer than two prompts or an empty one (None)."""
    if len(prompts) < 2 or any(p is None for p in prompts):
        return [], [None if p is None else _as_ids(p) for p in prompts]
    rows = [_as_ids(p) for p in prompts]
    n = _common_length(rows)
    shared = rows[0][:n]
    if shared:
        try:
            pb.CreateSequenceRequest(prompt_token_ids=shared)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"the prompts' shared first tokens must be token ids: {exc}") from None
    return shared, [row[n:] for row in rows]


def _common_length(rows: list[list[int]]) -> int:
    """How many leading items all `rows` share: those the least and the greatest row
    share (every row lies between them)."""
    try:
        first, last = min(rows), max(rows)
    except TypeError:  # items that do not compare (not ids): protobuf names the prompt
        return 0
    return shared_prefix_length(first, last, min(len(first), len(last)))


def _as_ids(prompt: Sequence[int] | torch.Tensor) -> list[int]:
    """A prompt as a list (a tensor's ids, a tuple's items; ints or not, protobuf checks)."""
    if isinstance(prompt, torch.Tensor):
        return token_id_list(prompt)
    return prompt if type(prompt) is list else list(prompt)


def _prompt_ids(i: int, prompt: Sequence[int] | torch.Tensor | None) -> pb.CreateSequenceRequest:
    """One item of a CreateSequences request: its prompt's token ids, encoded by protobuf
    (which refuses anything but ints) rather than converted one by one in Python first
    (a batch of 2k-token prompts took milliseconds that way)."""
    if isinstance(prompt, torch.Tensor):
        prompt = token_id_list(prompt)
    try:
        return pb.CreateSequenceRequest(prompt_token_ids=prompt or ())
    except (TypeError, ValueError) as exc:
        raise ValueError(f"prompts[{i}] must be token ids (ints): {exc}") from None
