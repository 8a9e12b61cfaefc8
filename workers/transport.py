"""Cheap torch tensors across the Ray actor boundary.

Ray pickles a ``torch.Tensor`` in-band (through torch's own storage pickling, with several
copies), but sends numpy arrays out-of-band: zero-copy into and out of the object store.
:func:`pack` wraps a host tensor as a :class:`PackedTensor` holding a flat ``uint8`` numpy
view of its bytes (bfloat16 has no numpy dtype) plus its dtype name and shape. Pickling a
PackedTensor ships that array out-of-band and rebuilds a plain ``torch.Tensor`` on the
receiving side, so whoever receives it (an actor method, ``ray.get``, another actor handed
the ObjectRef) sees a torch tensor and needs no call to :func:`unpack`; :func:`unpack` is
for a PackedTensor that never left the process (it passes anything else through).

``readonly=True`` (the sender's promise that the receiver only reads the tensor: the
actor's inputs, exported blocks on their way to ``import_blocks``) lets the receiver view
the object store's read-only buffer without a copy. Otherwise a read-only buffer is copied
once on arrival, so the tensor can be written. Never write to a ``readonly`` tensor.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

__all__ = [
    "PackedTensor",
    "dtype_name",
    "dtype_named",
    "pack",
    "pack_result",
    "unpack",
]

_DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
    )
}


def dtype_name(dtype: torch.dtype) -> str:
    """``dtype``'s name as messages carry it ("bfloat16", "int32", ...).

    Raises:
        TypeError: a dtype no message carries.
    """
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise TypeError(f"tensors of dtype {dtype} cannot be sent to a worker")
    return name


def dtype_named(name: str) -> torch.dtype:
    """The dtype :func:`dtype_name` named ``name``.

    Raises:
        TypeError: not such a name.
    """
    dtype = _DTYPES.get(name)
    if dtype is None:
        raise TypeError(f"no tensor dtype is named {name!r}")
    return dtype


class PackedTensor:
    """A host tensor as raw bytes (``uint8`` numpy array), dtype name and shape.

    Unpickles as a ``torch.Tensor`` (see the module docstring).
    """

    __slots__ = ("data", "dtype", "readonly", "shape")

    def __init__(
        self, data: np.ndarray, dtype: str, shape: tuple[int, ...], readonly: bool
    ) -> None:
        self.data = data
        self.dtype = dtype
        self.shape = shape
        self.readonly = readonly

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _rebuild, (self.data, self.dtype, self.shape, self.readonly)

    def __repr__(self) -> str:
        return f"PackedTensor(dtype={self.dtype}, shape={self.shape}, readonly={self.readonly})"


def pack(t: torch.Tensor, *, readonly: bool = False) -> PackedTensor:
    """``t`` (any device, any strides) as a :class:`PackedTensor`.

    A contiguous host tensor is viewed, not copied (do not change it before the call it
    goes out with is submitted); others are copied to a contiguous host tensor first.

    Raises:
        TypeError: ``t`` is not a tensor or its dtype is not supported.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"pack expects a torch.Tensor, got {type(t).__name__}")
    name = dtype_name(t.dtype)
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy() if flat.numel() else np.empty(0, np.uint8)
    return PackedTensor(data, name, tuple(t.shape), readonly)


def pack_result(value: Any, *, readonly: bool = False) -> Any:
    """``value`` with every tensor in it (itself, or the items of a tuple/list) packed."""
    if isinstance(value, torch.Tensor):
        return pack(value, readonly=readonly)
    if type(value) in (tuple, list):
        return type(value)(pack_result(v, readonly=readonly) for v in value)
    return value


def unpack(obj: Any) -> Any:
    """The torch tensor of a :class:`PackedTensor` that was not pickled; anything else
    (already a tensor after crossing Ray, a list of ints, None) as it is."""
    if isinstance(obj, PackedTensor):
        return _rebuild(obj.data, obj.dtype, obj.shape, obj.readonly)
    return obj


def _rebuild(data: np.ndarray, dtype: str, shape: tuple[int, ...], readonly: bool) -> torch.Tensor:
    target = _DTYPES[dtype]
    if data.size == 0:
        return torch.empty(shape, dtype=target)
    if not data.flags.writeable:
        if readonly:
            with warnings.catch_warnings():
                # torch warns that writing would be undefined; the sender promised no writes.
                warnings.simplefilter("ignore", UserWarning)
                raw = torch.from_numpy(data)
        else:
            raw = torch.from_numpy(data.copy())
    else:
        raw = torch.from_numpy(data)
    return raw.view(target).reshape(shape)
