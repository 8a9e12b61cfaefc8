"""A forward's integer inputs (token ids, the mask's new columns, position ids) read on
the host, which plans the step from them.

Each forward of a model generating through the service reads a few small integer tensors
from its device. Read one by one (``.cpu()`` each) that is a wait for the device per
tensor; joined on the device first (cast, flatten, concatenate, then split and cast
back on the host) it is one wait but about a dozen dispatched operations per forward. Here
each tensor is copied straight into its place in one page-locked buffer kept by the
session (an asynchronous copy each, no staging through pageable memory) and the host
waits once, on an event recorded after the last.
"""

from __future__ import annotations

import torch

__all__ = ["InputReader"]


class InputReader:
    """Reads integer tensors to the host for one session, through a page-locked buffer it
    keeps (grown when a forward needs more). Not thread-safe: one session's forwards run
    one at a time."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self._done: torch.cuda.Event | None = None

    def read(self, *tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        """`tensors` (integer, any shapes; None passes through) on the host, detached, in
        their shapes and dtypes. Those already on the host are returned as they are;
        those on one CUDA device come back as views of the reader's buffer (int64 ones)
        valid until the next :meth:`read`: use them, or clone them, before. Tensors on
        another kind of device, or on several, are copied one by one."""
        moved = [t for t in tensors if t is not None and t.device.type != "cpu"]
        if not moved:
            return tuple(None if t is None else t.detach() for t in tensors)
        device = moved[0].device
        if device.type != "cuda" or any(t.device != device for t in moved):
            return tuple(None if t is None else t.detach().cpu() for t in tensors)
        buffer = self._pinned(sum(t.numel() for t in moved))
        places: list[torch.Tensor | None] = []
        at = 0
        for t in tensors:
            if t is None or t.device.type == "cpu":
                places.append(None if t is None else t.detach())
                continue
            n = t.numel()
            # A cast on the device first (a kernel), so the copy itself is a plain DMA.
            source = t.detach() if t.dtype == torch.long else t.detach().to(torch.long)
            place = buffer[at : at + n].view(t.shape)
            place.copy_(source, non_blocking=True)
            places.append(place)
            at += n
        if self._done is None:
            self._done = torch.cuda.Event()
        self._done.record(torch.cuda.current_stream(device))
        self._done.synchronize()
        return tuple(
            p if p is None or t is None or p.dtype == t.dtype else p.to(t.dtype)
            for p, t in zip(places, tensors, strict=True)
        )

    def _pinned(self, numel: int) -> torch.Tensor:
        """The buffer, at least `numel` int64 long (a power of two: few regrowths)."""
        if self._buffer is None or self._buffer.numel() < numel:
            size = 1 << max(6, (numel - 1).bit_length())
            self._buffer = torch.empty(size, dtype=torch.long, pin_memory=True)
        return self._buffer
