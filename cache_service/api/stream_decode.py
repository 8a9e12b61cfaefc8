"""Plain request fields checked, and the client-streaming requests (Append, ImportBlocks)
assembled from their messages: header first, data chunks after, bounded by the header's sizes.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import AsyncIterator
from typing import Any

import torch

from cache_service._proto.kvcache.v1 import kvcache_pb2 as pb
from cache_service.errors import InvalidRequest
from cache_service.wire.tensor_codec import (
    TensorCodecError,
    check_shape,
    dtype_from_name,
    dtype_from_proto,
    tensor_from_bytes,
)
from workers.layout import KVLayout

__all__ = [
    "item_prompt",
    "nonempty_ids",
    "read_append",
    "read_import",
    "require_seq_id",
    "shared_prompt",
]


def require_seq_id(seq_id: str, field: str = "seq_id") -> str:
    """`seq_id`, checked non-empty (InvalidRequest naming `field` otherwise)."""
    if not seq_id:
        raise InvalidRequest(f"{field} is empty")
    return seq_id


def nonempty_ids(token_ids: Any) -> list[int]:
    """`token_ids` as a list, checked non-empty."""
    ids = list(token_ids)
    if not ids:
        raise InvalidRequest("token_ids is empty")
    return ids


def shared_prompt(token_ids: Any) -> array | None:
    """CreateSequencesRequest.shared_prompt_token_ids packed as the block manager keeps
    token ids (unsigned 64-bit), or None when empty.

    Raises:
        InvalidRequest: a negative id (named by this field, not by an item).
    """
    if not len(token_ids):
        return None
    return _packed("shared_prompt_token_ids", token_ids)


def item_prompt(i: int, token_ids: Any, shared: array | None) -> Any:
    """The prompt of CreateSequencesRequest item `i`: its prompt_token_ids (None when
    empty), after the shared ones when there are some, joined in C (a 2k-token system
    prompt is not made into Python ints once per item).

    Raises:
        InvalidRequest: a negative id, named by its item.
    """
    if shared is None:
        return list(token_ids) or None
    return shared + _packed(f"sequences[{i}]", token_ids)


def _packed(field: str, token_ids: Any) -> array:
    try:
        return array("Q", token_ids)
    except OverflowError:
        raise InvalidRequest(
            f"{field}: token ids must be ints in [0, 2**64), got {min(token_ids)}"
        ) from None


def _spec_size(spec: pb.TensorSpec, field: str) -> tuple[torch.dtype, list[int], int]:
    dtype = dtype_from_proto(spec.dtype, f"{field}.dtype")
    dims = list(spec.shape)
    check_shape(dims, field)
    return dtype, dims, math.prod(dims) * torch.empty((), dtype=dtype).element_size()


async def read_append(
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


async def read_import(
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
