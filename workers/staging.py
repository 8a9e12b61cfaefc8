"""Moving a request's small host tensors to the GPU in one transfer.

A decode step's request is a handful of small tensors (slots, new keys and values, queries,
block tables, lengths): about 400 KB for 32 sequences of Llama-3-8B. Copied one by one
from pageable memory, each is a synchronous transfer of its own (10-20 us apiece on the
H200 host). :class:`HostStager` packs them into one pinned buffer and sends that with a
single asynchronous copy; the device receives views into one buffer.

Reuse is ordered by the stream: the device buffer is only read by kernels launched after
the copy on the same stream, and the next copy into it is queued behind them. The pinned
buffer is refilled only after the previous copy out of it has finished (a CUDA event).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from workers.parts import joined, joined_shape

__all__ = ["HostStager", "Staged", "packed_offsets"]

_ALIGN = 256  # bytes; kernels want 16-byte aligned rows, allocators give 256


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


# A tensor to stage: one tensor, or one given in parts (workers.parts: rows joined on dim 0).
Staged = torch.Tensor | Sequence[torch.Tensor]


def _nbytes(t: Staged) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    return sum(p.numel() * p.element_size() for p in t)


def packed_offsets(tensors: Sequence[Staged]) -> tuple[list[int], int]:
    """Byte offsets of ``tensors`` packed one after another (each start aligned to 256
    bytes; a tensor in parts is its parts back to back), and the total bytes: the layout
    :meth:`HostStager.to_device` sends.

    A client's shared region (cache_service.client_shared_memory) lays a call's tensors
    out by the same rule, so decode graphs load them from there in one copy
    (workers.decode_graphs); a test holds the two in step."""
    offsets = []
    total = 0
    for t in tensors:
        offsets.append(total)
        total += _round_up(_nbytes(t), _ALIGN)
    return offsets, total


class HostStager:
    """Copies groups of host tensors to one CUDA device in one transfer.

    Args:
        device: the CUDA device the tensors go to.
        initial_bytes: the buffers' first size (they grow to the largest request).
        max_bytes: requests larger than this (bulk prefill writes) are copied tensor by
            tensor instead: the copy time dwarfs the per-copy overhead, and pinning
            hundreds of MB for a rare request is not worth it.

    Thread-safe; the views returned by :meth:`to_device` stay valid until the next call
    (later kernels on the current stream may read them; the host must not keep them).
    """

    def __init__(
        self, device: torch.device, initial_bytes: int = 1 << 20, max_bytes: int = 64 << 20
    ) -> None:
        if device.type != "cuda":
            raise ValueError(f"HostStager moves tensors to a CUDA device, not {device}")
        self._device = device
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._host = torch.empty(0, dtype=torch.uint8)
        self._dev = torch.empty(0, dtype=torch.uint8, device=device)
        self._copied: torch.cuda.Event | None = None
        self._grow(initial_bytes)

    def _grow(self, nbytes: int) -> None:
        if self._copied is not None:
            self._copied.synchronize()
        self._host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self._dev = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
        self._typed: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def to_device(
        self, tensors: Sequence[Staged], into: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """Contiguous device copies of ``tensors`` (same shapes and dtypes), in one copy.

        Args:
            tensors: host tensors of any dtype and shape (need not be contiguous); an item
                may be a tensor in parts (a sequence of tensors of one dtype and trailing
                shape, validated by the caller: ``workers.parts.stand_in``), which arrives
                as one tensor of their rows.
            into: a uint8 device buffer of at least the packed size
                (:func:`packed_offsets`) to copy into instead of the stager's own, e.g. the
                static inputs of a CUDA graph; then the views are into it and stay valid.

        Returns:
            Views into the device buffer, one per input (into the stager's own: valid until
            the next call).
        """
        offsets, total = packed_offsets(tensors)
        if total > self._max_bytes and into is None:
            return [joined(t).to(self._device) for t in tensors]
        with self._lock:
            if total > self._host.numel():
                self._grow(min(_round_up(total * 2, 1 << 20), max(total, self._max_bytes)))
            elif self._copied is not None:
                self._copied.synchronize()  # the last copy has left the pinned buffer
            dest = self._dev if into is None else into
            out = []
            for item, off in zip(tensors, offsets, strict=True):
                if isinstance(item, torch.Tensor):
                    parts, shape = (item,), item.shape
                else:
                    parts, shape = item, joined_shape(item)
                host, dev = self._views(parts[0].dtype)
                size = parts[0].element_size()
                start = end = off // size
                for t in parts:
                    host[end : end + t.numel()].view(t.shape).copy_(t)
                    end += t.numel()
                if into is not None:
                    dev = into[: end * size].view(parts[0].dtype)
                out.append(dev[start:end].view(shape))
            dest[:total].copy_(self._host[:total], non_blocking=True)
            if self._copied is None:
                self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(self._device))
            return out

    def _views(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The host and device buffers seen as ``dtype`` (made once per buffer and dtype)."""
        views = self._typed.get(dtype)
        if views is None:
            views = self._typed[dtype] = (self._host.view(dtype), self._dev.view(dtype))
        return views
