"""Small host-to-host byte copies that keep the GIL, for a worker's hot path.

A round that coalesces several callers (``KVPool.run_round`` with its tensors
in parts) copies a few dozen KB per caller from the caller's shared region into a pinned
staging buffer, and its output rows back into each caller's slot. Done with torch
(``host[a:b].view(shape).copy_(part)``), each copy is three dispatched ops, and the copy
itself releases the GIL: on a worker whose other channel thread is unpickling the next
request, taking the GIL back costs tens of microseconds per op (in a measured coalesced
round the stager's packing was over a third of the round: benchmarks/results/archive/
service-h200.md). A plain ``memmove`` called without releasing the GIL costs about a microsecond
plus the bytes (a 64 KB part: a few microseconds).

Only for small copies (`MAX_HELD_BYTES`): a bulk prefill's megabytes go through torch,
which lets the other threads run meanwhile.
"""

from __future__ import annotations

import ctypes
import logging

import torch

__all__ = ["MAX_HELD_BYTES", "copy_from", "copy_to", "plain_host"]

log = logging.getLogger(__name__)

# Larger copies release the GIL (torch): holding it for a millisecond would stall the
# worker's other threads longer than the release costs this one.
MAX_HELD_BYTES = 1 << 20


def _memmove() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """libc's memmove through ctypes.PyDLL (which does not release the GIL), or None where
    the process's symbols are not reachable that way (then torch copies)."""
    try:
        fn = ctypes.PyDLL(None).memmove
    except (OSError, AttributeError):
        log.info("memmove is not reachable through ctypes; host copies go through torch")
        return None
    fn.restype = ctypes.c_void_p
    fn.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    return fn


_MEMMOVE = _memmove()


def plain_host(t: torch.Tensor) -> bool:
    """Whether `t`'s bytes are ``[data_ptr, data_ptr + nbytes)`` of host memory, each
    element as stored (contiguous, on the CPU, no lazy negation or conjugation): what a
    byte copy may read or write."""
    return t.is_cpu and t.is_contiguous() and not t.is_neg() and not t.is_conj()


def copy_from(address: int, src: torch.Tensor) -> bool:
    """Copy `src`'s bytes to host memory at `address` (the caller's buffer, at least
    ``src.nbytes`` long) with the GIL held, when `src` is small and `plain_host`.

    Returns:
        Whether the bytes were copied; False: nothing was done, the caller copies with
        torch (a large, strided or device tensor, or no memmove here).
    """
    nbytes = src.numel() * src.element_size()
    if _MEMMOVE is None or nbytes > MAX_HELD_BYTES or not plain_host(src):
        return False
    if nbytes:
        _MEMMOVE(address, src.data_ptr(), nbytes)
    return True


def copy_to(dst: torch.Tensor, address: int) -> bool:
    """Copy ``dst.nbytes`` bytes from host memory at `address` into `dst`, with the GIL
    held, when `dst` is small and `plain_host` (else False, nothing done: as `copy_from`)."""
    nbytes = dst.numel() * dst.element_size()
    if _MEMMOVE is None or nbytes > MAX_HELD_BYTES or not plain_host(dst):
        return False
    if nbytes:
        _MEMMOVE(dst.data_ptr(), address, nbytes)
    return True
