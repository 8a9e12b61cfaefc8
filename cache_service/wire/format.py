"""Pieces of the protobuf wire format, for the messages the hot path writes by hand.

A decode step's request and reply are a batch of items that share dtype and shape and
differ only in their payload bytes (and sequence ids). Building them through the protobuf
API costs several Python calls per item; writing the bytes directly costs a join. These
helpers write the framing: varints, length-delimited field headers, and a `Tensor`
message's bytes up to its payload (cached per dtype and shape, since few occur); and the
small messages of the shared-memory path, a `SharedSlice` and a `Tensor` whose payload is
one.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from cache_service.wire.tensor_codec import dtype_to_proto, tensor_payload

__all__ = [
    "delimited",
    "shared_slice",
    "shared_tensor_field",
    "tensor_field",
    "tensor_head",
    "varint",
]

# (dtype enum, shape) -> the Tensor message's bytes before its payload. Few distinct keys
# occur (one per dtype and rows-per-item); the bound only guards against odd callers.
_HEADS: dict[tuple[int, tuple[int, ...]], bytes] = {}
_MAX_HEADS = 256

# Tensor { DType dtype = 1; repeated int64 shape = 2 (packed);
#          oneof payload { bytes data = 3; SharedSlice shared = 4; } }
_DTYPE = b"\x08"
_SHAPE = b"\x12"
_DATA = b"\x1a"
_SHARED = b"\x22"
# SharedSlice { string region_id = 1; uint64 offset = 2; }
_REGION_ID = b"\x0a"
_OFFSET = b"\x10"


_ONE_BYTE = [bytes([i]) for i in range(128)]


def varint(n: int) -> bytes:
    """Base-128 varint of ``n``; negative int64 values as their 64-bit two's complement
    (what protobuf writes for int64 fields)."""
    if 0 <= n < 128:  # lengths of ids and small headers: the common case
        return _ONE_BYTE[n]
    if 0 < n < 16384:
        return bytes(((n & 0x7F) | 0x80, n >> 7))
    if n < 0:
        n += 1 << 64
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def delimited(tag: bytes, length: int) -> bytes:
    """The header of a length-delimited field: its tag byte(s) and the payload length."""
    return tag + varint(length)


def tensor_head(t: torch.Tensor) -> bytes:
    """The `Tensor` message of ``t`` up to its payload: dtype, packed shape, and the data
    field's tag and length (what `tensor_to_proto` would serialize, the payload excepted).

    Raises:
        TensorCodecError: ``t``'s dtype cannot travel.
    """
    enum = dtype_to_proto(t.dtype)
    shape = tuple(t.shape)
    head = _HEADS.get((enum, shape))
    if head is None:
        dims = b"".join(varint(d) for d in shape)
        head = _DTYPE + varint(enum)
        if dims:
            head += delimited(_SHAPE, len(dims)) + dims
        head += delimited(_DATA, t.numel() * t.element_size())
        if len(_HEADS) >= _MAX_HEADS:
            _HEADS.clear()
        _HEADS[(enum, shape)] = head
    return head


def tensor_field(tag: bytes, t: torch.Tensor) -> tuple[bytes, bytes | memoryview]:
    """A whole `Tensor` field of ``t`` under ``tag``: its framing (tag, length, Tensor head)
    and its payload (a view of ``t``'s memory where possible); joined, they are the field.

    Raises:
        TensorCodecError: ``t``'s dtype cannot travel.
    """
    head = tensor_head(t)
    data = tensor_payload(t)
    return delimited(tag, len(head) + len(data)) + head, data


@functools.lru_cache(maxsize=256)
def _tensor_meta(enum: int, shape: tuple[int, ...]) -> bytes:
    """A `Tensor` message's dtype and shape fields."""
    dims = b"".join(varint(d) for d in shape)
    return _DTYPE + varint(enum) + (delimited(_SHAPE, len(dims)) + dims if dims else b"")


# A client's calls name the same few slices of its region layer after layer.
@functools.lru_cache(maxsize=256)
def shared_slice(region_id: str, offset: int) -> bytes:
    """A `SharedSlice` message (what the protobuf API serializes: defaults left out).

    Raises:
        ValueError: offset outside uint64.
    """
    if not 0 <= offset < 1 << 64:
        raise ValueError(f"offset must be a uint64, got {offset!r}")
    raw = region_id.encode("utf-8")
    out = delimited(_REGION_ID, len(raw)) + raw if raw else b""
    return out + _OFFSET + varint(offset) if offset else out


def shared_tensor_field(
    tag: bytes, dtype: torch.dtype, shape: Sequence[int], region_id: str, offset: int
) -> bytes:
    """A whole `Tensor` field under ``tag`` whose payload is ``shared``: a tensor of
    ``dtype`` and ``shape`` in region ``region_id`` at byte ``offset``.

    Raises:
        TensorCodecError: ``dtype`` cannot travel. ValueError: offset outside uint64.
    """
    return _shared_tensor_field(tag, dtype, tuple(shape), region_id, offset)


# The same slices come back layer after layer (the client's inputs, the server's outputs).
@functools.lru_cache(maxsize=256)
def _shared_tensor_field(
    tag: bytes, dtype: torch.dtype, shape: tuple[int, ...], region_id: str, offset: int
) -> bytes:
    where = shared_slice(region_id, offset)
    body = _tensor_meta(dtype_to_proto(dtype), shape) + delimited(_SHARED, len(where))
    return delimited(tag, len(body) + len(where)) + body + where
