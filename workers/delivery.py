"""A pool call's results as its caller gets them, and the check_finite guard.

:class:`Delivery` hands an attention result over: on the pool's device (copied when it lives
in a CUDA graph's memory), or on the host in pinned memory with one wait, optionally into
memory the caller gave (one tensor, or parts: :mod:`workers.parts`). The check_finite flag
is made on the device with the write (:func:`guard_finite`) and read at delivery
(:func:`refuse_non_finite`), before anything reaches the caller's memory, so a refused call
leaves it as it was.
"""

from __future__ import annotations

import math

import torch

from workers.checks import AttendOptions
from workers.errors import NonFiniteInput
from workers.parts import TensorParts, fill
from workers.pinned_ranges import REGISTERED
from workers.staging import HostStager

__all__ = [
    "AttendResult",
    "Delivery",
    "PartsResult",
    "all_finite_on_host",
    "guard_finite",
    "host_out",
    "is_pinned_host",
    "refuse_non_finite",
]

AttendResult = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
# An output delivered in parts (a round's `out` in parts), with the LSE if asked.
PartsResult = TensorParts | tuple[TensorParts, torch.Tensor]
# What the write-and-attend bodies return: (out, lse or None, finite flag or None).
Done = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def guard_finite(
    slots: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query: torch.Tensor,
    check_finite: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """With `check_finite`, the slots masked to -1 (skipped by the write) unless every
    value of key, value and query is finite, and that flag (a 0-d bool tensor on the
    device, read once the call's results are on the host); else the slots as given."""
    if not check_finite or slots.numel() == 0:
        return slots, None
    total = _float64_total((key, value, query))
    if total is None:
        finite = torch.isfinite(key).all() & torch.isfinite(value).all()
        finite &= torch.isfinite(query).all()
    else:
        finite = (total - total) == 0  # inf - inf and NaN - NaN are NaN
    return torch.where(finite, slots, -1), finite


def all_finite_on_host(key: torch.Tensor, value: torch.Tensor, query: torch.Tensor) -> bool:
    """Whether every value of key, value and query is finite, read at once: for CPU
    tensors, where reading costs nothing and a flag kept on the device would cost the
    operations of :func:`guard_finite`."""
    total = _float64_total((key, value, query))
    if total is None:
        return all(bool(torch.isfinite(t).all()) for t in (key, value, query))
    return math.isfinite(total.item())


def _float64_total(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
    """The float64 sum of every value of `tensors` (0-d, on their device), non-finite
    exactly when one of them is; None for float64 inputs, whose sum could overflow.

    One sum each instead of an isfinite (four operations in torch) and an all: a NaN or
    an infinity makes the float64 total non-finite, and finite float32 values cannot
    overflow it (2**20 rows of 2**14 elements of 2**128 stay below 2**162)."""
    if any(t.dtype == torch.float64 for t in tensors):
        return None
    span = _adjacent_span(tensors)
    if span is not None:  # a lease client's staging: the three in one sum
        return span.sum(dtype=torch.float64)
    total = tensors[0].sum(dtype=torch.float64)
    for t in tensors[1:]:
        total += t.sum(dtype=torch.float64)
    return total


def _adjacent_span(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
    """One 1-D view of `tensors` when they lie back to back in one storage (each
    contiguous, of one dtype, each starting where the one before ends), else None."""
    first = tensors[0]
    dtype, storage = first.dtype, first.untyped_storage()
    end = first.data_ptr()
    for t in tensors:
        if (
            t.dtype != dtype
            or t.data_ptr() != end
            or not t.is_contiguous()
            or t.untyped_storage().data_ptr() != storage.data_ptr()
        ):
            return None
        end += t.numel() * t.element_size()
    return first.new_empty(0).set_(
        storage, first.storage_offset(), ((end - first.data_ptr()) // first.element_size(),)
    )


def refuse_non_finite(finite: torch.Tensor | bool) -> None:
    """NonFiniteInput unless the call's flag (:func:`guard_finite`, or its value read on
    the host) says every value was finite (reading a device flag waits for the device; the
    write was masked otherwise)."""
    if not bool(finite):
        raise NonFiniteInput(
            "the key, value or query holds NaN or infinite values; nothing was written"
        )


def is_pinned_host(t: torch.Tensor) -> bool:
    """``t.device.type == "cpu" and t.is_pinned()``, answered from the registrations the
    process made itself (`workers.pinned_ranges.REGISTERED`: the shared regions) when
    `t`'s bytes lie in one, without the driver call ``is_pinned()`` makes; other tensors
    are asked the driver. A registered range is exact (its owner removes it before
    unregistering), and a wrong answer would only cost speed (see that module)."""
    if not t.is_cpu:
        return False
    nbytes = t.nbytes
    # Contiguous: its bytes are [data_ptr, data_ptr + nbytes). (Empty: the driver is asked.)
    if nbytes and t.is_contiguous() and REGISTERED.covers(t.data_ptr(), nbytes):
        return True
    return t.is_pinned()


def host_out(
    out: torch.Tensor | None, to_host: bool, dtype: torch.dtype, shape: torch.Size
) -> torch.Tensor | None:
    """`out` when the output can be copied straight into it (a host result asked for, and
    `out` contiguous host memory of the output's dtype and shape); else None."""
    if out is not None and not (
        to_host
        and out.device.type == "cpu"
        and out.dtype == dtype
        and out.shape == shape
        and out.is_contiguous()
    ):
        return None
    return out


class Delivery:
    """Results of one pool's calls handed to their caller.

    Args:
        device: the pool's device.
        stager: the pool's host stager (a GPU pool), whose pinned buffer brings an output
            in parts back in one transfer; None on CPU.
    """

    def __init__(self, device: torch.device, stager: HostStager | None) -> None:
        self._device = device
        self._stager = stager

    def pinned_host(self, *tensors: torch.Tensor) -> bool:
        """Whether a GPU pool's inputs all lie in the caller's page-locked host memory (a
        shared region the server registered with CUDA): then they go to the device by DMA
        straight from there, with no staging copy on the CPU, and the call must not
        return before those copies are done (:meth:`deliver`'s `wait`)."""
        return self._stager is not None and all(is_pinned_host(t) for t in tensors)

    def finish(
        self,
        done: Done,
        options: AttendOptions,
        to_host: bool,
        *,
        owned: bool = True,
        wait: bool = False,
        out: torch.Tensor | TensorParts | None = None,
    ) -> AttendResult | PartsResult:
        """:meth:`deliver` of a write-and-attend body's (out, lse, finite flag)."""
        got, lse, finite = done
        result = (got, lse) if options.return_lse else got
        return self.deliver(result, to_host, owned=owned, wait=wait, out=out, finite=finite)

    def deliver(
        self,
        result: AttendResult,
        to_host: bool,
        *,
        owned: bool = True,
        wait: bool = False,
        out: torch.Tensor | TensorParts | None = None,
        finite: torch.Tensor | None = None,
    ) -> AttendResult | PartsResult:
        """An attention result as the caller gets it: on the host in pinned memory (one
        copy each and one wait; `to_host`; the output into `out` when given: a list takes
        the output's rows part by part, and the result holds that list), else on the
        device, copied when not `owned` (a graph's memory, which the next replay
        overwrites). `wait`: the call's inputs are still being copied out of the caller's
        pinned memory (:meth:`pinned_host`), so the call does not return before the device
        is done with them. `finite`: the call's flag from :func:`guard_finite`; False
        raises NonFiniteInput, read before anything reaches `out` (a refused call leaves
        the caller's memory as it was)."""
        if type(out) is list:
            return self._deliver_parts(result, out, finite)
        tensors = result if isinstance(result, tuple) else (result,)
        if finite is not None and out is not None:
            # Waits for the flag before `out` is touched; the copy into `out` then waits
            # again. Kept as two: the flag is known only once the call's kernels ran, and
            # the copy may start only after it is. One wait would mean copying the output
            # elsewhere (pinned staging) and then into `out` on the CPU: a host copy of
            # the whole output for one wait, no clear gain.
            refuse_non_finite(finite)
            finite = None
        if out is not None:
            # The output straight into the caller's memory (run_round checked it).
            out.copy_(tensors[0], non_blocking=True)
            tensors = (out, *tensors[1:])
            owned = True
        if to_host and self._device.type == "cuda":
            host = [] if out is None else [out]
            for t in tensors[len(host) :]:
                h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                h.copy_(t, non_blocking=True)
                host.append(h)
            torch.cuda.current_stream(self._device).synchronize()
            tensors = tuple(host)
        else:
            if not owned:
                tensors = tuple(t.clone() for t in tensors)
            if wait:
                torch.cuda.current_stream(self._device).synchronize()
        if finite is not None:
            refuse_non_finite(finite)
        return tensors if isinstance(result, tuple) else tensors[0]  # type: ignore[return-value]

    def _deliver_parts(
        self, result: AttendResult, out: TensorParts, finite: torch.Tensor | None
    ) -> PartsResult:
        """:meth:`deliver` of an output in parts: the flag read first (a refused call leaves
        `out` as it was), then each part's rows copied into its part of `out`, the LSE (if
        any) to the host, one wait. A GPU pool's output without LSE goes through the
        stager's pinned buffer (`HostStager.to_host_parts`: one transfer with the flag, one
        wait, host copies)."""
        got, lse = result if isinstance(result, tuple) else (result, None)
        stager = self._stager
        if (
            lse is None
            and stager is not None
            and got.is_cuda
            and got.numel() * got.element_size() <= stager.max_bytes
        ):
            # One transfer and one wait for the rows and the flag, then host copies.
            refuse_non_finite(stager.to_host_parts(got, out, finite))
            return out
        if finite is not None:
            refuse_non_finite(finite)
        fill(out, got)
        if lse is not None:
            lse = lse.to("cpu", non_blocking=self._device.type == "cuda")
        if self._device.type == "cuda":
            torch.cuda.current_stream(self._device).synchronize()
        return out if lse is None else (out, lse)
