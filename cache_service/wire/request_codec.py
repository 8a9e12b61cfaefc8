"""Attention requests (`AttendRequest`, `AppendAttendRequest`) encoded in one pass.

The client's per-layer call carries a batch of items - a sequence id, new token ids, and
key / value / query tensors - that mostly share dtypes and shapes. Through the protobuf
API each item costs a dozen Python calls (add it, set the id, extend the ids, then per
tensor the dtype, the shape, the data). Here the framing of every tensor comes from a
cache keyed by dtype and shape (`wire_format.tensor_head`), the payloads are views of the
items' memory (one host copy per field when the items are rows of one tensor), and the
request is one join. The bytes parse to the message the protobuf API would build (tests
compare them); the client sends them through a channel method without a serializer.

    AppendAttendRequest { uint32 layer = 1; repeated AppendAttendItem items = 2;
                          bool return_lse = 3; }
    AppendAttendItem    { string seq_id = 1; repeated int64 token_ids = 2 (packed);
                          Tensor key = 3; Tensor value = 4; Tensor query = 5; }
    AttendRequest       { uint32 layer = 1; repeated AttendItem items = 2;
                          bool return_lse = 3; }
    AttendItem          { string seq_id = 1; Tensor query = 2; }

The batch forms carry the batch as the first dimension of one tensor per field, so their
cost does not grow with per-item framing; a decode step's sequence ids, sent layer after
layer, are encoded once:

    AppendAttendBatchRequest { uint32 layer = 1; repeated string seq_ids = 2;
                               repeated int64 token_ids = 3 (packed); Tensor key = 4;
                               Tensor value = 5; Tensor query = 6; bool return_lse = 7;
                               SharedSlice output_to = 8; SharedSlice lse_to = 9; }
    AttendBatchRequest       { uint32 layer = 1; repeated string seq_ids = 2;
                               Tensor query = 3; bool return_lse = 4;
                               SharedSlice output_to = 5; SharedSlice lse_to = 6; }

A batch tensor may already lie in a shared-memory region (`SharedTensor`, the client's
same-host path): its field then carries the slice, not the bytes; `output_to` / `lse_to`
ask the server to write the reply's tensors into the region.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import torch

from cache_service.wire.format import (
    delimited,
    shared_slice,
    shared_tensor_field,
    tensor_field,
    tensor_head,
    varint,
)
from cache_service.wire.tensor_codec import row_payloads, tensor_payloads

__all__ = [
    "SharedTensor",
    "call_fields",
    "encode_append_attend",
    "encode_append_attend_batch",
    "encode_attend",
    "encode_attend_batch",
]

_LAYER = b"\x08"  # field 1, varint
_ITEMS = b"\x12"  # field 2, length-delimited
_RETURN_LSE = b"\x18\x01"  # field 3, varint 1
_SEQ_ID = b"\x0a"  # item field 1
_TOKEN_IDS = b"\x12"  # item field 2 (packed)
_KEY = b"\x1a"  # item field 3
_VALUE = b"\x22"  # item field 4
_QUERY_OF_APPEND = b"\x2a"  # AppendAttendItem.query = 5
_QUERY_OF_ATTEND = b"\x12"  # AttendItem.query = 2

# The batch requests' fields (see the module docstring).
_BATCH_SEQ_IDS = b"\x12"  # field 2, one per id
_BATCH_TOKEN_IDS = b"\x1a"  # AppendAttendBatchRequest.token_ids = 3 (packed)
_BATCH_KEY = b"\x22"  # = 4
_BATCH_VALUE = b"\x2a"  # = 5
_BATCH_QUERY_OF_APPEND = b"\x32"  # = 6
_BATCH_LSE_OF_APPEND = b"\x38\x01"  # return_lse = 7, true
_BATCH_OUTPUT_TO_OF_APPEND = b"\x42"  # output_to = 8
_BATCH_LSE_TO_OF_APPEND = b"\x4a"  # lse_to = 9
_BATCH_QUERY_OF_ATTEND = b"\x1a"  # AttendBatchRequest.query = 3
_BATCH_LSE_OF_ATTEND = b"\x20\x01"  # return_lse = 4, true
_BATCH_OUTPUT_TO_OF_ATTEND = b"\x2a"  # output_to = 5
_BATCH_LSE_TO_OF_ATTEND = b"\x32"  # lse_to = 6
# request_id = 20 (length-delimited) and timeout_us = 21 (varint) of the mutating requests.
_REQUEST_ID = b"\xa2\x01"
_TIMEOUT_US = b"\xa8\x01"

# Ids below 128 are one byte each: looked up, not computed.
_SMALL = [bytes([i]) for i in range(128)]


class SharedTensor(NamedTuple):
    """A tensor whose bytes the client wrote into a shared-memory region.

    Attributes:
        dtype: float16, bfloat16 or float32.
        shape: its sizes.
        region_id: the region (CreateSharedRegionResponse.region_id).
        offset: its first byte in the region (a multiple of the element size).
    """

    dtype: torch.dtype
    shape: tuple[int, ...]
    region_id: str
    offset: int


# (region id, byte offset) where the server is to write one of the reply's tensors.
SliceRef = tuple[str, int]


def _batch_tensor(tag: bytes, tensor: torch.Tensor | SharedTensor) -> Sequence[bytes | memoryview]:
    """A batch request's tensor field: the bytes, or the slice of a `SharedTensor`."""
    if isinstance(tensor, SharedTensor):
        return (
            shared_tensor_field(tag, tensor.dtype, tensor.shape, tensor.region_id, tensor.offset),
        )
    return tensor_field(tag, tensor)


def _slice_fields(
    tag_out: bytes, tag_lse: bytes, output_to: SliceRef | None, lse_to: SliceRef | None
) -> list[bytes]:
    parts = []
    for tag, ref in ((tag_out, output_to), (tag_lse, lse_to)):
        if ref is not None:
            msg = shared_slice(*ref)
            parts += (delimited(tag, len(msg)), msg)
    return parts


# A client sends the same sequence ids layer after layer, and one new token per sequence
# when it decodes: both fields are remembered rather than encoded again.
@functools.lru_cache(maxsize=65536)
def _seq_id_field(seq_id: str) -> bytes:
    raw = seq_id.encode("utf-8")
    return delimited(_SEQ_ID, len(raw)) + raw if raw else b""


@functools.lru_cache(maxsize=65536)
def _one_id_field(token_id: int) -> bytes:
    packed = varint(token_id)
    return delimited(_TOKEN_IDS, len(packed)) + packed


def _token_ids_field(token_ids: Sequence[int], item: int) -> bytes:
    if len(token_ids) == 1:
        t = token_ids[0]
        if type(t) is int and -(1 << 63) <= t < 1 << 63:
            return _one_id_field(t)
    if not token_ids:
        return b""
    packed = _packed_ids(token_ids, f"items[{item}].token_ids")
    return delimited(_TOKEN_IDS, len(packed)) + packed


def _packed_ids(token_ids: Sequence[int], field: str) -> bytes:
    """The varints of `token_ids`, back to back (a packed field's payload)."""
    parts = []
    for t in token_ids:
        if 0 <= t < 128:
            parts.append(_SMALL[t])
        elif -(1 << 63) <= t < 1 << 63:
            parts.append(varint(t))
        else:
            raise ValueError(f"{field} holds {t}, outside int64")
    return b"".join(parts)


@functools.lru_cache(maxsize=1024)
def _batch_seq_ids_field(seq_ids: tuple[str, ...]) -> bytes:
    """Every id as one ``seq_ids`` field: the same tuple comes back for every layer of a
    decode step, so it is encoded once per step, not once per layer."""
    parts = []
    for seq_id in seq_ids:
        raw = seq_id.encode("utf-8")
        parts.append(delimited(_BATCH_SEQ_IDS, len(raw)) + raw)
    return b"".join(parts)


_Field = tuple[bytes, bytes | memoryview, int]  # framing, payload, total size


def _tensor_fields(tag: bytes, tensors: Sequence[torch.Tensor] | torch.Tensor) -> list[_Field]:
    """Per item: its tensor field's framing (tag, length, Tensor head), its payload, and
    the two's size.

    tensors: one tensor per item, or a batch tensor whose rows are the items' tensors
    (framed once, payloads cut from one host copy).
    """
    if isinstance(tensors, torch.Tensor):
        if tensors.ndim < 1 or tensors.shape[0] == 0:
            return []
        head = tensor_head(tensors[0])
        payloads = row_payloads(tensors)
        framing = delimited(tag, len(head) + len(payloads[0])) + head
        size = len(framing) + len(payloads[0])
        return [(framing, data, size) for data in payloads]
    payloads = tensor_payloads(tensors)
    out = []
    last_key: tuple[torch.dtype, torch.Size] | None = None
    framing = b""
    for t, data in zip(tensors, payloads, strict=True):
        key = (t.dtype, t.shape)
        if key != last_key:  # items alike share one framing
            head = tensor_head(t)
            framing = delimited(tag, len(head) + len(data)) + head
            last_key = key
        out.append((framing, data, len(framing) + len(data)))
    return out


class _Parts:
    """A request's pieces, joined once at the end."""

    def __init__(self, layer: int) -> None:
        if not 0 <= layer < 1 << 32:
            raise ValueError(f"layer must be a uint32, got {layer!r}")
        self.parts: list[bytes | memoryview] = [_LAYER + varint(layer)] if layer else []
        self._heads: dict[int, bytes] = {}  # item size -> the item's field header

    def item(self, size: int) -> None:
        head = self._heads.get(size)
        if head is None:
            head = self._heads[size] = delimited(_ITEMS, size)
        self.parts.append(head)

    def bytes(self, return_lse: bool) -> bytes:
        if return_lse:
            self.parts.append(_RETURN_LSE)
        return b"".join(self.parts)


def encode_append_attend(
    layer: int,
    seq_ids: Sequence[str],
    token_ids: Sequence[Sequence[int]],
    keys: Sequence[torch.Tensor] | torch.Tensor,
    values: Sequence[torch.Tensor] | torch.Tensor,
    queries: Sequence[torch.Tensor] | torch.Tensor,
    return_lse: bool,
) -> bytes:
    """A serialized AppendAttendRequest; item i is (seq_ids[i], token_ids[i], keys[i],
    values[i], queries[i]).

    Args:
        layer: the layer (>= 0).
        token_ids: per item, ints (int64 range).
        keys, values: per item ``[n, num_kv_heads, head_dim]``; queries ``[m, num_q_heads,
            head_dim]``; float16, bfloat16 or float32, any device (copied to the host).
            Each may instead be one batch tensor whose row i is item i's tensor (say keys
            ``[batch, n, num_kv_heads, head_dim]``): the faster form.

    Raises:
        TensorCodecError: a tensor's dtype cannot travel.
        ValueError: a token id or the layer is out of range, or the lists differ in length.
    """
    _check_lengths(seq_ids, token_ids, keys, values, queries)
    out = _Parts(layer)
    fields = zip(
        _tensor_fields(_KEY, keys),
        _tensor_fields(_VALUE, values),
        _tensor_fields(_QUERY_OF_APPEND, queries),
        strict=True,
    )
    parts = out.parts
    for i, (seq_id, ((kf, kd, ks), (vf, vd, vs), (qf, qd, qs))) in enumerate(
        zip(seq_ids, fields, strict=True)
    ):
        sid = _seq_id_field(seq_id)
        ids = _token_ids_field(token_ids[i], i)
        out.item(len(sid) + len(ids) + ks + vs + qs)
        parts += (sid, ids, kf, kd, vf, vd, qf, qd)
    return out.bytes(return_lse)


def encode_attend(
    layer: int,
    seq_ids: Sequence[str],
    queries: Sequence[torch.Tensor] | torch.Tensor,
    return_lse: bool,
) -> bytes:
    """A serialized AttendRequest; item i is (seq_ids[i], queries[i]); arguments and errors
    as `encode_append_attend`."""
    _check_lengths(seq_ids, queries)
    out = _Parts(layer)
    parts = out.parts
    for seq_id, (qf, qd, qs) in zip(
        seq_ids, _tensor_fields(_QUERY_OF_ATTEND, queries), strict=True
    ):
        sid = _seq_id_field(seq_id)
        out.item(len(sid) + qs)
        parts += (sid, qf, qd)
    return out.bytes(return_lse)


def encode_append_attend_batch(
    layer: int,
    seq_ids: Sequence[str],
    token_ids: Sequence[Sequence[int]],
    key: torch.Tensor | SharedTensor,
    value: torch.Tensor | SharedTensor,
    query: torch.Tensor | SharedTensor,
    return_lse: bool,
    *,
    output_to: SliceRef | None = None,
    lse_to: SliceRef | None = None,
) -> bytes:
    """A serialized AppendAttendBatchRequest.

    Args:
        layer: the layer (>= 0).
        seq_ids: the batch's sequences.
        token_ids: per sequence, its n new token ids (ints in int64 range).
        key, value: ``[batch, n, num_kv_heads, head_dim]``; query ``[batch, m,
            num_q_heads, head_dim]``; float16, bfloat16 or float32, any device (copied
            to the host when not there); or each a `SharedTensor` already in a region.
        output_to, lse_to: (region id, byte offset) for the server to write the output
            (lse) to; None: it comes back as bytes.

    Raises:
        TensorCodecError: a tensor's dtype cannot travel.
        ValueError: a token id or the layer is out of range.
    """
    out = _Parts(layer)
    out.parts.append(_batch_seq_ids_field(tuple(seq_ids)))
    if len(token_ids) and all(len(row) == 1 for row in token_ids):
        flat: Sequence[int] = [row[0] for row in token_ids]
    else:
        flat = [t for row in token_ids for t in row]
    if flat:
        packed = _packed_ids(flat, "token_ids")
        out.parts += (delimited(_BATCH_TOKEN_IDS, len(packed)), packed)
    for tag, tensor in ((_BATCH_KEY, key), (_BATCH_VALUE, value), (_BATCH_QUERY_OF_APPEND, query)):
        out.parts += _batch_tensor(tag, tensor)
    if return_lse:
        out.parts.append(_BATCH_LSE_OF_APPEND)
    if output_to is not None or lse_to is not None:
        out.parts += _slice_fields(
            _BATCH_OUTPUT_TO_OF_APPEND, _BATCH_LSE_TO_OF_APPEND, output_to, lse_to
        )
    return b"".join(out.parts)


def encode_attend_batch(
    layer: int,
    seq_ids: Sequence[str],
    query: torch.Tensor | SharedTensor,
    return_lse: bool,
    *,
    output_to: SliceRef | None = None,
    lse_to: SliceRef | None = None,
) -> bytes:
    """A serialized AttendBatchRequest: query ``[batch, m, num_q_heads, head_dim]``;
    arguments and errors as `encode_append_attend_batch`."""
    out = _Parts(layer)
    out.parts.append(_batch_seq_ids_field(tuple(seq_ids)))
    out.parts += _batch_tensor(_BATCH_QUERY_OF_ATTEND, query)
    if return_lse:
        out.parts.append(_BATCH_LSE_OF_ATTEND)
    if output_to is not None or lse_to is not None:
        out.parts += _slice_fields(
            _BATCH_OUTPUT_TO_OF_ATTEND, _BATCH_LSE_TO_OF_ATTEND, output_to, lse_to
        )
    return b"".join(out.parts)


def call_fields(request_id: str, timeout_us: int) -> bytes:
    """The request_id and timeout_us fields of a mutating request, to append to its encoded
    bytes (protobuf fields may come in any order): b"" for neither.

    Args:
        request_id: the call's idempotency key ("" for none).
        timeout_us: the commit deadline, microseconds (0 for none).
    """
    parts = []
    if request_id:
        rid = request_id.encode()
        parts += (delimited(_REQUEST_ID, len(rid)), rid)
    if timeout_us:
        parts += (_TIMEOUT_US, varint(timeout_us))
    return b"".join(parts)


def _check_lengths(*lists: Sequence[object] | torch.Tensor) -> None:
    for x in lists:
        if isinstance(x, torch.Tensor) and x.ndim == 0:
            raise ValueError("a batch tensor needs a leading batch dimension, got a 0-d tensor")
    sizes = [len(x) for x in lists]
    if len(set(sizes)) > 1:
        raise ValueError(f"the items' fields differ in count: {sizes}")
