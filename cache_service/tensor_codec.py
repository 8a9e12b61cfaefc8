"""torch tensors <-> kvcache.v1 `Tensor` messages: raw little-endian bytes, dtype, shape.

Decoding validates everything a client controls (dtype known and allowed, sizes
non-negative, byte count exact, shape as expected) and raises `TensorCodecError` naming the
field, which the server reports as INVALID_ARGUMENT. Only float16, bfloat16 and float32
travel: the KV dtypes the pools support.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import torch

from cache_service._proto.kvcache.v1 import kvcache_pb2 as pb

__all__ = [
    "DTYPE_NAMES",
    "TensorCodecError",
    "check_shape",
    "dtype_from_name",
    "dtype_from_proto",
    "dtype_to_proto",
    "tensor_from_bytes",
    "tensor_from_proto",
    "tensor_to_bytes",
    "tensor_to_proto",
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
) -> torch.Tensor:
    """Decode and validate a `Tensor` message into a new CPU tensor.

    Args:
        msg: the message.
        field: the request field, for error messages (e.g. "items[3].query").
        ndim: required number of dimensions.
        shape: required sizes; None entries are free.
        dtypes: allowed dtypes (default: all three wire dtypes).

    Raises:
        TensorCodecError naming `field` and what was wrong.
    """
    dtype = dtype_from_proto(msg.dtype, f"{field}.dtype")
    if dtypes is not None and dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TensorCodecError(
            f"{field}: dtype {str(dtype).removeprefix('torch.')} not allowed here; expected {allowed}"
        )
    dims = list(msg.shape)
    check_shape(dims, field, ndim=ndim, shape=shape)
    return tensor_from_bytes(msg.data, dtype, dims, field)


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
