"""Pieces of the protobuf wire format, for the messages the hot path writes by hand.

A decode step's request and reply are a batch of items that share dtype and shape and
differ only in their payload bytes (and sequence ids). Building them through the protobuf
API costs several Python calls per item; writing the bytes directly costs a join. These
helpers write the framing: varints, length-delimited field headers, and a `Tensor`
message's bytes up to its payload (cached per dtype and shape, since few occur).
"""

from __future__ import annotations

import torch

from cache_service.tensor_codec import dtype_to_proto, tensor_payload

__all__ = ["delimited", "tensor_field", "tensor_head", "varint"]

# (dtype enum, shape) -> the Tensor message's bytes before its payload. Few distinct keys
# occur (one per dtype and rows-per-item); the bound only guards against odd callers.
_HEADS: dict[tuple[int, tuple[int, ...]], bytes] = {}
_MAX_HEADS = 256

# Tensor { DType dtype = 1; repeated int64 shape = 2 (packed); bytes data = 3; }
_DTYPE = b"\x08"
_SHAPE = b"\x12"
_DATA = b"\x1a"


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
