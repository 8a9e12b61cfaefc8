"""Pool tensors that another process of this host can map: the memory a co-located client
writes and reads a leased step in (`workers.lease_server`, `workers.lease_client`).

On a GPU the pool is ordinary device memory, mapped elsewhere through a CUDA IPC handle
(torch's reduction of a CUDA tensor: the allocation's handle, the offset and the size).
On a CPU the pool lives in an anonymous memory file (``memfd_create``) mapped shared, so a
second process that receives the file's descriptor (``SCM_RIGHTS`` over a Unix socket)
maps the very pages; without ``memfd_create`` (not Linux) a CPU tensor is plain memory
and cannot be shared.

A process that maps a tensor gets no more than it could take already: the lease socket's
folder is reachable only by the worker's user, whose processes may read the worker's
memory anyway.
"""

from __future__ import annotations

import math
import os
import weakref
from dataclasses import asdict, dataclass
from typing import Any

import torch

__all__ = ["Exported", "allocate", "export", "map_exported"]

# Base tensors allocated by `allocate` in a memory file -> (the file's descriptor, bytes).
_FILES: dict[int, tuple[int, int]] = {}


@dataclass(frozen=True)
class Exported:
    """How another process maps one tensor.

    Attributes:
        kind: "cuda" (CUDA IPC) or "memfd" (the descriptor travels beside the message).
        shape: the tensor's shape; dtype: its dtype's name ("bfloat16").
        handle: hex of the CUDA IPC pickle ("cuda"), else "".
        nbytes: the memory file's size ("memfd"), else 0.
    """

    kind: str
    shape: tuple[int, ...]
    dtype: str
    handle: str = ""
    nbytes: int = 0

    def as_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Exported:
        return cls(**{**d, "shape": tuple(d["shape"])})


def allocate(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, fill: float = 0.0
) -> torch.Tensor:
    """A contiguous tensor filled with `fill` that `export` can share: on CPU (Linux) in a
    memory file, elsewhere as `torch.full` makes it.

    Raises:
        torch.OutOfMemoryError / OSError: no room.
    """
    if device.type != "cpu" or not hasattr(os, "memfd_create"):
        return torch.full(shape, fill, dtype=dtype, device=device)
    nbytes = max(1, math.prod(shape) * dtype.itemsize)
    fd = os.memfd_create("kvcache-pool", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        flat = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8)
    except BaseException:
        os.close(fd)
        raise
    tensor = flat[: math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
    if fill != 0.0:  # a fresh memory file reads as zeros
        tensor.fill_(fill)
    _FILES[id(tensor)] = (fd, nbytes)
    weakref.finalize(tensor, _close, id(tensor))
    return tensor


def _register_cuda_reduction() -> None:
    """torch.multiprocessing registers the CUDA tensor reduction when imported."""
    from torch import multiprocessing  # noqa: F401


def _close(key: int) -> None:
    fd, _ = _FILES.pop(key, (-1, 0))
    if fd >= 0:
        os.close(fd)


def export(tensor: torch.Tensor) -> tuple[Exported, list[int]]:
    """How another process maps `tensor` (one `allocate` made), and the descriptors to send
    beside it (SCM_RIGHTS; empty on CUDA).

    Raises:
        ValueError: a CPU tensor not in a memory file (not made by `allocate`, or on a
            system without ``memfd_create``).
    """
    dtype = str(tensor.dtype).removeprefix("torch.")
    shape = tuple(tensor.shape)
    if tensor.device.type == "cuda":
        from multiprocessing.reduction import ForkingPickler

        _register_cuda_reduction()

        return Exported("cuda", shape, dtype, bytes(ForkingPickler.dumps(tensor)).hex()), []
    entry = _FILES.get(id(tensor))
    if entry is None:
        raise ValueError("this CPU tensor is not in a memory file: another process cannot map it")
    fd, nbytes = entry
    return Exported("memfd", shape, dtype, nbytes=nbytes), [fd]


def map_exported(exported: Exported, fds: list[int], device: torch.device) -> torch.Tensor:
    """The tensor `exported` describes, mapped into this process (`fds`: the descriptors
    that came with it, closed here once mapped).

    Raises:
        ValueError: a description this process cannot map (a GPU pool for CPU tensors, a
            memory file without its descriptor).
    """
    dtype = getattr(torch, exported.dtype)
    if exported.kind == "cuda":
        if device.type != "cuda":
            raise ValueError("the worker's pool is on a GPU and the caller's tensors are not")
        from multiprocessing.reduction import ForkingPickler

        _register_cuda_reduction()

        return ForkingPickler.loads(bytes.fromhex(exported.handle))
    if exported.kind != "memfd" or len(fds) != 1:
        raise ValueError(f"cannot map a {exported.kind!r} tensor with {len(fds)} descriptors")
    try:
        flat = torch.from_file(
            f"/proc/self/fd/{fds[0]}", shared=True, size=exported.nbytes, dtype=torch.uint8
        )
    finally:
        os.close(fds[0])
    count = math.prod(exported.shape) * dtype.itemsize
    return flat[:count].view(dtype).view(exported.shape)
