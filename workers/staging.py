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

import ctypes
import math
import threading
from collections.abc import Sequence

import torch

from workers.host_bytes import copy_from, copy_to
from workers.parts import joined, joined_shape

__all__ = [
    "HostStager",
    "Staged",
    "attend_inputs",
    "bytes_as",
    "packed_offsets",
    "write_inputs",
]

_ALIGN = 256  # bytes; kernels want 16-byte aligned rows, allocators give 256


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


# A tensor to stage: one tensor, or one given in parts (workers.parts: rows joined on dim 0).
Staged = torch.Tensor | Sequence[torch.Tensor]


def write_inputs(
    slots: torch.Tensor, key: Staged, value: Staged
) -> tuple[torch.Tensor, Staged, Staged]:
    """A write's tensors in the dtypes the kernels take (slots int64)."""
    return slots.to(torch.int64), key, value


def attend_inputs(
    query: Staged,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> tuple[Staged, torch.Tensor, torch.Tensor, torch.Tensor]:
    """An attention call's tensors in the dtypes the kernels take (index tensors int32)."""
    return (
        query,
        block_tables.to(torch.int32),
        seq_lens.to(torch.int32),
        query_start_loc.to(torch.int32),
    )


def _nbytes(t: Staged) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    return sum(p.numel() * p.element_size() for p in t)


def packed_offsets(tensors: Sequence[Staged]) -> tuple[list[int], int]:
    """Byte offsets of ``tensors`` packed one after another (each start aligned to 256
    bytes; a tensor in parts is its parts back to back), and the total bytes: the layout
    :meth:`HostStager.to_device` sends.

    A client's shared region (cache_service.client.shared_memory) lays a call's tensors
    out by the same rule, so decode graphs load them from there in one copy
    (workers.decode_graphs); a test holds the two in step."""
    offsets = []
    total = 0
    for t in tensors:
        offsets.append(total)
        total += _round_up(_nbytes(t), _ALIGN)
    return offsets, total


def bytes_as(
    buffer: torch.Tensor, offset: int, dtype: torch.dtype, shape: Sequence[int]
) -> torch.Tensor:
    """A view of uint8 `buffer` from byte `offset` as a tensor of `dtype` and `shape` (the
    offset a multiple of the dtype's size, as `packed_offsets` gives)."""
    nbytes = math.prod(shape) * dtype.itemsize
    return buffer[offset : offset + nbytes].view(dtype).view(shape)


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
        # Results on their way to callers' parts (to_host_parts); grown on demand.
        self._out_lock = threading.Lock()
        self._out_host = torch.empty(0, dtype=torch.uint8)

    @property
    def max_bytes(self) -> int:
        """The largest request staged in one transfer (larger ones go tensor by tensor)."""
        return self._max_bytes

    def _grow(self, nbytes: int) -> None:
        if self._copied is not None:
            self._copied.synchronize()
        self._host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self._dev = torch.empty(nbytes, dtype=torch.uint8, device=self._device)

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
        dest = self._send(tensors, offsets, total, into)
        return [
            bytes_as(dest, off, t.dtype, t.shape)
            if isinstance(t, torch.Tensor)
            else bytes_as(dest, off, t[0].dtype, joined_shape(t))
            for t, off in zip(tensors, offsets, strict=True)
        ]

    def load(self, tensors: Sequence[Staged], into: torch.Tensor) -> None:
        """:meth:`to_device` into `into` without making the views (the caller has its own,
        as a CUDA graph's static inputs do): a few dispatched ops fewer per call."""
        offsets, total = packed_offsets(tensors)
        self._send(tensors, offsets, total, into)

    def _send(
        self,
        tensors: Sequence[Staged],
        offsets: list[int],
        total: int,
        into: torch.Tensor | None,
    ) -> torch.Tensor:
        """Pack `tensors` at `offsets` in the pinned buffer and start its copy into `into`
        (else the stager's device buffer); returns the buffer copied into."""
        with self._lock:
            if total > self._host.numel():
                self._grow(min(_round_up(total * 2, 1 << 20), max(total, self._max_bytes)))
            elif self._copied is not None:
                self._copied.synchronize()  # the last copy has left the pinned buffer
            dest = self._dev if into is None else into
            host_at = self._host.data_ptr()
            for item, off in zip(tensors, offsets, strict=True):
                at = off
                for t in (item,) if isinstance(item, torch.Tensor) else item:
                    if not copy_from(host_at + at, t):
                        bytes_as(self._host, at, t.dtype, t.shape).copy_(t)
                    at += t.numel() * t.element_size()
            dest[:total].copy_(self._host[:total], non_blocking=True)
            if self._copied is None:
                self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(self._device))
            return dest

    def to_host_parts(
        self,
        source: torch.Tensor,
        parts: Sequence[torch.Tensor],
        flag: torch.Tensor | None = None,
    ) -> bool:
        """Copy a device tensor's rows into host tensors, in order, through a pinned buffer:
        one device-to-host transfer (and the flag's), one wait, then a host copy per part
        (``workers.host_bytes``: no GIL release for small parts). Against a transfer per
        part straight into it, this spares the per-part CUDA calls and folds the flag's
        wait into the copy's.

        Args:
            source: ``[rows, ...]`` on this stager's device, at most :attr:`max_bytes`.
            parts: host tensors of `source`'s dtype and trailing dims, contiguous, whose
                rows add up to `source`'s (validated by the caller:
                ``workers.parts.check_out_parts``).
            flag: a 0-d bool tensor on the device (a call's finite flag): when it reads
                False, the parts are left as they were.

        Returns:
            The flag's value (True without one): whether the parts were written.

        Raises:
            ValueError: `source` is larger than :attr:`max_bytes`.
        """
        nbytes = source.numel() * source.element_size()
        if nbytes > self._max_bytes:
            raise ValueError(
                f"{nbytes} bytes are more than the stager's {self._max_bytes} in one transfer"
            )
        flag_at = _round_up(nbytes, _ALIGN)
        with self._out_lock:
            if flag_at + _ALIGN > self._out_host.numel():
                size = min(
                    _round_up(2 * (flag_at + _ALIGN), 1 << 20),
                    _round_up(self._max_bytes, _ALIGN) + _ALIGN,
                )
                self._out_host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            host = self._out_host
            at = host.data_ptr()
            bytes_as(host, 0, source.dtype, source.shape).copy_(source, non_blocking=True)
            if flag is not None:
                host[flag_at : flag_at + 1].view(torch.bool).copy_(
                    flag.reshape(1), non_blocking=True
                )
            torch.cuda.current_stream(self._device).synchronize()
            if flag is not None and not ctypes.c_bool.from_address(at + flag_at).value:
                return False
            start = 0
            for p in parts:
                if not copy_to(p, at + start):
                    p.copy_(bytes_as(host, start, p.dtype, p.shape))
                start += p.numel() * p.element_size()
            return True
