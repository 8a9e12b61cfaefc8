"""The gRPC servicer of kvcache.v1: `KVCacheServicer` over a Coordinator.

It only translates (protobuf <-> torch), validates what the wire carries and maps errors to
statuses (`status_mapping`); the coordinator does the work. Unary calls go through `_rpc`
(status mapping and logging); the Session stream answers its calls one by one, and local
sessions (`local_sessions`) call `_session_call` / `session_call_now` directly. The process
around it (workers, coordinator, gRPC server, health) is assembled by `api.service`.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio

from cache_service._proto.kvcache.v1 import kvcache_pb2 as pb
from cache_service._proto.kvcache.v1 import kvcache_pb2_grpc as pb_grpc
from cache_service.api.auth import Permission, current_principal
from cache_service.api.batch_decode_memo import BatchDecodeMemo
from cache_service.api.kv_event_stream import kv_event_batches
from cache_service.api.request_decode import (
    decode_append_attend,
    decode_attend,
    decode_attend_batch,
)
from cache_service.api.result_codec import encode_results
from cache_service.api.shared_outputs import batch_reply, shared_outputs
from cache_service.api.status_mapping import status_for
from cache_service.api.stream_decode import (
    item_prompt,
    nonempty_ids,
    read_append,
    read_import,
    require_seq_id,
    shared_prompt,
)
from cache_service.config import SharedMemoryConfig
from cache_service.engine.call_deadline import check_deadline, commit_deadline, deadline_scope
from cache_service.engine.call_origin import origin_scope
from cache_service.engine.eager_tasks import start_eagerly
from cache_service.engine.errors import ServiceUnavailable
from cache_service.engine.request_ids import MAX_REQUEST_ID_BYTES, RequestLedger, check_request_id
from cache_service.engine.worker_interface import AttentionResult
from cache_service.errors import InvalidRequest, NotColocated
from cache_service.wire.session_codec import (
    APPEND_ATTEND_BATCH,
    ATTEND_BATCH,
    STEP_LEASE,
    session_error,
    session_message,
)
from cache_service.wire.shared_regions import RegionReader, SharedRegions
from cache_service.wire.tensor_codec import dtype_from_name, dtype_to_proto, tensor_to_bytes
from workers.layout import KVLayout

if TYPE_CHECKING:  # built by api.service, the one module that constructs a Coordinator
    from cache_service.engine.coordinator import Coordinator

__all__ = ["DEFAULT_TENANT", "METHOD_PERMISSIONS", "SERVICE_NAME", "KVCacheServicer"]

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVCache"].full_name
# The tenant of every call when the server runs without a token file.
DEFAULT_TENANT = "default"
# Methods that need a permission beyond ordinary use (checked by the auth interceptor).
METHOD_PERMISSIONS = {f"/{SERVICE_NAME}/PublishPublic": Permission.PUBLISH_PUBLIC}

log = logging.getLogger("kvcache.server")
# ListSequences page sizes: the default (page_size 0) and the largest accepted.
_DEFAULT_PAGE_SIZE = 100
_MAX_PAGE_SIZE = 1000
# SessionRequest.call kinds: (their name in logs and metrics, their SessionResponse field).
_SESSION_CALLS = {
    "append_attend_batch": ("Session.AppendAttendBatch", APPEND_ATTEND_BATCH),
    "attend_batch": ("Session.AttendBatch", ATTEND_BATCH),
    "step_lease": ("Session.StepLease", STEP_LEASE),
}  # the servicer runs kind "x" with its method `_x`


def _version() -> str:
    try:
        return importlib.metadata.version("paged-kvcache-service")
    except importlib.metadata.PackageNotFoundError:
        return "0.1.0+source"


# ------------------------------------------------------------------------------ servicer


def _rpc(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run a unary servicer method; map any exception to a status, log the outcome."""
    name = method.__name__

    @functools.wraps(method)
    async def wrapper(
        self: KVCacheServicer, request: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        t0 = time.perf_counter()
        tenant = _tenant()
        try:
            reply = await method(self, request, context, tenant)
        except Exception as exc:
            await _abort(context, name, tenant, exc, t0)
        if log.isEnabledFor(logging.DEBUG):  # no per-call record building when unused
            log.debug("rpc ok", extra=_fields(name, tenant, "OK", t0))
        return reply

    return wrapper


async def _abort(
    context: grpc.aio.ServicerContext, name: str, tenant: str, exc: Exception, t0: float
) -> None:
    if isinstance(exc, asyncio.CancelledError):  # pragma: no cover - never an Exception
        raise exc
    status = _logged_status(name, tenant, exc, t0)
    await context.abort(status.code, status.message)


def _logged_status(name: str, tenant: str, exc: Exception, t0: float) -> Any:
    """The status a failed call answers with (`status_for`), logged: refusals at info,
    internal errors at error with the traceback."""
    status = status_for(exc)
    fields = _fields(name, tenant, status.code.name, t0)
    if status.internal:
        log.error("rpc failed: %s", status.message, exc_info=exc, extra=fields)
    else:
        log.info("rpc refused: %s", status.message, extra=fields)
    return status


def _fields(method: str, tenant: str, code: str, t0: float) -> dict[str, Any]:
    return {
        "method": method,
        "tenant": tenant,
        "code": code,
        "ms": round((time.perf_counter() - t0) * 1000, 3),
    }


def _may_see_tenant(other: str, tenant: str) -> bool:
    """Per-tenant figures are private: a tenant sees its own; an admin, or every caller of a
    server without authentication, sees all."""
    principal = current_principal()
    return principal is None or principal.policy.admin or other == tenant


def _tenant() -> str:
    principal = current_principal()
    return principal.tenant if principal is not None else DEFAULT_TENANT


def _layout_proto(layout: KVLayout) -> pb.KVLayout:
    return pb.KVLayout(
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        block_size=layout.block_size,
        kv_dtype=dtype_to_proto(dtype_from_name(layout.dtype)),
        fingerprint=layout.fingerprint(),
        bytes_per_block=layout.bytes_per_block,
    )


class KVCacheServicer(pb_grpc.KVCacheServicer):
    """kvcache.v1.KVCache over a Coordinator.

    Args:
        coordinator: a started coordinator.
        max_message_bytes: the server's message limit (reported by GetInfo, caps chunks).
        stream_chunk_bytes: default data bytes per export message.
        shared_regions: the shared-memory regions of same-host clients (None: a disabled
            registry, CreateSharedRegion answers FAILED_PRECONDITION).
        metrics: a ServiceMetrics recording each session call like an RPC (optional).
    """

    def __init__(
        self,
        coordinator: Coordinator,
        max_message_bytes: int,
        stream_chunk_bytes: int,
        shared_regions: SharedRegions | None = None,
        metrics: Any = None,
    ) -> None:
        self._coord = coordinator
        self._metrics = metrics
        # Session streams waiting for their next call (their handlers' tasks), and whether
        # the server is shutting down (see end_sessions).
        self._idle_sessions: set[asyncio.Task[Any]] = set()
        # Calls of `session_call_now` gone the full way (held: the loop keeps weak refs).
        self._full_paths: set[asyncio.Task[None]] = set()
        self._draining = False
        # Set at shutdown: ends the KV event streams (they would otherwise never end).
        self._stop_streams = asyncio.Event()
        self._max_message = max_message_bytes
        self._chunk = stream_chunk_bytes
        self._version = _version()
        if shared_regions is None:
            shared_regions = SharedRegions(SharedMemoryConfig(enabled=False))
        self._regions = shared_regions
        # The first call of a decode step decoded for its other layers' calls.
        self._batch_decoder = BatchDecodeMemo(shared_regions, coordinator.layout)
        # The local sessions' socket (start_service sets it once they serve); GetInfo
        # tells clients, which on this host may then send their session calls there.
        self.local_session_socket = ""
        # Outcomes of recent request ids: a retried mutating call is applied once.
        self._ledger = RequestLedger()

    async def _once(
        self,
        tenant: str,
        request_id: str,
        deadline: float,
        call: Callable[[], Any],
    ) -> Any:
        """Run a mutating call (`call()` is its coroutine) under its commit `deadline`
        (`call_deadline`) and, when it has a request id, at most once (`RequestLedger`)."""
        with deadline_scope(deadline):
            if not request_id:
                check_deadline(deadline)  # already late: refuse before doing anything
                return await call()
            return await self._ledger.run(tenant, check_request_id(request_id), call, deadline)

    def _shared_reader(self, tenant: str) -> RegionReader:
        """Reads the tenant's `Tensor.shared` payloads for one call (copies, or views held
        until the reader is closed: SharedRegions.reader)."""
        return self._regions.reader(tenant)

    # -- info ------------------------------------------------------------------------------

    @_rpc
    async def GetInfo(
        self, request: pb.GetInfoRequest, context: Any, tenant: str
    ) -> pb.GetInfoResponse:
        layout = self._coord.layout
        workers = self._coord.workers()
        total = sum(w.num_blocks for w in workers if w.up)
        return pb.GetInfoResponse(
            layout=_layout_proto(layout),
            workers=[
                pb.WorkerInfo(
                    worker_id=w.worker_id,
                    device=w.device,
                    num_blocks=w.num_blocks,
                    epoch=w.epoch,
                    up=w.up,
                    data_path=self._coord.data_path(w.worker_id),
                )
                for w in workers
            ],
            total_blocks=total,
            capacity_tokens=total * layout.block_size,
            max_message_bytes=self._max_message,
            server_version=self._version,
            local_session_socket=self.local_session_socket,
        )

    @_rpc
    async def GetStats(
        self, request: pb.GetStatsRequest, context: Any, tenant: str
    ) -> pb.GetStatsResponse:
        s = self._coord.stats()
        return pb.GetStatsResponse(
            workers=[
                pb.WorkerStats(
                    worker_id=w,
                    total_blocks=ws.total,
                    used_blocks=ws.used,
                    cached_free_blocks=ws.cached_free,
                    free_blocks=ws.free,
                    allocated_slots=ws.allocated_slots,
                    filled_slots=ws.filled_slots,
                    host_tier_blocks=s.host_tiers[w].total if w in s.host_tiers else 0,
                    host_tier_used_blocks=s.host_tiers[w].used if w in s.host_tiers else 0,
                )
                for w, ws in s.workers.items()
            ],
            utilization=s.utilization,
            fragmentation=s.fragmentation,
            prefix=[
                pb.TenantPrefixStats(
                    tenant=t, query_tokens=q, hit_tokens=s.prefix_hit_tokens.get(t, 0)
                )
                for t, q in sorted(s.prefix_query_tokens.items())
                if _may_see_tenant(t, tenant)
            ],
            evictions=s.evictions,
            cow_copies=s.cow_copies,
            pinned_blocks=s.pinned_blocks,
            active_sequences=s.active_sequences,
            lost_sequences=s.lost_sequences,
            host_hit_tokens=s.host_hit_tokens,
            host_evictions=s.host_evictions,
        )

    # -- sequences -------------------------------------------------------------------------

    @_rpc
    async def CreateSequence(
        self, request: pb.CreateSequenceRequest, context: Any, tenant: str
    ) -> pb.CreateSequenceResponse:
        prompt = list(request.prompt_token_ids) or None
        request_id = check_request_id(request.request_id)

        async def create() -> pb.CreateSequenceResponse:
            created = await self._coord.create_sequence(
                tenant, prompt, request.namespace, request_id
            )
            return pb.CreateSequenceResponse(
                seq_id=created.seq_id, num_cached_tokens=created.num_cached_tokens
            )

        deadline = commit_deadline(request.timeout_us, context.time_remaining())
        return await self._create_once(tenant, request_id, deadline, create)

    @_rpc
    async def ForkSequence(
        self, request: pb.ForkSequenceRequest, context: Any, tenant: str
    ) -> pb.ForkSequenceResponse:
        request_id = check_request_id(request.request_id)
        seq_id = require_seq_id(request.seq_id)

        async def fork() -> pb.ForkSequenceResponse:
            created = await self._coord.fork(tenant, seq_id, request_id)
            return pb.ForkSequenceResponse(
                seq_id=created.seq_id, num_cached_tokens=created.num_cached_tokens
            )

        deadline = commit_deadline(request.timeout_us, context.time_remaining())
        return await self._create_once(tenant, request_id, deadline, fork)

    async def _create_once(
        self, tenant: str, request_id: str, deadline: float, call: Callable[[], Any]
    ) -> Any:
        """A create or fork under its commit deadline, through the ledger when it has a
        request id (a repeat answers the first reply; a DEADLINE_EXCEEDED is remembered).
        The coordinator checks the deadline itself, after looking for the sequence the
        request id names: a retry after a restart (ledger empty, sequence recovered) finds
        it even with its deadline passed."""
        with deadline_scope(deadline):
            if not request_id:
                return await call()
            return await self._ledger.run(tenant, request_id, call)

    @_rpc
    async def FreeSequence(
        self, request: pb.FreeSequenceRequest, context: Any, tenant: str
    ) -> pb.FreeSequenceResponse:
        await self._coord.free(tenant, require_seq_id(request.seq_id))
        return pb.FreeSequenceResponse()

    @_rpc
    async def CreateSequences(
        self, request: pb.CreateSequencesRequest, context: Any, tenant: str
    ) -> pb.CreateSequencesResponse:
        items = []
        shared = shared_prompt(request.shared_prompt_token_ids)
        for i, item in enumerate(request.sequences):
            try:
                request_id = check_request_id(item.request_id)
            except InvalidRequest as exc:
                raise InvalidRequest(f"sequences[{i}]: {exc}") from None
            items.append(
                (item_prompt(i, item.prompt_token_ids, shared), item.namespace, request_id)
            )
        deadline = commit_deadline(request.timeout_us, context.time_remaining())
        with deadline_scope(deadline):
            created = await self._coord.create_sequences(tenant, items)
        return pb.CreateSequencesResponse(
            sequences=[
                pb.CreateSequenceResponse(seq_id=c.seq_id, num_cached_tokens=c.num_cached_tokens)
                for c in created
            ]
        )

    @_rpc
    async def FreeSequences(
        self, request: pb.FreeSequencesRequest, context: Any, tenant: str
    ) -> pb.FreeSequencesResponse:
        ids = [require_seq_id(s, f"seq_ids[{i}]") for i, s in enumerate(request.seq_ids)]
        await self._coord.free_sequences(tenant, ids)
        return pb.FreeSequencesResponse()

    @_rpc
    async def ListSequences(
        self, request: pb.ListSequencesRequest, context: Any, tenant: str
    ) -> pb.ListSequencesResponse:
        size = request.page_size or _DEFAULT_PAGE_SIZE
        if size > _MAX_PAGE_SIZE:
            raise InvalidRequest(f"page_size is {size}; at most {_MAX_PAGE_SIZE} are allowed")
        page, more = self._coord.list_sequences(tenant, request.page_token, size)
        return pb.ListSequencesResponse(
            sequences=[
                pb.SequenceEntry(
                    seq_id=e.seq_id, num_tokens=e.num_tokens, written=e.written, lost=e.lost
                )
                for e in page
            ],
            next_page_token=page[-1].seq_id if more and page else "",
        )

    @_rpc
    async def Lookup(
        self, request: pb.LookupRequest, context: Any, tenant: str
    ) -> pb.LookupResponse:
        n = await self._coord.lookup(tenant, list(request.token_ids), request.namespace)
        return pb.LookupResponse(num_cached_tokens=n)

    @_rpc
    async def Pin(self, request: pb.PinRequest, context: Any, tenant: str) -> pb.PinResponse:
        await self._coord.pin(tenant, nonempty_ids(request.token_ids), request.namespace)
        return pb.PinResponse()

    @_rpc
    async def Unpin(self, request: pb.UnpinRequest, context: Any, tenant: str) -> pb.UnpinResponse:
        await self._coord.unpin(tenant, nonempty_ids(request.token_ids), request.namespace)
        return pb.UnpinResponse()

    @_rpc
    async def PublishPublic(
        self, request: pb.PublishPublicRequest, context: Any, tenant: str
    ) -> pb.PublishPublicResponse:
        await self._coord.publish_public(tenant, require_seq_id(request.seq_id))
        return pb.PublishPublicResponse()

    # -- data ------------------------------------------------------------------------------

    async def Append(
        self, request_iterator: AsyncIterator[pb.AppendRequest], context: grpc.aio.ServicerContext
    ) -> pb.AppendResponse:
        t0 = time.perf_counter()
        tenant = _tenant()
        try:
            head, key, value = await read_append(request_iterator)
            layer = head.layer if head.HasField("layer") else None

            async def append() -> pb.AppendResponse:
                start = await self._coord.append(
                    tenant, require_seq_id(head.seq_id), layer, list(head.token_ids), key, value
                )
                return pb.AppendResponse(start_position=start, num_tokens=len(head.token_ids))

            deadline = commit_deadline(head.timeout_us, context.time_remaining())
            reply = await self._once(tenant, head.request_id, deadline, append)
        except Exception as exc:
            await _abort(context, "Append", tenant, exc, t0)
        log.debug("rpc ok", extra=_fields("Append", tenant, "OK", t0))
        return reply

    @_rpc
    async def Attend(self, request: pb.AttendRequest, context: Any, tenant: str) -> bytes:
        items = decode_attend(request)
        results = await self._coord.attend(tenant, request.layer, items, request.return_lse)
        return encode_results(results, request.return_lse)  # an encoded AttendResponse

    @_rpc
    async def AppendAttend(
        self, request: pb.AppendAttendRequest, context: Any, tenant: str
    ) -> bytes:
        items, joined = decode_append_attend(request)

        async def append_attend() -> bytes:
            results = await self._coord.append_attend(
                tenant, request.layer, items, request.return_lse, joined=joined
            )
            return encode_results(results, request.return_lse)  # an AppendAttendResponse

        deadline = commit_deadline(request.timeout_us, context.time_remaining())
        return await self._once(tenant, request.request_id, deadline, append_attend)

    @_rpc
    async def AppendAttendBatch(
        self, request: pb.AppendAttendBatchRequest, context: Any, tenant: str
    ) -> bytes:
        deadline = commit_deadline(request.timeout_us, context.time_remaining())
        return await self._once(
            tenant,
            request.request_id,
            deadline,
            functools.partial(self._append_attend_batch, request, tenant),
        )

    @_rpc
    async def AttendBatch(self, request: pb.AttendBatchRequest, context: Any, tenant: str) -> bytes:
        return await self._attend_batch(request, tenant)

    async def _append_attend_batch(
        self, request: pb.AppendAttendBatchRequest, tenant: str, short_path: bool = True
    ) -> bytes:
        """An AppendAttendBatch call (unary or in a session): the encoded reply.
        short_path: as in `Coordinator.append_attend_stacked`."""
        # The decode checks output ranges too, before the coordinator changes anything.
        with self._batch_decoder.decode(tenant, request) as call:
            # Errors about one sequence name it as items[i]: row i of the batch.
            result = await self._coord.append_attend_stacked(
                tenant,
                request.layer,
                call.batch,
                request.return_lse,
                call.output_view,
                call.rows,
                short_path=short_path,
            )
            return call.reply(result)

    async def _attend_batch(self, request: pb.AttendBatchRequest, tenant: str) -> bytes:
        """An AttendBatch call (unary or in a session): the encoded reply."""
        with self._shared_reader(tenant) as shared:
            items, shape = decode_attend_batch(request, self._coord.layout, shared)
            outputs = shared_outputs(self._regions, tenant, request, shape, items[0].query.dtype)
            with outputs:
                (result,) = await self._coord.attend(
                    tenant, request.layer, items, request.return_lse, stacked=True
                )
                return batch_reply(result, shape, outputs)

    # -- session ---------------------------------------------------------------------------

    async def Session(
        self, request_iterator: AsyncIterator[pb.SessionRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        """Batch calls as messages of one stream, answered one by one, in order."""
        tenant = _tenant()
        task = asyncio.current_task()
        if self._draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        # Idle between calls: end_sessions() may cancel the stream then, never mid-call.
        self._idle_sessions.add(task)
        origin = id(context)  # the batcher counts this stream's calls as one client's
        try:
            async for request in request_iterator:
                self._idle_sessions.discard(task)
                with origin_scope(origin):
                    reply = await self._session_call(request, tenant)
                yield reply
                if self._draining:
                    break
                self._idle_sessions.add(task)
        except asyncio.CancelledError:
            if not self._draining:
                raise
        except Exception as exc:  # a message that does not parse ends the stream
            await _abort(context, "Session", tenant, exc, time.perf_counter())
        finally:
            self._idle_sessions.discard(task)
        if self._draining:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                "the server is shutting down; the session ended after its last call (open "
                "a new one when the service is back)",
            )

    async def _session_call(
        self,
        request: pb.SessionRequest,
        tenant: str,
        short_path: bool = True,
        held: tuple[Any, Any] | None = None,
        *,
        local: bool = False,
    ) -> bytes:
        """One session call's encoded SessionResponse: its reply, or its error status.
        short_path: False to take an AppendAttendBatch the full way (`session_call_now`
        after the worker refused its values); held: the request id's ledger record that
        `session_call_now` began (key, entry), to finish instead of a new one; local: the
        call came over a local session (a client on this host), which a step lease needs."""
        t0 = time.perf_counter()
        kind = request.WhichOneof("call")
        name = _SESSION_CALLS.get(kind, ("Session", 0))[0]
        try:
            if kind not in _SESSION_CALLS:
                raise InvalidRequest(
                    "the SessionRequest carries no call: set append_attend_batch, attend_batch or "
                    "step_lease"
                )
            if kind == "append_attend_batch":
                body = request.append_attend_batch
                run = functools.partial(self._append_attend_batch, body, tenant, short_path)
                # A stream message has no gRPC deadline: timeout_us is its only one.
                deadline = commit_deadline(body.timeout_us)
                if held is not None:  # `session_call_now` began this request id's record
                    with deadline_scope(deadline):
                        reply = await self._ledger.run_held(*held, run)
                else:
                    reply = await self._once(tenant, body.request_id, deadline, run)
            elif kind == "step_lease":
                reply = await self._step_lease(request.step_lease, tenant, local)
            else:
                reply = await getattr(self, f"_{kind}")(getattr(request, kind), tenant)
        except Exception as exc:
            return self._session_error(request, name, tenant, exc, t0)
        self._observe_session_call(name, "OK", t0)
        return session_message(request.call_id, _SESSION_CALLS[kind][1], reply)

    async def _step_lease(self, body: pb.StepLeaseRequest, tenant: str, local: bool) -> bytes:
        """A step lease for a local session's batch (`Coordinator.lease_step`)."""
        if not local:
            raise NotColocated(
                "a step lease is for a client on the server's host: open a local session "
                "(GetInfoResponse.local_session_socket)"
            )
        seq_ids = list(body.seq_ids)
        rows = None
        if body.token_ids:
            ids, b = list(body.token_ids), len(seq_ids)
            counts = list(body.num_tokens)
            if not counts and b and len(ids) % b == 0:
                counts = [len(ids) // b] * b
            if len(counts) != b or sum(counts) != len(ids):
                raise InvalidRequest(
                    f"token_ids holds {len(ids)} ids for {b} sequences with num_tokens "
                    f"{list(body.num_tokens)}: they must add up"
                )
            ends = list(itertools.accumulate(counts))
            rows = [ids[end - c : end] for end, c in zip(ends, counts, strict=True)]
        if body.steps > 1 and rows is None:
            raise InvalidRequest(
                f"steps={body.steps} needs token_ids: a lease of several steps is planned "
                "for the first step's new tokens"
            )
        grant = await self._coord.lease_step(
            tenant,
            seq_ids,
            body.num_q_heads,
            rows,
            dict(body.lease_connections),
            max(1, body.steps),
        )
        return pb.StepLeaseResponse(
            granted=grant.granted,
            reason=grant.reason,
            lease_id=grant.lease_id,
            socket=grant.socket,
            layers=grant.layers,
            timeout_us=int(grant.timeout_s * 1e6),
            plan=grant.plan,
            steps=grant.steps if grant.granted else 0,
        ).SerializeToString()

    def _session_error(
        self, request: pb.SessionRequest, name: str, tenant: str, exc: Exception, t0: float
    ) -> bytes:
        """A failed session call's SessionResponse: its status, logged and counted."""
        status = _logged_status(name, tenant, exc, t0)
        self._observe_session_call(name, status.code.name, t0)
        return session_error(request.call_id, status.code, status.message)

    def session_call_now(
        self,
        request: pb.SessionRequest,
        tenant: str,
        origin: int,
        answer: Callable[[bytes], None],
    ) -> bool:
        """A repeated layer's AppendAttendBatch answered without a task, for a local
        session: on a decode-memo hit, the coordinator's `repeat_now` submits it at once
        and `answer` gets the encoded SessionResponse (reply or error) from the round's
        callback. True: taken, `answer` called once, later (when the round refused
        non-finite values, nothing written, after the full path, which names them).
        False: nothing taken (another call, no memo entry, a lock held): run
        `_session_call`."""
        if request.WhichOneof("call") != "append_attend_batch":
            return False
        t0 = time.perf_counter()
        body = request.append_attend_batch
        request_id = body.request_id
        ledger = self._ledger
        if request_id and (
            len(request_id) > MAX_REQUEST_ID_BYTES // 4 or ledger.known(tenant, request_id)
        ):
            return False  # a retry, or a long id to check: the usual way answers it
        deadline = commit_deadline(body.timeout_us)
        call = self._batch_decoder.kept(tenant, body)
        if call is None:
            return False
        held = None

        def finished(outcome: AttentionResult | BaseException | None) -> None:
            if outcome is None:
                call.close()
                self._full_path_later(request, tenant, origin, answer, held)
                return
            name = _SESSION_CALLS["append_attend_batch"][0]
            with call:
                try:
                    if not isinstance(outcome, AttentionResult):
                        raise outcome
                    inner = call.reply(outcome)
                    if held is not None:
                        ledger.finish(*held, inner)
                    reply = session_message(request.call_id, APPEND_ATTEND_BATCH, inner)
                    self._observe_session_call(name, "OK", t0)
                except BaseException as exc:  # the call's error, answered as its status
                    error = (
                        exc
                        if isinstance(exc, Exception)
                        else RuntimeError(f"the call was interrupted: {exc!r}")
                    )
                    if held is not None:
                        ledger.finish(*held, error)
                    reply = self._session_error(request, name, tenant, error, t0)
            answer(reply)

        try:
            with deadline_scope(deadline):  # `repeat_now` hands it to the round's callback
                taken = self._coord.repeat_now(
                    tenant, body.layer, call.batch, body.return_lse, call.output_view,
                    call.rows, origin, finished,
                )  # fmt: skip
        except Exception:
            taken = False  # the usual way raises it again, with its status
        if not taken:
            call.close()
        elif request_id:
            # Recorded as running now: the round's callback (`finished`) comes later.
            key = (tenant, request_id)
            held = (key, ledger.begin(key, deadline))
        return taken

    def _full_path_later(
        self,
        request: pb.SessionRequest,
        tenant: str,
        origin: int,
        answer: Callable[[bytes], None],
        held: tuple[Any, Any] | None = None,
    ) -> None:
        """`session_call_now`'s call after the worker refused its values: the full path (in
        a task), which finds whose and says so; its reply to `answer`. held: as in
        `_session_call`."""

        async def full() -> None:
            with origin_scope(origin):
                answer(await self._session_call(request, tenant, short_path=False, held=held))

        task = start_eagerly(full())
        self._full_paths.add(task)
        task.add_done_callback(self._full_paths.discard)

    def _observe_session_call(self, name: str, code: str, t0: float) -> None:
        if self._metrics is not None:
            self._metrics.observe_session_call(name, code, time.perf_counter() - t0)

    def end_sessions(self) -> None:
        """Shutting down: refuse new sessions, end each open one after its call in flight
        (UNAVAILABLE), and the idle ones now."""
        self._draining = True
        self._stop_streams.set()
        for task in list(self._idle_sessions):
            task.cancel()

    # -- shared memory ---------------------------------------------------------------------

    @_rpc
    async def CreateSharedRegion(
        self, request: pb.CreateSharedRegionRequest, context: Any, tenant: str
    ) -> pb.CreateSharedRegionResponse:
        info = await self._regions.create(tenant, request.size_bytes)
        return pb.CreateSharedRegionResponse(
            region_id=info.region_id, path=info.path, size_bytes=info.size_bytes
        )

    @_rpc
    async def ReleaseSharedRegion(
        self, request: pb.ReleaseSharedRegionRequest, context: Any, tenant: str
    ) -> pb.ReleaseSharedRegionResponse:
        self._regions.release(tenant, request.region_id)
        return pb.ReleaseSharedRegionResponse()

    # -- export / import -------------------------------------------------------------------

    async def ExportBlocks(
        self, request: pb.ExportBlocksRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ExportBlocksResponse]:
        t0 = time.perf_counter()
        tenant = _tenant()
        try:
            chunk = int(request.chunk_bytes) or self._chunk
            # Leave room for the message framing under the limit.
            chunk = max(1, min(chunk, self._max_message - 4096))
            exported = await self._coord.export(tenant, require_seq_id(request.seq_id))
            data = tensor_to_bytes(exported.blocks)
            header = pb.ExportHeader(
                layout=_layout_proto(self._coord.layout),
                token_ids=exported.token_ids,
                num_tokens=exported.num_tokens,
                block_shape=list(exported.blocks.shape),
                total_bytes=len(data),
            )
        except Exception as exc:
            await _abort(context, "ExportBlocks", tenant, exc, t0)
        yield pb.ExportBlocksResponse(header=header)
        view = memoryview(data)
        for start in range(0, len(view), chunk):
            yield pb.ExportBlocksResponse(data=bytes(view[start : start + chunk]))
        log.debug("rpc ok", extra=_fields("ExportBlocks", tenant, "OK", t0))

    async def SubscribeKvEvents(
        self, request: pb.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.KvEventBatch]:
        t0 = time.perf_counter()
        tenant = _tenant()
        principal = current_principal()
        sees_all = principal is None or principal.policy.admin
        try:
            if self._draining:
                raise ServiceUnavailable("the server is shutting down")
            batches = kv_event_batches(self._coord, request, tenant, sees_all, self._stop_streams)
            async for batch in batches:
                yield batch
            if self._stop_streams.is_set():
                raise ServiceUnavailable("the server is shutting down; resubscribe elsewhere")
        except Exception as exc:
            await _abort(context, "SubscribeKvEvents", tenant, exc, t0)
        log.debug("rpc ok", extra=_fields("SubscribeKvEvents", tenant, "OK", t0))

    async def ImportBlocks(
        self,
        request_iterator: AsyncIterator[pb.ImportBlocksRequest],
        context: grpc.aio.ServicerContext,
    ) -> pb.ImportBlocksResponse:
        t0 = time.perf_counter()
        tenant = _tenant()
        try:
            header, blocks = await read_import(request_iterator, self._coord.layout)
            imported = await self._coord.import_(tenant, list(header.token_ids), blocks)
        except Exception as exc:
            await _abort(context, "ImportBlocks", tenant, exc, t0)
        log.debug("rpc ok", extra=_fields("ImportBlocks", tenant, "OK", t0))
        return pb.ImportBlocksResponse(
            seq_id=imported.seq_id,
            num_cached_tokens=imported.num_cached_tokens,
            num_tokens=imported.num_tokens,
        )
