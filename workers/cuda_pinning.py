"""Page-locking host memory torch did not allocate (a client's shared-memory region, a
worker channel's arena) for CUDA, so a GPU pool in the same process copies request tensors
straight out of it.

A region registered with ``cudaHostRegister`` is pinned memory to CUDA: a host-to-device
copy from it is one asynchronous DMA, where pageable memory costs a staging copy on the
CPU first (about 40-80 us per 400 KB request on the H200 host). Registering pins every page
of the region (milliseconds for hundreds of MB): done once, when the region is created.

Every registration is also recorded in `workers.pinned_ranges.REGISTERED` (added after it
succeeded, removed before it is undone), so a pool tells a view of the region is pinned
without asking the driver per call (``Tensor.is_pinned()``).
"""

from __future__ import annotations

import logging

import torch

from workers.pinned_ranges import REGISTERED

__all__ = ["pin", "unpin"]

log = logging.getLogger("kvcache.cuda_pinning")


def _number(code: object) -> int:
    """A cudart return code as its number (the binding's enum names only some)."""
    return int(getattr(code, "value", code))  # type: ignore[call-overload]


def pin(buffer: torch.Tensor) -> bool:
    """Register the host memory under `buffer` (uint8, contiguous, CPU) with CUDA.

    Returns:
        Whether it worked; False (logged) when CUDA is absent or refuses (e.g. a file
        system whose pages cannot be locked): the memory then stays pageable, which is
        slower but correct.
    """
    if not torch.cuda.is_available() or buffer.numel() == 0:
        return False
    try:
        code = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)
    except Exception:  # pragma: no cover - a torch without the binding
        log.warning("cudaHostRegister is unavailable; shared memory stays pageable")
        return False
    if _number(code) != 0:
        # e.g. a region on a disk file system: Linux pins only memory-backed file pages
        # (tmpfs such as /dev/shm) for long.
        log.warning(
            "cudaHostRegister refused a shared-memory file (CUDA error %d); it stays pageable",
            _number(code),
        )
        return False
    REGISTERED.add(buffer.data_ptr(), buffer.numel())
    return True


def unpin(buffer: torch.Tensor) -> None:
    """Undo :func:`pin` (before the memory is unmapped); failures are logged."""
    # Forgotten first: from here on a pool asks the driver, which still says pinned until
    # the unregistration below, never the other way round.
    REGISTERED.remove(buffer.data_ptr())
    try:
        code = torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
    except Exception:  # pragma: no cover - CUDA gone at shutdown
        log.warning("cudaHostUnregister failed", exc_info=True)
        return
    if _number(code) != 0:
        log.warning(
            "cudaHostUnregister refused a shared-memory file (CUDA error %d)", _number(code)
        )
