"""Replies decoded into what the client's calls return: a session call's result (or the
KVCacheError its status means), attention outputs (and lse) as tensors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from cache_service._proto.kvcache.v1 import kvcache_pb2 as pb
from cache_service.client.errors import InternalError, error_for
from cache_service.wire.session_codec import (
    APPEND_ATTEND_BATCH,
    ATTEND_BATCH,
    STEP_LEASE,
    status_from_number,
)
from cache_service.wire.tensor_codec import tensor_from_proto, tensors_from_protos

__all__ = ["attention_results", "batch_results", "session_result"]

# SessionResponse.result of each session call's reply.
_SESSION_REPLY = {
    APPEND_ATTEND_BATCH: "append_attend_batch",
    ATTEND_BATCH: "attend_batch",
    STEP_LEASE: "step_lease",
}


def session_result(raw: bytes, call_id: int, field: int) -> Any:
    """The reply message of a session call from its encoded SessionResponse; its error as
    the KVCacheError the unary call would have raised."""
    reply = pb.SessionResponse.FromString(raw)
    which = reply.WhichOneof("result")
    if which == "error":
        code = status_from_number(reply.error.code)
        raise error_for(code, reply.error.message or code.name)
    if reply.call_id != call_id or which != _SESSION_REPLY[field]:
        raise InternalError(
            grpc.StatusCode.INTERNAL,
            f"the session answered call {reply.call_id} with {which!r}; expected call "
            f"{call_id} with {_SESSION_REPLY[field]!r}",
        )
    return getattr(reply, which)


def batch_results(reply: Any, return_lse: bool) -> Any:
    """A batch reply's output ``[batch, m, Hq, D]`` (and lse), each one new tensor."""
    out = tensor_from_proto(reply.output, "output", ndim=4)
    if not return_lse:
        return out
    return out, tensor_from_proto(reply.lse, "lse", ndim=3)


def attention_results(results: Sequence[pb.AttendResult], return_lse: bool) -> list[Any]:
    """Each item's output ``[m, Hq, D]`` (or (output, lse ``[m, Hq]``) pairs)."""
    # Every output lands in one new buffer (one copy), each item's tensor a view of it.
    outs = tensors_from_protos([r.output for r in results], "results[{}].output")
    if not return_lse:
        return outs
    lses = tensors_from_protos([r.lse for r in results], "results[{}].lse")
    return list(zip(outs, lses, strict=True))
