"""Attention replies (`AttendResponse`, `AppendAttendResponse`) encoded in one pass.

Both replies are ``repeated AttendResult results = 1`` with ``AttendResult { Tensor output =
1; Tensor lse = 2; }``. Filling them through the protobuf API costs several Python calls per
item (add the result, set the dtype, extend the shape, copy the data in): for a decode batch
of 32 sequences that is most of the reply's cost. Yet the items of one call usually share
dtype and shape, so their encodings differ only in the payload bytes. This module writes
the wire format directly - a header per (dtype, shape), computed once, then header and
payload per item - and lets protobuf parse the bytes into the reply, a C pass at memcpy
speed. The message is the one the API would build (tests compare them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch
from google.protobuf.message import Message

from cache_service.tensor_codec import dtype_to_proto, tensor_payloads
from cache_service.worker_interface import AttentionResult

__all__ = ["results_reply"]

_M = TypeVar("_M", bound=Message)

# Wire tags: field number << 3 | 2 (length-delimited); 1 << 3 | 0 for the dtype varint.
_RESULTS = b"\x0a"  # Response.results = 1 / AttendResult.output = 1
_LSE = b"\x12"  # AttendResult.lse = 2 / Tensor.shape = 2 (packed)
_DTYPE = b"\x08"  # Tensor.dtype = 1
_DATA = b"\x1a"  # Tensor.data = 3

# (dtype enum, shape) -> the Tensor message's bytes before its payload. Few distinct keys
# occur (one per dtype and rows-per-item); the bound only guards against odd callers.
_HEADS: dict[tuple[int, tuple[int, ...]], bytes] = {}
_MAX_HEADS = 256


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _delimited(tag: bytes, length: int) -> bytes:
    return tag + _varint(length)


def _tensor_head(t: torch.Tensor) -> bytes:
    """The `Tensor` message of `t` up to its payload: dtype, packed shape, data's tag and
    length (what `tensor_to_proto` would serialize, the payload excepted)."""
    enum = dtype_to_proto(t.dtype)  # refuses dtypes that cannot travel
    shape = tuple(t.shape)
    head = _HEADS.get((enum, shape))
    if head is None:
        dims = b"".join(_varint(d) for d in shape)
        head = _DTYPE + _varint(enum)
        if dims:
            head += _delimited(_LSE, len(dims)) + dims
        head += _delimited(_DATA, t.numel() * t.element_size())
        if len(_HEADS) >= _MAX_HEADS:
            _HEADS.clear()
        _HEADS[(enum, shape)] = head
    return head


def _frame(out: torch.Tensor, lse: torch.Tensor | None) -> tuple[bytes, bytes]:
    """An item's bytes before its output payload, and between that and its lse payload
    (empty without lse): they depend only on the two tensors' dtypes and shapes."""
    out_head = _tensor_head(out)
    out_len = len(out_head) + out.numel() * out.element_size()
    result_len = len(_delimited(_RESULTS, out_len)) + out_len
    middle = b""
    if lse is not None:
        lse_head = _tensor_head(lse)
        lse_bytes = lse.numel() * lse.element_size()
        middle = _delimited(_LSE, len(lse_head) + lse_bytes) + lse_head
        result_len += len(middle) + lse_bytes
    before = _delimited(_RESULTS, result_len) + _delimited(_RESULTS, out_len) + out_head
    return before, middle


def _uniform(tensors: list[torch.Tensor]) -> bool:
    """One dtype and one shape for all (C-level comparisons)."""
    shapes = [t.shape for t in tensors]
    dtypes = [t.dtype for t in tensors]
    n = len(tensors)
    return shapes.count(shapes[0]) == n and dtypes.count(dtypes[0]) == n


def results_reply(cls: type[_M], results: Sequence[AttentionResult], with_lse: bool) -> _M:
    """A `cls` message (AttendResponse or AppendAttendResponse) holding one AttendResult
    per result: its output, and its lse when `with_lse`.

    Raises:
        TensorCodecError: a tensor's dtype cannot travel.
        TypeError: `with_lse` and a result has no lse.
    """
    if not results:
        return cls()
    outs = [r.out for r in results]
    lses: list[torch.Tensor] = []
    if with_lse:
        for r in results:
            if r.lse is None:
                raise TypeError("a result has no lse but the reply asks for it")
            lses.append(r.lse)
    parts: list[bytes | memoryview] = []
    if _uniform(outs) and (not with_lse or _uniform(lses)):
        # The usual reply: every item framed alike, payloads cut at fixed offsets.
        before, middle = _frame(outs[0], lses[0] if with_lse else None)
        out_data = tensor_payloads(outs, uniform=True)
        if with_lse:
            for o, lse in zip(out_data, tensor_payloads(lses, uniform=True), strict=True):
                parts += (before, o, middle, lse)
        else:
            for o in out_data:
                parts += (before, o)
        return cls.FromString(b"".join(parts))
    out_data = tensor_payloads(outs)
    lse_data = tensor_payloads(lses) if with_lse else []
    for i, t in enumerate(outs):
        before, middle = _frame(t, lses[i] if with_lse else None)
        parts += (before, out_data[i])
        if with_lse:
            parts += (middle, lse_data[i])
    return cls.FromString(b"".join(parts))
