"""torch tensors <-> kvcache.v1 `Tensor` messages: raw little-endian bytes, dtype, shape.

Decoding validates everything a client controls (dtype known and allowed, sizes
non-negative, byte count exact, shape as expected) and raises `TensorCodecError` naming the
field, which the server reports as INVALID_ARGUMENT. Only float16, bfloat16 and float32
travel: the KV dtypes the pools support.

A `Tensor` may instead reference bytes in a shared-memory region (its `shared` payload,
accepted by the batch RPCs only): `tensor_from_proto` validates dtype and shape alike and
hands the reference to a `SharedReader` (the server's `SharedRegions.read`, which copies
the bytes out); without one, such a tensor is refused naming the field.

The batch forms (`tensors_from_protos`, `tensor_payloads`) handle one field of every item
of a request or reply with one copy and a few torch calls in all, instead of several per
item: decoded tensors are consecutive views of one new buffer (`joined_view` then sees them
as one tensor, without copying), and encoded ones are cut from one host copy.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence

import torch

from cache_service._proto.kvcache.v1 import kvcache_pb2 as pb

__all__ = [
    "DTYPE_NAMES",
    "SharedReader",
    "TensorCodecError",
    "check_shape",
    "dtype_from_name",
    "dtype_from_proto",
    "dtype_to_proto",
    "joined_from_protos",
    "joined_view",
    "row_payloads",
    "tensor_from_bytes",
    "tensor_from_proto",
    "tensor_payload",
    "tensor_payloads",
    "tensor_to_bytes",
    "tensor_to_proto",
    "tensors_from_protos",
]

# torch dtype <-> wire enum. Keep in step with the DType enum of kvcache.proto.
_TO_PROTO: dict[torch.dtype, int] = {
    torch.float16: pb.DTYPE_FLOAT16,
    torch.bfloat16: pb.DTYPE_BFLOAT16,
    torch.float32: pb.DTYPE_FLOAT32,
}
_FROM_PROTO: dict[int, torch.dtype] = {v: k for k, v in _TO_PROTO.items()}
# The names KVLayout.dtype uses ("float16" | "bfloat16" | "float32").
DTYPE_NAMES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}
# Same-width integer types, used to reinterpret (and, on a big-endian host, byte-swap) the
# raw bits: numpy has no bfloat16, and a reinterpretation never rounds.
_BITS_DTYPE = {2: torch.int16, 4: torch.int32}
_LITTLE_ENDIAN_HOST = sys.byteorder == "little"


class TensorCodecError(ValueError):
    """A tensor on the wire is malformed or has the wrong dtype / shape for its field."""


# (region_id, offset, dtype, shape, field) -> a new tensor holding a copy of those bytes;
# see `tensor_from_proto`.
SharedReader = Callable[[str, int, torch.dtype, list[int], str], torch.Tensor]


def dtype_to_proto(dtype: torch.dtype) -> int:
    """The wire enum value of a torch dtype (float16, bfloat16 or float32)."""
    try:
        return _TO_PROTO[dtype]
    except KeyError:
        raise TensorCodecError(
            f"dtype {dtype} cannot travel; use one of float16, bfloat16, float32"
        ) from None


def dtype_from_proto(value: int, field: str = "dtype") -> torch.dtype:
    """The torch dtype of a wire enum value; raises TensorCodecError for unknown values."""
    try:
        return _FROM_PROTO[value]
    except KeyError:
        names = ", ".join(pb.DType.Name(v) for v in _FROM_PROTO)
        raise TensorCodecError(
            f"{field}: unsupported dtype {value}; expected one of {names}"
        ) from None


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype of a KVLayout dtype name ("float16", "bfloat16", "float32")."""
    try:
        return DTYPE_NAMES[name]
    except KeyError:
        raise TensorCodecError(
            f"unknown dtype name {name!r}; expected one of {sorted(DTYPE_NAMES)}"
        ) from None


def tensor_to_bytes(tensor: torch.Tensor) -> bytes:
    """The raw little-endian, C-contiguous bytes of `tensor` (moved to the CPU first)."""
    dtype_to_proto(tensor.dtype)
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return b""
    bits = t.view(_BITS_DTYPE[t.element_size()]).numpy()
    if not _LITTLE_ENDIAN_HOST:  # pragma: no cover - no big-endian CI host
        bits = bits.byteswap()
    return bits.tobytes()


def tensor_from_bytes(
    data: bytes | bytearray | memoryview,
    dtype: torch.dtype,
    shape: Sequence[int],
    field: str = "tensor",
) -> torch.Tensor:
    """A new CPU tensor of `dtype` and `shape` from raw little-endian bytes.

    Raises TensorCodecError when a size is negative or the byte count is not exactly
    product(shape) * itemsize.
    """
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise TensorCodecError(f"{field}: shape {list(shape)} has a negative size")
    itemsize = dtype.itemsize
    expected = math.prod(shape) * itemsize
    if len(data) != expected:
        raise TensorCodecError(
            f"{field}: {len(data)} data bytes, but shape {list(shape)} of {dtype} needs {expected}"
        )
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    # bytearray copies the payload: the tensor then owns writable memory independent of
    # the (immutable) protobuf bytes.
    if _LITTLE_ENDIAN_HOST:  # the wire order: read the values in place, one copy
        return torch.frombuffer(bytearray(data), dtype=dtype).view(shape)
    raw = torch.frombuffer(bytearray(data), dtype=_BITS_DTYPE[itemsize])  # pragma: no cover
    raw = torch.from_numpy(raw.numpy().byteswap())  # pragma: no cover - no big-endian CI
    return raw.view(dtype).reshape(shape)  # pragma: no cover


def tensor_to_proto(tensor: torch.Tensor) -> pb.Tensor:
    """Encode a float16 / bfloat16 / float32 tensor (any device, any strides)."""
    return pb.Tensor(
        dtype=dtype_to_proto(tensor.dtype),
        shape=list(tensor.shape),
        data=tensor_to_bytes(tensor),
    )


def tensor_from_proto(
    msg: pb.Tensor,
    field: str,
    *,
    ndim: int | None = None,
    shape: Sequence[int | None] | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    shared: SharedReader | None = None,
) -> torch.Tensor:
    """Decode and validate a `Tensor` message into a new CPU tensor.

    Args:
        msg: the message.
        field: the request field, for error messages (e.g. "items[3].query").
        ndim: required number of dimensions.
        shape: required sizes; None entries are free.
        dtypes: allowed dtypes (default: all three wire dtypes).
        shared: reads a `shared` payload (after the dtype and shape checks); None: a
            message with a `shared` payload is refused.

    Raises:
        TensorCodecError naming `field` and what was wrong; whatever `shared` raises.
    """
    dtype = dtype_from_proto(msg.dtype, f"{field}.dtype")
    if dtypes is not None and dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TensorCodecError(
            f"{field}: dtype {str(dtype).removeprefix('torch.')} not allowed here; expected {allowed}"
        )
    dims = list(msg.shape)
    check_shape(dims, field, ndim=ndim, shape=shape)
    data = msg.data
    # `data` and `shared` are one oneof: only an empty `data` can hide a `shared` payload,
    # so the bytes path pays nothing for the check.
    if not data and msg.HasField("shared"):
        if shared is None:
            raise TensorCodecError(
                f"{field}: a shared-memory payload is accepted only by the batch calls "
                "(AppendAttendBatch, AttendBatch); send the bytes"
            )
        return shared(msg.shared.region_id, msg.shared.offset, dtype, dims, field)
    return tensor_from_bytes(data, dtype, dims, field)


def check_shape(
    dims: Sequence[int],
    field: str,
    *,
    ndim: int | None = None,
    shape: Sequence[int | None] | None = None,
) -> None:
    """Check a shape's rank and fixed sizes; raise TensorCodecError naming `field`."""
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and len(dims) != ndim:
        raise TensorCodecError(f"{field}: expected {ndim} dimensions, got shape {list(dims)}")
    if any(d < 0 for d in dims):
        raise TensorCodecError(f"{field}: shape {list(dims)} has a negative size")
    if shape is not None:
        for axis, (got, want) in enumerate(zip(dims, shape, strict=True)):
            if want is not None and got != want:
                raise TensorCodecError(
                    f"{field}: dimension {axis} is {got}, expected {want} (shape {list(dims)})"
                )


def joined_view(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One 1-D tensor over the elements of all `tensors`, in order, when they lie back to
    back in one storage (each C-contiguous, one dtype, each starting where the previous one
    ends: e.g. the rows of one tensor, or what `tensors_from_protos` returns); else None.

    The result is a view: no data moves. Used to check, convert or send many small tensors
    as one.
    """
    if not tensors:
        return None
    first = tensors[0]
    if not first.is_contiguous():
        return None
    dtype = first.dtype
    itemsize = first.element_size()
    base = first.data_ptr() - first.storage_offset() * itemsize
    start = first.storage_offset()
    end = start + first.numel()
    for t in tensors[1:]:
        if (
            t.dtype != dtype
            or t.storage_offset() != end
            or t.data_ptr() - end * itemsize != base
            or not t.is_contiguous()
        ):
            return None
        end += t.numel()
    if end * itemsize > first.untyped_storage().nbytes():  # not one storage after all
        return None
    return first.as_strided((end - start,), (1,))


def tensors_from_protos(
    msgs: Sequence[pb.Tensor], field: str, *, ndim: int | None = None
) -> list[torch.Tensor]:
    """Decode one field of many messages (say every request item's key) into new CPU
    tensors that are consecutive views of one writable buffer (one copy of the payload in
    all; `joined_view` of the result is a view, not a copy).

    Args:
        msgs: the messages, in order.
        field: the field's name with ``{}`` for the message's index, e.g.
            ``"items[{}].key"`` (formatted only for an error message).
        ndim: required number of dimensions of every tensor.

    Validates exactly what `tensor_from_proto` validates and raises its errors, naming the
    first bad message. Messages of different dtypes (allowed) decode one by one.
    """
    return joined_from_protos(msgs, field, ndim=ndim)[0]


def joined_from_protos(
    msgs: Sequence[pb.Tensor], field: str, *, ndim: int | None = None
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """`tensors_from_protos`, and the flat tensor over all of them (what `joined_view` of
    the result is) when they share one buffer, else None: a caller that hands the tensors
    on knows they are back to back without checking each one again."""
    if not msgs:
        return [], None
    joined = _joined(msgs, field, ndim)
    if joined is None:  # a bad message, or mixed dtypes: one at a time
        return _one_by_one(msgs, field, ndim), None
    flat, shapes, same = joined
    if same:
        return list(flat.view(len(shapes), *shapes[0]).unbind(0)), flat if flat.numel() else None
    if not flat.numel():
        return [torch.empty(s, dtype=flat.dtype) for s in shapes], None
    sizes = [math.prod(s) for s in shapes]
    return [piece.view(s) for piece, s in zip(flat.split(sizes), shapes, strict=True)], flat


def _joined(
    msgs: Sequence[pb.Tensor], field: str, ndim: int | None
) -> tuple[torch.Tensor, list[list[int]], bool] | None:
    """Every message's payload in one new flat tensor, with the messages' shapes and
    whether they are all alike; None when a message is bad or the dtypes differ (the
    caller then decodes one by one, which names the bad message)."""
    dtype_value = msgs[0].dtype
    dtype = _FROM_PROTO.get(dtype_value)
    if dtype is None or not _LITTLE_ENDIAN_HOST:
        return None
    itemsize = dtype.itemsize
    # Lists (slicing is the cheapest copy of a repeated field); C-level passes below, as
    # this runs for every field of every request.
    shapes = [m.shape[:] for m in msgs]
    datas = [m.data for m in msgs]
    first = shapes[0]
    same = shapes.count(first) == len(shapes)
    if same:  # the usual batch: one shape, so one check covers every message
        nbytes = math.prod(first) * itemsize
        ok = (ndim is None or len(first) == ndim) and (not first or min(first) >= 0)
        ok = ok and set(map(len, datas)) == {nbytes}
    else:
        ok = all(
            (ndim is None or len(dims) == ndim)
            and (not dims or min(dims) >= 0)
            and len(d) == math.prod(dims) * itemsize
            for dims, d in zip(shapes, datas, strict=True)
        )
    if not ok or [m.dtype for m in msgs].count(dtype_value) != len(msgs):
        return None
    buf = bytearray().join(datas)  # the one copy: writable, owned by the tensors
    flat = torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)
    return flat, shapes, same


def _one_by_one(msgs: Sequence[pb.Tensor], field: str, ndim: int | None) -> list[torch.Tensor]:
    return [tensor_from_proto(m, field.format(i), ndim=ndim) for i, m in enumerate(msgs)]


def row_payloads(batch: torch.Tensor) -> list[bytes | memoryview]:
    """The raw little-endian bytes of each ``batch[i]`` (`tensor_to_bytes` of each row),
    cut from one host copy of the batch: no per-row tensor work.

    Raises:
        TensorCodecError: a dtype that cannot travel.
        ValueError: ``batch`` has no leading (batch) dimension.
    """
    if batch.ndim < 1:
        raise ValueError("row_payloads needs a batch dimension, got a 0-d tensor")
    dtype_to_proto(batch.dtype)
    rows = batch.shape[0]
    if not _LITTLE_ENDIAN_HOST or rows == 0 or batch.numel() == 0:
        return [tensor_to_bytes(row) for row in batch]
    raw = _host_bytes(batch.contiguous())
    return _cut(raw, raw.nbytes // rows, rows)


def tensor_payload(tensor: torch.Tensor) -> bytes | memoryview:
    """The raw little-endian, C-contiguous bytes of `tensor` (`tensor_to_bytes`), as a
    view of its memory where it is a contiguous host tensor already (no copy).

    Raises:
        TensorCodecError: a dtype that cannot travel.
    """
    dtype_to_proto(tensor.dtype)
    if not _LITTLE_ENDIAN_HOST or tensor.numel() == 0:
        return tensor_to_bytes(tensor)
    return _host_bytes(tensor.contiguous())


def _host_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of contiguous ``t`` on the host (a view when it is there already)."""
    host = t.detach()
    if host.device.type != "cpu":
        host = host.cpu()
    return memoryview(host.view(_BITS_DTYPE[host.element_size()]).numpy()).cast("B")


def _cut(raw: memoryview, size: int, count: int) -> list[bytes | memoryview]:
    """``count`` consecutive ``size``-byte views of ``raw``."""
    return [raw[i : i + size] for i in range(0, size * count, size)]


def tensor_payloads(
    tensors: Sequence[torch.Tensor], *, uniform: bool = False
) -> list[bytes | memoryview]:
    """Each tensor's raw little-endian bytes (`tensor_to_bytes`). Tensors back to back in
    one storage (`joined_view`: the per-item rows of one output) reach the host once and
    each item's bytes are a view of that copy.

    uniform: the caller knows every tensor has the first one's size (cut at fixed offsets).

    Raises:
        TensorCodecError: a dtype that cannot travel.
    """
    span = joined_view(tensors) if len(tensors) > 1 else None
    if span is None or span.numel() == 0 or not _LITTLE_ENDIAN_HOST:
        return [tensor_to_bytes(t) for t in tensors]
    dtype_to_proto(span.dtype)
    raw = _host_bytes(span)
    itemsize = span.element_size()
    if uniform:
        return _cut(raw, tensors[0].numel() * itemsize, len(tensors))
    out: list[bytes | memoryview] = []
    offset = 0
    for t in tensors:
        end = offset + t.numel() * itemsize
        out.append(raw[offset:end])
        offset = end
    return out
