"""Session messages (the `Session` stream) around calls encoded elsewhere.

A session request or reply is a call id plus one call's request or reply, which the client
(`request_codec`) and the servicer (`result_codec`, `shared_outputs`) already encode as
bytes. Wrapping them costs a field header each; parsing stays with protobuf (the servicer
decodes a `SessionRequest`, the client a `SessionResponse`).
"""

from __future__ import annotations

import grpc

from cache_service._proto.kvcache.v1 import kvcache_pb2 as pb
from cache_service.wire.format import delimited, varint

__all__ = [
    "APPEND_ATTEND_BATCH",
    "ATTEND_BATCH",
    "STEP_LEASE",
    "session_error",
    "session_message",
    "status_from_number",
]

# Field numbers of the calls in SessionRequest.call and SessionResponse.result.
APPEND_ATTEND_BATCH = 2
ATTEND_BATCH = 3
STEP_LEASE = 5
_ERROR_TAG = b"\x22"  # SessionResponse.error = 4, length-delimited
_CALL_ID_TAG = b"\x08"  # call_id = 1, varint
_TAGS = {APPEND_ATTEND_BATCH: b"\x12", ATTEND_BATCH: b"\x1a", STEP_LEASE: b"\x2a"}


_STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def status_from_number(code: int) -> grpc.StatusCode:
    """The gRPC status whose number is `code` (a `CallError.code`); UNKNOWN for a number
    gRPC does not define."""
    return _STATUS_BY_NUMBER.get(code, grpc.StatusCode.UNKNOWN)


def session_message(call_id: int, field: int, inner: bytes) -> bytes:
    """A `SessionRequest` (client) or `SessionResponse` (server) carrying the encoded call
    request or reply `inner` under `field` (APPEND_ATTEND_BATCH, ATTEND_BATCH or STEP_LEASE).

    Raises:
        ValueError: an unknown field or a negative call id.
    """
    tag = _TAGS.get(field)
    if tag is None:
        raise ValueError(f"no session call has field number {field!r}")
    if call_id < 0:
        raise ValueError(f"call_id must be >= 0, got {call_id}")
    return b"".join((_CALL_ID_TAG, varint(call_id), delimited(tag, len(inner)), inner))


def session_error(call_id: int, code: grpc.StatusCode, message: str) -> bytes:
    """A `SessionResponse` answering call `call_id` with the status `code` and `message`."""
    error = pb.CallError(code=code.value[0], message=message).SerializeToString()
    return b"".join((_CALL_ID_TAG, varint(call_id), delimited(_ERROR_TAG, len(error)), error))
