"""Device-side waits on and writes of 32-bit counters in GPU memory (the CUDA driver's stream
memory operations), which order two processes' streams without either host waiting.

A lease connection (`workers.lease_server` and its client) keeps one counter on each side:
the client's stream writes the worker's *ready* counter after its inputs are in place and
waits for its own *done* counter, which the worker's stream writes after the layer's
kernels. Both calls only enqueue (a few microseconds of host time each); a wait compares
cyclically, so counters may wrap.

They are ``cuStreamWaitValue32`` / ``cuStreamWriteValue32`` through ctypes: torch exposes
no binding. :func:`available` says whether this process's driver offers them.
"""

from __future__ import annotations

import ctypes
import functools

import torch

__all__ = ["StreamValuesUnavailable", "available", "wait", "write"]

# cuStreamWaitValue32 flags: wait until (int32)(*addr - value) >= 0.
_WAIT_GEQ = 0x0
# cuStreamWriteValue32 flags: the default, whose memory fence makes the stream's earlier
# writes visible before the value.
_WRITE_DEFAULT = 0x0


class StreamValuesUnavailable(RuntimeError):
    """The CUDA driver offers no stream memory operations (or there is no driver)."""


@functools.cache
def _driver() -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr]:  # type: ignore[name-defined]
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise StreamValuesUnavailable(f"no CUDA driver library: {exc}") from None
    functions = []
    for name in ("cuStreamWaitValue32", "cuStreamWriteValue32"):
        fn = getattr(cuda, name + "_v2", None) or getattr(cuda, name, None)
        if fn is None:
            raise StreamValuesUnavailable(f"the CUDA driver has no {name} (CUDA 11.7 or newer)")
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        fn.restype = ctypes.c_int
        functions.append(fn)
    return functions[0], functions[1]


def available() -> bool:
    """Whether this process can enqueue stream memory operations."""
    try:
        _driver()
    except StreamValuesUnavailable:
        return False
    return True


def wait(stream: torch.cuda.Stream, counter: torch.Tensor, value: int) -> None:
    """Make `stream`'s later work wait until the int32 `counter` (one element of device
    memory, possibly another process's, mapped here) reaches `value` (cyclically).

    Raises:
        StreamValuesUnavailable: no driver support; RuntimeError: the driver refused.
    """
    _check(_driver()[0](stream.cuda_stream, counter.data_ptr(), value & 0xFFFFFFFF, _WAIT_GEQ))


def write(stream: torch.cuda.Stream, counter: torch.Tensor, value: int) -> None:
    """Write `value` into the int32 `counter` once `stream`'s earlier work is done (and
    visible).

    Raises:
        StreamValuesUnavailable: no driver support; RuntimeError: the driver refused.
    """
    _check(_driver()[1](stream.cuda_stream, counter.data_ptr(), value & 0xFFFFFFFF, _WRITE_DEFAULT))


def _check(result: int) -> None:
    if result != 0:
        raise RuntimeError(f"a CUDA stream memory operation failed (CUresult {result})")
