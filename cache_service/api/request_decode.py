"""What the servicer makes of the attention requests: the coordinator's items, decoded and
checked against the layout, with errors naming the request field.

Pure translation (no I/O, no state): the servicer's handlers call these and pass the items
on; benchmarks time them as the server's decode step.

- `AppendAttend` / `Attend`: one item message per sequence. Each field (key, value, query)
  of all items decodes into one buffer; the items' tensors are consecutive views of it and
  `JoinedFields` hands the buffers on, so the coordinator checks and converts each field
  as one tensor.
- `AppendAttendBatch` / `AttendBatch`: one tensor per field for the whole batch, row i for
  sequence i. The items are the rows (views); errors about one sequence name it
  ``items[i]``, the batch row. Their tensors may reference a shared-memory region instead
  of carrying bytes (``Tensor.shared``): the caller passes a `SharedReader` that copies
  them out (`SharedRegions.read`), and the checks and messages are the bytes path's.
"""

from __future__ import annotations

from typing import Any

import torch

from cache_service._proto.kvcache.v1 import kvcache_pb2 as pb
from cache_service.engine.values import (
    AppendAttendItem,
    AttendItem,
    JoinedFields,
    StackedAppendAttend,
)
from cache_service.errors import InvalidRequest
from cache_service.wire.tensor_codec import (
    SharedReader,
    joined_from_protos,
    tensor_from_proto,
    tensors_from_protos,
)
from workers.layout import KVLayout

__all__ = [
    "decode_append_attend",
    "decode_append_attend_batch",
    "decode_attend",
    "decode_attend_batch",
]


def decode_attend(request: pb.AttendRequest) -> list[AttendItem]:
    """The items of an AttendRequest (queries ``[m, Hq, D]``, one buffer for all).

    Raises:
        InvalidRequest / TensorCodecError: an empty sequence id, a malformed tensor.
    """
    wire = request.items
    seq_ids = _item_seq_ids(wire)
    queries = tensors_from_protos([it.query for it in wire], "items[{}].query", ndim=3)
    return [AttendItem(s, q) for s, q in zip(seq_ids, queries, strict=True)]


def decode_append_attend(
    request: pb.AppendAttendRequest,
) -> tuple[list[AppendAttendItem], JoinedFields]:
    """The items of an AppendAttendRequest and the buffers their tensors are views of.

    Raises:
        InvalidRequest / TensorCodecError: an empty sequence id, a malformed tensor.
    """
    wire = request.items
    seq_ids = _item_seq_ids(wire)
    keys, k_span = joined_from_protos([it.key for it in wire], "items[{}].key", ndim=3)
    values, v_span = joined_from_protos([it.value for it in wire], "items[{}].value", ndim=3)
    queries, q_span = joined_from_protos([it.query for it in wire], "items[{}].query", ndim=3)
    items = [
        AppendAttendItem(s, list(it.token_ids), k, v, q)
        for s, it, k, v, q in zip(seq_ids, wire, keys, values, queries, strict=True)
    ]
    return items, JoinedFields(k_span, v_span, q_span)


def decode_append_attend_batch(
    request: pb.AppendAttendBatchRequest, layout: KVLayout, shared: SharedReader | None = None
) -> StackedAppendAttend:
    """The batch of an AppendAttendBatchRequest: row i of each tensor is sequence i's; the
    query's shape ``[batch, m, Hq, D]`` is the reply's.

    shared: reads tensors whose payload is a shared-memory slice (None: refused).

    Raises:
        InvalidRequest / TensorCodecError: no or empty sequence ids; key not ``[batch, n >=
        1, num_kv_heads, head_dim]``; value not key's shape; query not ``[batch, m >= 1, *,
        head_dim]``; token_ids not batch x n ids. Whatever `shared` raises.
    """
    seq_ids = _batch_seq_ids(request.seq_ids)
    b = len(seq_ids)
    key = tensor_from_proto(
        request.key, "key", shape=(b, None, layout.num_kv_heads, layout.head_dim), shared=shared
    )
    value = tensor_from_proto(request.value, "value", shape=(b, *key.shape[1:]), shared=shared)
    query = _batch_query(request.query, b, layout.head_dim, shared)
    n = key.shape[1]
    if n < 1:
        raise InvalidRequest(f"key has shape {list(key.shape)}: no new tokens")
    flat = list(request.token_ids)
    if len(flat) != b * n:
        raise InvalidRequest(
            f"token_ids holds {len(flat)} ids; {b} sequences x {n} new tokens (key "
            f"dimension 1) need {b * n}"
        )
    return StackedAppendAttend(seq_ids, flat, key, value, query)


def decode_attend_batch(
    request: pb.AttendBatchRequest, layout: KVLayout, shared: SharedReader | None = None
) -> tuple[list[AttendItem], torch.Size]:
    """The items of an AttendBatchRequest and the query's shape ``[batch, m, Hq, D]``;
    `shared` as in `decode_append_attend_batch`.

    Raises:
        InvalidRequest / TensorCodecError: no or empty sequence ids; a query that is not
        ``[batch, m >= 1, *, head_dim]``. Whatever `shared` raises.
    """
    seq_ids = _batch_seq_ids(request.seq_ids)
    query = _batch_query(request.query, len(seq_ids), layout.head_dim, shared)
    items = [AttendItem(s, q) for s, q in zip(seq_ids, query.unbind(0), strict=True)]
    return items, query.shape


def _item_seq_ids(items: Any) -> list[str]:
    """The items' sequence ids; an empty one is refused, naming its item."""
    seq_ids = [it.seq_id for it in items]
    if not all(seq_ids):
        raise InvalidRequest(f"items[{seq_ids.index('')}].seq_id is empty")
    return seq_ids


def _batch_seq_ids(seq_ids: Any) -> list[str]:
    """A batch request's sequence ids: at least one, none empty."""
    ids = list(seq_ids)
    if not ids:
        raise InvalidRequest("seq_ids is empty: a batch needs at least one sequence")
    if not all(ids):
        raise InvalidRequest(f"seq_ids[{ids.index('')}] is empty")
    return ids


def _batch_query(
    msg: pb.Tensor, batch: int, head_dim: int, shared: SharedReader | None
) -> torch.Tensor:
    """A batch request's query ``[batch, m >= 1, num_q_heads, head_dim]`` (the head count
    is the coordinator's to check against the layout)."""
    query = tensor_from_proto(msg, "query", shape=(batch, None, None, head_dim), shared=shared)
    if query.shape[1] < 1:
        raise InvalidRequest(f"query has shape {list(query.shape)}: no query rows")
    return query
