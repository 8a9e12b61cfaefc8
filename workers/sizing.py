"""Where a pool lives and how many blocks it gets: from a count, or from a fraction of free
device memory."""

from __future__ import annotations

import os

import torch

from workers.config import PoolConfig
from workers.errors import PoolAllocationError

__all__ = ["blocks_for_fraction", "free_device_bytes", "resolve_device", "resolve_num_blocks"]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``device`` as a torch device; None picks the current CUDA device if any, else CPU.

    A bare "cuda" becomes "cuda:<current>", so the pool reports the GPU it really uses.

    Raises:
        PoolAllocationError: CUDA asked for but not available, or another device type.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise PoolAllocationError(f"device {device!r} asked for, but CUDA is not available")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise PoolAllocationError(f"pools live on 'cuda' or 'cpu' devices, got {device!r}")
    return dev


def blocks_for_fraction(free_bytes: int, fraction: float, bytes_per_block: int) -> int:
    """Whole blocks that fit in ``fraction`` of ``free_bytes`` (bytes); may be 0."""
    return int(free_bytes * fraction) // bytes_per_block


def free_device_bytes(device: torch.device) -> int:
    """Free memory of ``device`` in bytes: CUDA's free memory, or available host RAM on CPU."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "cpu":
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    raise PoolAllocationError(f"pools live on 'cuda' or 'cpu' devices, got {device}")


def resolve_num_blocks(config: PoolConfig, device: torch.device) -> int:
    """The pool size in blocks for ``config`` on ``device``.

    Raises:
        PoolAllocationError: the pool does not fit in the device's free memory, or the
            fraction leaves less than one block. The message gives the figures.
    """
    per_block = config.layout.bytes_per_block
    free = free_device_bytes(device)
    if config.memory_fraction is not None:
        blocks = blocks_for_fraction(free, config.memory_fraction, per_block)
        if blocks < 1:
            raise PoolAllocationError(
                f"memory_fraction={config.memory_fraction} of the {free} free bytes on {device} "
                f"is less than one block of {per_block} bytes"
            )
        return blocks
    assert config.num_blocks is not None  # PoolConfig guarantees exactly one is set
    needed = config.num_blocks * per_block
    if needed > free:
        raise PoolAllocationError(
            f"a pool of {config.num_blocks} blocks x {per_block} bytes = {needed} bytes does not "
            f"fit in the {free} bytes free on {device}; at most {free // per_block} blocks fit"
        )
    return config.num_blocks
