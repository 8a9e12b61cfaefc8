"""Attention replies (`AttendResponse`, `AppendAttendResponse`) encoded in one pass.

Both replies are ``repeated AttendResult results = 1`` with ``AttendResult { Tensor output =
1; Tensor lse = 2; }``. Filling them through the protobuf API costs several Python calls per
item (add the result, set the dtype, extend the shape, copy the data in): for a decode batch
of 32 sequences that is most of the reply's cost. Yet the items of one call usually share
dtype and shape, so their encodings differ only in the payload bytes. This module writes
the wire format directly - a header per (dtype, shape), computed once, then header and
payload per item - and the servicer hands the bytes to gRPC as they are (the decode
interceptor lets encoded replies through). The message is the one the API would build
(tests compare them).

The batch replies (`AppendAttendBatchResponse`, `AttendBatchResponse`: ``Tensor output = 1;
Tensor lse = 2;``) hold the whole batch as one tensor per field: `encode_batch_result`;
a field the servicer wrote into the client's shared-memory region carries that slice
instead of the bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cache_service.engine.worker_interface import AttentionResult
from cache_service.wire.format import delimited, shared_tensor_field, tensor_field, tensor_head
from cache_service.wire.tensor_codec import tensor_payloads

__all__ = ["encode_batch_result", "encode_results"]

# Wire tags: field number << 3 | 2 (length-delimited).
_RESULTS = b"\x0a"  # Response.results = 1 / AttendResult.output = 1 / batch output = 1
_LSE = b"\x12"  # AttendResult.lse = 2 / batch lse = 2


def _frame(out: torch.Tensor, lse: torch.Tensor | None) -> tuple[bytes, bytes]:
    """An item's bytes before its output payload, and between that and its lse payload
    (empty without lse): they depend only on the two tensors' dtypes and shapes."""
    out_head = tensor_head(out)
    out_len = len(out_head) + out.numel() * out.element_size()
    result_len = len(delimited(_RESULTS, out_len)) + out_len
    middle = b""
    if lse is not None:
        lse_head = tensor_head(lse)
        lse_bytes = lse.numel() * lse.element_size()
        middle = delimited(_LSE, len(lse_head) + lse_bytes) + lse_head
        result_len += len(middle) + lse_bytes
    before = delimited(_RESULTS, result_len) + delimited(_RESULTS, out_len) + out_head
    return before, middle


def _uniform(tensors: list[torch.Tensor]) -> bool:
    """One dtype and one shape for all (C-level comparisons)."""
    shapes = [t.shape for t in tensors]
    dtypes = [t.dtype for t in tensors]
    n = len(tensors)
    return shapes.count(shapes[0]) == n and dtypes.count(dtypes[0]) == n


def encode_results(results: Sequence[AttentionResult], with_lse: bool) -> bytes:
    """The serialized AttendResponse / AppendAttendResponse (the two are alike on the wire)
    holding one AttendResult per result: its output, and its lse when `with_lse`.

    Raises:
        TensorCodecError: a tensor's dtype cannot travel.
        TypeError: `with_lse` and a result has no lse.
    """
    if not results:
        return b""
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
        return b"".join(parts)
    out_data = tensor_payloads(outs)
    lse_data = tensor_payloads(lses) if with_lse else []
    for i, t in enumerate(outs):
        before, middle = _frame(t, lses[i] if with_lse else None)
        parts += (before, out_data[i])
        if with_lse:
            parts += (middle, lse_data[i])
    return b"".join(parts)


def encode_batch_result(
    out: torch.Tensor,
    lse: torch.Tensor | None,
    *,
    out_to: tuple[str, int] | None = None,
    lse_to: tuple[str, int] | None = None,
) -> bytes:
    """The serialized AppendAttendBatchResponse / AttendBatchResponse (alike on the wire):
    output `out` ``[batch, m, num_q_heads, head_dim]`` and, when given, lse float32
    ``[batch, m, num_q_heads]``; payloads are views of the tensors' memory.

    out_to / lse_to: (region id, byte offset) where that tensor was written in a shared
    region; its field then carries the slice (with dtype and shape), not the bytes.

    Raises:
        TensorCodecError: a tensor's dtype cannot travel.
    """
    parts: list[bytes | memoryview]
    if out_to is None:
        parts = [*tensor_field(_RESULTS, out)]
    else:
        parts = [shared_tensor_field(_RESULTS, out.dtype, out.shape, *out_to)]
    if lse is not None:
        if lse_to is None:
            parts += tensor_field(_LSE, lse)
        else:
            parts.append(shared_tensor_field(_LSE, lse.dtype, lse.shape, *lse_to))
    return b"".join(parts)
