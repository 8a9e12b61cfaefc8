"""How the batch calls (`append_attend_batch`, `attend_batch`) travel: as messages of the
session stream (gRPC, or the server's local socket when it offers one) or as unary RPCs,
with their tensors in a shared-memory region of the server or as bytes.

A mixin of `KVCacheClient` (its state lives on the client, set by `_init_batch_path`).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grpc
import torch

from cache_service._proto.kvcache.v1 import kvcache_pb2 as pb
from cache_service.client.arguments import micros
from cache_service.client.call_policy import CallPolicy
from cache_service.client.call_stream import CallStream, StreamBroken
from cache_service.client.errors import NotFoundError, UnavailableError, error_for
from cache_service.client.local_session_stream import (
    LocalSessionStream,
    LocalSessionUnavailable,
    LocalSessionUnreachable,
    PendingReply,
)
from cache_service.client.replies import batch_results, session_result
from cache_service.client.shared_memory import SharedMemoryPath, Staged
from cache_service.client.transport import session_stream
from cache_service.wire.request_codec import call_fields
from cache_service.wire.session_codec import STEP_LEASE, session_message

__all__ = ["BatchPath", "PendingLease"]


class BatchPath(CallPolicy):
    """The batch calls' transports: session stream or unary, shared memory or bytes."""

    _channel: grpc.Channel
    _stub: Any

    def _init_batch_path(
        self,
        session: bool,
        local_session: bool | str,
        shared_memory: bool | str,
        max_message_bytes: int,
    ) -> None:
        """Set up the session stream (opened on its first call), the local session's
        choice and the shared-memory path; see `KVCacheClient`'s arguments."""
        self._session = session_stream(self._channel, self._metadata) if session else None
        self._call_ids = itertools.count(1)
        # The local session: mode, whether it was decided (resolved and connected, or
        # found unusable), and the stream when in use.
        self._local_mode: bool | str = local_session if session else False
        self._local_decided = not self._local_mode
        self._local: LocalSessionStream | None = None
        self._local_lock = threading.Lock()
        self._max_message = max_message_bytes
        self._shm = (
            SharedMemoryPath(
                self._create_region, self._release_region, required=shared_memory is True
            )
            if shared_memory
            else None
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
            body = request + call_fields(rid, micros(budget)) if mutating else request
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
                    error = error_for(exc.code, exc.details)
                    if not (retry and isinstance(error, UnavailableError)):
                        raise error from None
                    raw = None  # a safe call: the unary path retries it with backoff
            if raw is not None:
                return session_result(raw, call_id, field)
        if mutating:
            return self._mutate(
                method,
                lambda rid, us: request + call_fields(rid, us),
                timeout_s=timeout_s,
                request_id=rid,
            )
        return self._call(method, request, timeout_s=timeout_s, retry=retry)

    def lease_step(
        self,
        seq_ids: Sequence[str],
        num_q_heads: int,
        token_ids: Sequence[Sequence[int]] | None = None,
        *,
        lease_connections: Mapping[str, bytes] | None = None,
        steps: int = 1,
        timeout_s: float | None = None,
    ) -> pb.StepLeaseResponse | None:
        """A step lease: the client may then run the step's layers on the worker's pool
        itself (`workers.lease_client.LeaseClient`); see StepLeaseRequest in the proto.
        Only over a local session (a client on the server's host).

        Args:
            seq_ids: the batch's sequences.
            num_q_heads: query heads of the step's layers.
            token_ids: None: the step this batch's last `append_attend_batch` planned
                (its layers not written yet; `seq_ids` in that call's order). Else per
                sequence the step's new token ids (at least one each): the server plans
                that step and leases every layer of it.
            lease_connections: this process's lease connections, socket -> token
                (`LeaseClient.path` -> `LeaseClient.connection`): a lease on one of those
                workers is opened for the connection at the grant, and the answer's `plan`
                goes to `LeaseClient.open` (no OPEN round trip).
            steps: with `token_ids` of one token per sequence, the decode steps the
                lease is to cover (the answer's `steps` says how many it does: the later
                steps' positions are reserved, their tokens named by the lease's report,
                `LeaseClient.advance` / `LeaseClient.end`).

        Returns:
            The server's answer (`granted`, or the `reason` there is no lease); None when
            this client has no local session, or another thread's call holds it.

        Raises:
            KVCacheError: the server refused the request (INVALID_ARGUMENT for malformed
                arguments, UNAVAILABLE when the worker could not grant it).
        """
        pending = self.start_lease_step(
            seq_ids,
            num_q_heads,
            token_ids,
            lease_connections=lease_connections,
            steps=steps,
            timeout_s=timeout_s,
        )
        return None if pending is None else pending.result()

    def start_lease_step(
        self,
        seq_ids: Sequence[str],
        num_q_heads: int,
        token_ids: Sequence[Sequence[int]] | None = None,
        *,
        lease_connections: Mapping[str, bytes] | None = None,
        steps: int = 1,
        timeout_s: float | None = None,
    ) -> PendingLease | None:
        """`lease_step`, its request sent now and its answer read by
        `PendingLease.result` (which must be called): the caller's own work overlaps the
        server's planning. The local session is this call's until then.

        Returns:
            The request in flight; None as `lease_step` returns None.

        Raises:
            ValueError: `token_ids` not one row per sequence; KVCacheError: the request
                could not be sent.
        """
        if self._session is None:
            return None
        budget = self.timeout_s if timeout_s is None else float(timeout_s)
        if not self._local_decided:
            self._choose_local(budget)
        local = self._local
        if local is None:
            return None
        call_id = next(self._call_ids)
        flat: list[int] = []
        counts: list[int] = []
        if token_ids is not None:
            rows = [list(row) for row in token_ids]
            if len(rows) != len(seq_ids):
                raise ValueError(f"token_ids holds {len(rows)} rows for {len(seq_ids)} sequences")
            flat = [int(t) for row in rows for t in row]
            counts = [len(row) for row in rows]
        request = pb.StepLeaseRequest(
            seq_ids=list(seq_ids),
            num_q_heads=num_q_heads,
            token_ids=flat,
            num_tokens=counts,
            lease_connections=dict(lease_connections or {}),
            steps=steps,
        )
        message = session_message(call_id, STEP_LEASE, request.SerializeToString())
        try:
            pending = local.start(message, budget)
        except LocalSessionUnreachable:
            self._forget_local(local)
            return None
        except StreamBroken as exc:
            raise error_for(exc.code, exc.details) from None
        return None if pending is None else PendingLease(pending, call_id)

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
                    raise error_for(exc.code, exc.details) from None
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
        return batch_results(reply, return_lse)

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


class PendingLease:
    """A `start_lease_step` request in flight."""

    def __init__(self, pending: PendingReply, call_id: int) -> None:
        self._pending = pending
        self._call_id = call_id

    def result(self) -> pb.StepLeaseResponse:
        """The server's answer (see `lease_step`).

        Raises:
            KVCacheError: the server refused the request, or the session failed.
        """
        try:
            raw = self._pending.result()
        except StreamBroken as exc:
            raise error_for(exc.code, exc.details) from None
        return session_result(raw, self._call_id, STEP_LEASE)
