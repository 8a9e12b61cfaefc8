"""The gRPC front of the service: a grpc.aio servicer for kvcache.v1 and its process setup.

The servicer only translates (protobuf <-> torch), validates what the wire carries and maps
errors to statuses (`status_mapping`); the coordinator does the work. `start_service`
assembles a running service: workers (in-process, a local Ray or a Ray cluster), the
coordinator, the gRPC server with health checking, reflection, authentication and metrics,
the shared-memory regions of same-host clients (`shared_regions`) and the Prometheus
endpoint. `RunningService.stop()` drains: health turns NOT_SERVING, new calls are refused,
calls in flight get `shutdown_grace_s` to finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import importlib.metadata
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cache_service._proto.kvcache.v1 import kvcache_pb2 as pb
from cache_service._proto.kvcache.v1 import kvcache_pb2_grpc as pb_grpc
from cache_service.api.auth import (
    AuthInterceptor,
    Permission,
    current_principal,
    load_token_table,
)
from cache_service.api.batch_decode_memo import BatchDecodeMemo
from cache_service.api.inflight import InFlightLimiter, InFlightLimitInterceptor
from cache_service.api.local_sessions import Authenticate, LocalSessions
from cache_service.api.request_decode import (
    decode_append_attend,
    decode_attend,
    decode_attend_batch,
)
from cache_service.api.result_codec import encode_results
from cache_service.api.shared_outputs import batch_reply, shared_outputs
from cache_service.api.status_mapping import status_for
from cache_service.api.wire_decode import RequestDecodeInterceptor
from cache_service.config import ServiceConfig, SharedMemoryConfig
from cache_service.control.types import TenantQuota
from cache_service.engine.call_deadline import check_deadline, commit_deadline, deadline_scope
from cache_service.engine.call_origin import origin_scope
from cache_service.engine.coordinator import Coordinator
from cache_service.engine.eager_tasks import start_eagerly
from cache_service.engine.request_ids import MAX_REQUEST_ID_BYTES, RequestLedger, check_request_id
from cache_service.engine.store import MetadataStore, StoreConfig
from cache_service.engine.worker_interface import AttentionResult
from cache_service.errors import InvalidRequest
from cache_service.event_loop import loop_name
from cache_service.obs.loop import probe_loop_lag
from cache_service.wire.session_codec import (
    APPEND_ATTEND_BATCH,
    ATTEND_BATCH,
    session_error,
    session_message,
)
from cache_service.wire.shared_regions import RegionReader, SharedRegions
from cache_service.wire.tensor_codec import (
    TensorCodecError,
    check_shape,
    dtype_from_name,
    dtype_from_proto,
    dtype_to_proto,
    tensor_from_bytes,
    tensor_to_bytes,
)
from cache_service.wire.tls import ServerTLSConfig, server_credentials
from cache_service.wire.worker_channel import remove_orphan_arenas
from workers.layout import KVLayout

__all__ = [
    "DEFAULT_TENANT",
    "SERVICE_NAME",
    "KVCacheServicer",
    "RunningService",
    "configure_logging",
    "start_service",
]

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
        seq_id = _seq_id(request.seq_id)

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
        await self._coord.free(tenant, _seq_id(request.seq_id))
        return pb.FreeSequenceResponse()

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
        await self._coord.pin(tenant, _nonempty_ids(request.token_ids), request.namespace)
        return pb.PinResponse()

    @_rpc
    async def Unpin(self, request: pb.UnpinRequest, context: Any, tenant: str) -> pb.UnpinResponse:
        await self._coord.unpin(tenant, _nonempty_ids(request.token_ids), request.namespace)
        return pb.UnpinResponse()

    @_rpc
    async def PublishPublic(
        self, request: pb.PublishPublicRequest, context: Any, tenant: str
    ) -> pb.PublishPublicResponse:
        await self._coord.publish_public(tenant, _seq_id(request.seq_id))
        return pb.PublishPublicResponse()

    # -- data ------------------------------------------------------------------------------

    async def Append(
        self, request_iterator: AsyncIterator[pb.AppendRequest], context: grpc.aio.ServicerContext
    ) -> pb.AppendResponse:
        t0 = time.perf_counter()
        tenant = _tenant()
        try:
            head, key, value = await _read_append(request_iterator)
            layer = head.layer if head.HasField("layer") else None

            async def append() -> pb.AppendResponse:
                start = await self._coord.append(
                    tenant, _seq_id(head.seq_id), layer, list(head.token_ids), key, value
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
    ) -> bytes:
        """One session call's encoded SessionResponse: its reply, or its error status.
        short_path: False to take an AppendAttendBatch the full way (`session_call_now`
        after the worker refused its values); held: the request id's ledger record that
        `session_call_now` began (key, entry), to finish instead of a new one."""
        t0 = time.perf_counter()
        kind = request.WhichOneof("call")
        name = _SESSION_CALLS.get(kind, ("Session", 0))[0]
        try:
            if kind not in _SESSION_CALLS:
                raise InvalidRequest(
                    "the SessionRequest carries no call: set append_attend_batch or attend_batch"
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
            else:
                reply = await getattr(self, f"_{kind}")(getattr(request, kind), tenant)
        except Exception as exc:
            return self._session_error(request, name, tenant, exc, t0)
        self._observe_session_call(name, "OK", t0)
        return session_message(request.call_id, _SESSION_CALLS[kind][1], reply)

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
            exported = await self._coord.export(tenant, _seq_id(request.seq_id))
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

    async def ImportBlocks(
        self,
        request_iterator: AsyncIterator[pb.ImportBlocksRequest],
        context: grpc.aio.ServicerContext,
    ) -> pb.ImportBlocksResponse:
        t0 = time.perf_counter()
        tenant = _tenant()
        try:
            header, blocks = await _read_import(request_iterator, self._coord.layout)
            imported = await self._coord.import_(tenant, list(header.token_ids), blocks)
        except Exception as exc:
            await _abort(context, "ImportBlocks", tenant, exc, t0)
        log.debug("rpc ok", extra=_fields("ImportBlocks", tenant, "OK", t0))
        return pb.ImportBlocksResponse(
            seq_id=imported.seq_id,
            num_cached_tokens=imported.num_cached_tokens,
            num_tokens=imported.num_tokens,
        )


# ------------------------------------------------------------------------------ decoding


def _seq_id(seq_id: str, field: str = "seq_id") -> str:
    if not seq_id:
        raise InvalidRequest(f"{field} is empty")
    return seq_id


def _nonempty_ids(token_ids: Any) -> list[int]:
    ids = list(token_ids)
    if not ids:
        raise InvalidRequest("token_ids is empty")
    return ids


def _spec_size(spec: pb.TensorSpec, field: str) -> tuple[torch.dtype, list[int], int]:
    dtype = dtype_from_proto(spec.dtype, f"{field}.dtype")
    dims = list(spec.shape)
    check_shape(dims, field)
    return dtype, dims, math.prod(dims) * torch.empty((), dtype=dtype).element_size()


async def _read_append(
    stream: AsyncIterator[pb.AppendRequest],
) -> tuple[pb.AppendRequest, torch.Tensor, torch.Tensor]:
    """Assemble an Append stream: (first message, key, value)."""
    head: pb.AppendRequest | None = None
    key_buf, value_buf = bytearray(), bytearray()
    k_size = v_size = 0
    async for msg in stream:
        if head is None:
            head = msg
            if not msg.HasField("key") or not msg.HasField("value"):
                raise InvalidRequest("the first Append message must carry the key and value specs")
            k_dtype, k_dims, k_size = _spec_size(msg.key, "key")
            v_dtype, v_dims, v_size = _spec_size(msg.value, "value")
        elif (
            msg.seq_id
            or msg.token_ids
            or msg.HasField("key")
            or msg.HasField("value")
            or msg.HasField("layer")
        ):
            raise InvalidRequest("only the first Append message may carry header fields")
        key_buf += msg.key_data
        value_buf += msg.value_data
        if len(key_buf) > k_size or len(value_buf) > v_size:
            raise TensorCodecError(
                f"the stream carries more bytes than the key / value shapes need "
                f"({k_size} / {v_size} bytes)"
            )
    if head is None:
        raise InvalidRequest("empty Append stream: send at least the header message")
    key = tensor_from_bytes(key_buf, k_dtype, k_dims, "key")
    value = tensor_from_bytes(value_buf, v_dtype, v_dims, "value")
    return head, key, value


async def _read_import(
    stream: AsyncIterator[pb.ImportBlocksRequest], layout: KVLayout
) -> tuple[pb.ExportHeader, torch.Tensor]:
    """Assemble an ImportBlocks stream and check its header against the layout."""
    header: pb.ExportHeader | None = None
    buf = bytearray()
    total = 0
    async for msg in stream:
        if header is None:
            if not msg.HasField("header"):
                raise InvalidRequest("the first ImportBlocks message must carry the header")
            header = msg.header
            total = _check_import_header(header, layout)
        elif msg.HasField("header"):
            raise InvalidRequest("only the first ImportBlocks message may carry the header")
        buf += msg.data
        if len(buf) > total:
            raise TensorCodecError(f"the stream carries more than the header's {total} bytes")
    if header is None:
        raise InvalidRequest("empty ImportBlocks stream: send at least the header message")
    dtype = dtype_from_name(layout.dtype)
    return header, tensor_from_bytes(buf, dtype, list(header.block_shape), "data")


def _check_import_header(header: pb.ExportHeader, layout: KVLayout) -> int:
    ours = layout.fingerprint()
    if header.layout.fingerprint != ours:
        raise InvalidRequest(
            f"the export has layout fingerprint {header.layout.fingerprint!r}, this service "
            f"{ours!r} ({layout}); blocks only move between services of one layout"
        )
    n = header.num_tokens
    if len(header.token_ids) != n:
        raise InvalidRequest(f"header has {len(header.token_ids)} token ids but num_tokens={n}")
    want = [
        -(-n // layout.block_size),
        layout.num_layers,
        2,
        layout.num_kv_heads,
        layout.block_size,
        layout.head_dim,
    ]
    if list(header.block_shape) != want:
        raise InvalidRequest(f"header.block_shape is {list(header.block_shape)}, expected {want}")
    total = math.prod(want) * layout.element_size
    if header.total_bytes != total:
        raise InvalidRequest(f"header.total_bytes is {header.total_bytes}, expected {total}")
    return total


# ------------------------------------------------------------------------------ logging

_STD_ATTRS = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


def _extra_fields(record: logging.LogRecord) -> dict[str, Any]:
    # Private attributes come from other libraries' record factories (Ray adds one).
    return {
        k: v for k, v in record.__dict__.items() if k not in _STD_ATTRS and not k.startswith("_")
    }


class _JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg and the record's extra fields."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        doc.update(_extra_fields(record))
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


class _TextFormatter(logging.Formatter):
    """`time level logger message key=value ...` (the extra fields at the end)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extra = " ".join(f"{k}={v}" for k, v in _extra_fields(record).items())
        return f"{line} {extra}" if extra else line


def configure_logging(level: str = "INFO", fmt: str = "text") -> None:
    """Route the service's loggers ("kvcache.*") to stderr in `fmt` ("text" | "json")."""
    handler = logging.StreamHandler()
    handler.setFormatter(_JsonFormatter() if fmt == "json" else _TextFormatter())
    root = logging.getLogger("kvcache")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False


# ------------------------------------------------------------------------------ assembly


@dataclass
class RunningService:
    """A started service. `address` is "host:port" with the bound port; `shared_regions`
    the shared-memory regions of same-host clients (deleted at `stop`)."""

    config: ServiceConfig
    coordinator: Coordinator
    server: grpc.aio.Server
    port: int
    metrics: Any
    metrics_http: Any = None
    shared_regions: SharedRegions | None = None
    local_sessions: LocalSessions | None = None
    _servicer: KVCacheServicer | None = None
    _health: Any = None
    _cleanups: list[Callable[[], Any]] = field(default_factory=list)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _stopped: bool = False
    _froze: bool = False

    @property
    def address(self) -> str:
        host = self.config.server.host
        if host in ("0.0.0.0", "::", "[::]"):
            host = "127.0.0.1"
        return f"{host}:{self.port}"

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain and stop: NOT_SERVING, refuse new calls, wait up to grace_s for calls in
        flight, then stop background work, the metrics endpoint and the workers we started,
        and delete the shared-memory regions."""
        if self._stopped:
            return
        self._stopped = True
        grace = self.config.server.shutdown_grace_s if grace_s is None else grace_s
        log.info("shutting down", extra={"grace_s": grace})
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        if self._servicer is not None:
            self._servicer.end_sessions()
        if self.local_sessions is not None:
            await asyncio.gather(self.server.stop(grace), self.local_sessions.close(grace))
        else:
            await self.server.stop(grace)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.coordinator.close()
        if self._froze:
            _release_freeze()
        if self.metrics_http is not None:
            self.metrics_http.stop()
        for cleanup in self._cleanups:
            try:
                result = cleanup()
                if asyncio.iscoroutine(result):
                    await result
            except Exception:  # keep stopping the rest
                log.exception("cleanup failed")
        log.info("stopped")

    async def wait(self) -> None:
        """Until the server terminates."""
        await self.server.wait_for_termination()


def _pool_config(config: ServiceConfig, layout: KVLayout) -> Any:
    from workers.config import PoolConfig

    return PoolConfig(
        layout=layout,
        num_blocks=config.workers.blocks_per_worker,
        # Slot fingerprints exist for the online correctness check only.
        fingerprints=config.coordinator.correctness_check_fraction > 0,
        cuda_graphs=config.workers.cuda_graphs,
        warm_up_query_heads=config.workers.warm_up_query_heads,
        warm_up_max_batch=config.coordinator.max_batch_items,
    )


async def _start_workers(
    config: ServiceConfig, layout: KVLayout
) -> tuple[list[Any], list[Callable[[], Any]]]:
    """Worker clients per config, and the cleanups that stop what was started."""
    wc = config.workers
    if wc.in_process:
        from cache_service.engine.worker_clients import LocalWorkerClient

        device = "cuda" if wc.device == "cuda" else "cpu"
        # GPU pools answer per-layer calls on the event loop (see LocalWorkerClient.inline);
        # CPU pools compute attention on the host, which would stall the loop.
        clients = [
            LocalWorkerClient(
                f"{wc.name_prefix}{i}",
                _pool_config(config, layout),
                device,
                inline=device == "cuda",
            )
            for i in range(wc.num_workers)
        ]
        return clients, [c.close for c in clients]

    import ray

    from cache_service.engine.worker_clients import RayWorkerClient
    from cache_service.wire.worker_channel import ChannelOptions
    from workers import launcher

    launch = launcher.LaunchConfig(
        pool=_pool_config(config, layout),
        num_workers=wc.num_workers,
        ray_address=wc.ray_address,
        namespace=wc.namespace,
        name_prefix=wc.name_prefix,
        use_gpu=wc.device == "cuda",
        local_num_cpus=wc.ray_num_cpus,
        max_restarts=wc.max_restarts,
    )
    embedded = wc.ray_address is None
    started_ray = not ray.is_initialized()
    # Blocks the event loop while Ray starts: nothing is served yet, and ray.init wants the
    # main thread (it installs signal handlers there).
    handles = _launch_or_attach(launch, embedded)
    channel = None
    if wc.channel_arena_bytes:
        channel = ChannelOptions(
            arena_bytes=wc.channel_arena_bytes,
            connections=wc.channel_connections,
            remote=wc.channel_remote,
        )
    clients = [
        RayWorkerClient(
            launcher.worker_name(wc.name_prefix, i),
            h,
            call_timeout_s=config.coordinator.worker_timeout_s,
            channel=channel,
        )
        for i, h in enumerate(handles)
    ]
    cleanups: list[Callable[[], Any]] = [c.close for c in clients]
    if embedded:
        cleanups.append(lambda: launcher.shutdown_workers(wc.namespace, wc.name_prefix))
        if started_ray:
            cleanups.append(ray.shutdown)
    return clients, cleanups


def _launch_or_attach(launch: Any, embedded: bool) -> list[Any]:
    from workers import launcher
    from workers.errors import WorkersAlreadyExist

    try:
        return launcher.launch_workers(launch)
    except WorkersAlreadyExist:
        if embedded:
            raise
        # A cluster's detached workers outlive a coordinator: a restarted one attaches.
        log.info("attaching to running workers", extra={"prefix": launch.name_prefix})
        return launcher.attach_workers(launch.namespace, launch.name_prefix)


# Services of this process that froze the collector's objects (server.gc_freeze): the
# first freezes, the last to stop unfreezes (several may run at once in one process).
_freezes = 0


def _hold_freeze() -> None:
    """Collect, then freeze what is left (`gc.freeze`): from here on full collections walk
    only the objects made since. Garbage is collected first, so nothing dead is frozen."""
    global _freezes
    if _freezes == 0:
        gc.collect()
        gc.freeze()
    _freezes += 1


def _release_freeze() -> None:
    """One freezing service stopped; the last one hands the frozen objects back to the
    collector (garbage among them is collected as usual from then on)."""
    global _freezes
    _freezes -= 1
    if _freezes == 0:
        gc.unfreeze()


def _local_session_auth(auth: AuthInterceptor | None) -> Authenticate:
    """How a local session's hello is authenticated: as a gRPC Session stream with that
    authorization metadata would be (without authentication, everyone is accepted)."""
    if auth is None:
        return lambda authorization: (None, grpc.StatusCode.OK, "")
    method = f"/{SERVICE_NAME}/Session"

    def decide(authorization: str) -> tuple[Any, grpc.StatusCode, str]:
        metadata = (("authorization", authorization),) if authorization else ()
        return auth.decide(method, metadata)

    return decide


async def _probe_workers(coordinator: Coordinator, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            await coordinator.check_workers()
        except Exception:
            log.exception("worker probe failed")


def server_torch_threads(config: ServiceConfig) -> int | None:
    """The intra-op thread count the server process should use (None: torch's default);
    see ``ServerConfig.torch_threads``."""
    if config.server.torch_threads is not None:
        return config.server.torch_threads
    if config.workers.in_process and config.workers.device == "cpu":
        return None
    return 1


async def start_service(
    config: ServiceConfig,
    *,
    workers: list[Any] | None = None,
    metrics: Any = None,
) -> RunningService:
    """Start workers (unless given), the coordinator, the gRPC server and metrics.

    Args:
        config: the service configuration (port 0 binds a free port: see `.port`).
        workers: WorkerClients to use instead of starting workers (their owner stops them).
        metrics: a ServiceMetrics to use (default: a new one on a private registry).

    Raises:
        ConfigError / AuthConfigError / TLSConfigError: bad settings; WorkerLaunchError:
        workers could not start; RuntimeError: the port could not be bound.
    """
    from cache_service.obs.metrics import ServiceMetrics

    threads = server_torch_threads(config)
    if threads is not None:
        torch.set_num_threads(threads)
    layout = config.layout.kv_layout()
    table = load_token_table(config.auth_file) if config.auth_file else None
    tls = None
    if config.tls is not None:
        tls = server_credentials(
            ServerTLSConfig(config.tls.cert_file, config.tls.key_file, config.tls.client_ca_file)
        )
    cleanups: list[Callable[[], Any]] = []
    if metrics is None:
        metrics = ServiceMetrics(bytes_per_block=layout.bytes_per_block)
    if workers is None:
        workers, cleanups = await _start_workers(config, layout)
    for w in workers:
        observe = getattr(w, "observe_data_calls", None)
        if observe is not None:  # the service's worker clients (a test's fakes may lack it)
            observe(metrics.add_worker_data_call)
    try:
        # The write-ahead metadata store; a second coordinator on the same file fails here.
        store = MetadataStore(StoreConfig(config.store_path)) if config.store_path else None
        if store is not None:
            cleanups.insert(0, store.close)
        coordinator = Coordinator(layout, workers, config.coordinator, metrics, store=store)
        await coordinator.start()
        if table is not None:  # the token file's per-tenant quotas, enforced by the control plane
            policies = {t: table.policy(t) for t in table.tenants()}
            coordinator.set_tenant_quotas(
                {t: TenantQuota(p.max_blocks, p.max_sequences) for t, p in policies.items()}
            )
        metrics.bind_stats(coordinator.stats, loop=asyncio.get_running_loop())
        # The coordinator's work all runs on this thread: its CPU time is the service's load.
        metrics.bind_event_loop_thread()
        cleanups.append(metrics.unbind_event_loop_thread)

        interceptors: list[grpc.aio.ServerInterceptor] = [metrics.rpc_interceptor()]
        auth = AuthInterceptor(table, METHOD_PERMISSIONS) if table is not None else None
        if auth is not None:
            interceptors.append(auth)
        if config.server.max_in_flight_per_client > 0:  # after auth: counts know the tenant
            limiter = InFlightLimiter(config.server.max_in_flight_per_client)
            interceptors.append(InFlightLimitInterceptor(limiter, f"/{SERVICE_NAME}/"))
        # Innermost: requests that do not parse become INVALID_ARGUMENT, not UNKNOWN.
        interceptors.append(RequestDecodeInterceptor(f"/{SERVICE_NAME}/"))
        limit = config.server.max_message_bytes
        server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.max_send_message_length", limit),
                ("grpc.max_receive_message_length", limit),
                # Refuse a port another process already serves instead of sharing it.
                ("grpc.so_reuseport", 0),
            ],
        )
        # Every region's file is deleted at stop (or if the start fails from here on).
        # Pools on CUDA in this process copy request tensors straight out of pinned regions;
        # worker channels copy them into their arenas: both read regions in place.
        pin = config.workers.in_process and config.workers.device == "cuda"
        channels = not config.workers.in_process and config.workers.channel_arena_bytes > 0
        regions = SharedRegions(
            config.shared_memory,
            on_change=metrics.set_shared_memory,
            pin_for_cuda=pin,
            zero_copy=pin or channels,
            share_with_workers=channels,
        )
        cleanups.append(regions.close)
        # What a coordinator killed on this host left (it never ran its own cleanups).
        regions.remove_orphans()
        remove_orphan_arenas()
        servicer = KVCacheServicer(
            coordinator,
            limit,
            config.server.stream_chunk_bytes,
            shared_regions=regions,
            metrics=metrics,
        )
        pb_grpc.add_KVCacheServicer_to_server(servicer, server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        address = f"{config.server.host}:{config.server.port}"
        port = (
            server.add_secure_port(address, tls)
            if tls is not None
            else server.add_insecure_port(address)
        )
        if port == 0:
            raise RuntimeError(f"could not bind {address} (in use, or not a local address)")
        await server.start()
        local = None
        if config.server.local_sessions and tls is None:
            local = LocalSessions(
                servicer._session_call,
                _local_session_auth(auth),
                DEFAULT_TENANT,
                limit,
                on_change=metrics.set_local_sessions,
                serve_now=(
                    servicer.session_call_now if config.server.local_session_callbacks else None
                ),
            )
            try:
                servicer.local_session_socket = await local.start(config.server.local_session_dir)
                cleanups.insert(0, functools.partial(local.close, 0.0))
            except (OSError, ValueError) as exc:
                if config.server.local_session_dir is not None:
                    raise  # a directory asked for by name must work
                # An optimization for same-host clients: serve without it rather than not.
                log.warning("local sessions off: %s", exc)
                local = None
        serving = health_pb2.HealthCheckResponse.SERVING
        await health_servicer.set("", serving)
        await health_servicer.set(SERVICE_NAME, serving)
        metrics_http = None
        if config.metrics.enabled:
            try:
                metrics_http = metrics.start_http_server(config.metrics.host, config.metrics.port)
            except BaseException:
                await server.stop(0)
                raise
    except BaseException:
        for cleanup in cleanups:
            with contextlib.suppress(Exception):
                result = cleanup()
                if asyncio.iscoroutine(result):
                    await result
        raise
    running = RunningService(
        config=config,
        coordinator=coordinator,
        server=server,
        port=port,
        metrics=metrics,
        metrics_http=metrics_http,
        shared_regions=regions,
        local_sessions=local,
        _servicer=servicer,
        _health=health_servicer,
        _cleanups=cleanups,
    )
    if config.metrics.event_loop_lag_interval_s > 0:
        running._tasks.append(
            asyncio.get_running_loop().create_task(
                probe_loop_lag(
                    metrics.observe_event_loop_lag, config.metrics.event_loop_lag_interval_s
                )
            )
        )
    if config.coordinator.health_check_interval_s > 0:
        running._tasks.append(
            asyncio.get_running_loop().create_task(
                _probe_workers(coordinator, config.coordinator.health_check_interval_s)
            )
        )
    if regions.enabled:
        running._tasks.append(asyncio.get_running_loop().create_task(regions.reap_forever()))
    if config.server.gc_freeze:
        _hold_freeze()
        running._froze = True
    loop_kind = loop_name()
    if config.server.event_loop == "uvloop" and loop_kind != "uvloop":
        # start_service runs on its caller's loop; event_loop.run makes the configured one.
        log.warning(
            "server.event_loop is 'uvloop' but the service was started on asyncio's loop "
            "(run it with cache_service.event_loop.run)"
        )
    log.info(
        "serving",
        extra={
            "address": running.address,
            "event_loop": loop_kind,
            "workers": len(workers),
            "layout": layout.fingerprint(),
            "tls": tls is not None,
            "auth": table is not None,
            "metrics": running.metrics_http.url if running.metrics_http else None,
            "shared_memory": regions.directory if regions.enabled else None,
            "local_sessions": local.path if local is not None else None,
        },
    )
    return running
