"""Low-overhead launches of compiled Triton kernels.

Triton's ``kernel[grid](...)`` binds and specializes every argument on every call: tens
of microseconds of host time for a kernel with ~35 arguments (Triton 3.6 on the H200 host:
benchmarks/results/archive/notes-kernels.md), longer than a decode kernel at small batch,
so the GPU waits for the host. `CachedLauncher` does that work once per specialization.
It keys a call by what Triton specializes on (each tensor's dtype and 16-byte alignment;
each integer being 1, a multiple of 16, or outside int32; the compile-time constants and
launch options), launches through the JIT the first time and keeps the compiled kernel it
returns, and afterwards calls the compiled kernel's launcher directly with the same
arguments.

Two calls with the same key get the same compiled kernel from Triton too, so the direct
launch runs exactly the binary the JIT would have chosen. Under the interpreter, with a
launch hook installed (profilers), or if this Triton's compiled kernels lack the expected
interface, every call goes through the JIT.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["CachedLauncher", "DirectLaunch", "current_stream_handle", "hooks_installed"]

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def _arg_key(arg: Any) -> Any:
    """What Triton's specialization sees of one runtime argument."""
    kind = type(arg)
    if kind is torch.Tensor or isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if kind is int:
        return (int, arg == 1, arg % 16 == 0, _INT32_MIN <= arg <= _INT32_MAX)
    if kind is float:
        return float
    # Anything else (bool, None, ...) keys by value: rare, and always correct.
    return (type(arg), arg)


def _stream_of(device: int) -> int:
    """The raw handle of the current CUDA stream of device ``device`` (an index)."""
    return torch.cuda.current_stream(device).cuda_stream


# Triton's own launch reads the stream through this private torch call (a fraction of a
# microsecond, against several for building a torch Stream object); fall back if it moves.
current_stream_handle = getattr(torch._C, "_cuda_getCurrentRawStream", _stream_of)


try:
    from triton import knobs as _knobs
except ImportError:  # an older Triton without knobs: every launch through the JIT
    _knobs = None


def hooks_installed() -> bool:
    """Whether a launch hook (a profiler's) wants to see every launch.

    Triton 3.6 keeps the hooks in a chain object that is never None; an empty chain means
    no hook.
    """
    if _knobs is None:
        return True
    hook = _knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


class CachedLauncher:
    """Launches one ``@triton.jit`` function with the per-call binding done once per key.

    Args:
        fn: the JIT function. Calls must pass every runtime argument positionally (in the
            kernel's parameter order) and every ``tl.constexpr`` parameter by keyword, so
            the direct launch can rebuild the full argument list.
    """

    def __init__(self, fn: Any) -> None:
        self._fn = fn
        self._compiled: dict[tuple[Any, ...], DirectLaunch] = {}
        self._direct = not self.interpreted()

    @staticmethod
    def interpreted() -> bool:
        """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``)."""
        if _knobs is None:
            return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
        return bool(_knobs.runtime.interpret)

    @property
    def direct(self) -> bool:
        """Whether calls may skip the JIT (compiled kernels, no interpreter): only then may a
        caller keep a :class:`DirectLaunch` of a compiled kernel."""
        return self._direct

    def __call__(
        self,
        grid: tuple[int, int, int],
        args: Sequence[Any],
        constexprs: Mapping[str, Any],
        **options: Any,
    ) -> DirectLaunch | None:
        """Launch on the current CUDA device and stream.

        Args:
            grid: programs along each axis, three ints.
            args: runtime arguments, in parameter order.
            constexprs: compile-time parameters by name (all of them).
            options: launch options (``num_warps``, ``num_stages``, ``launch_pdl``...).

        Returns:
            The compiled kernel this call ran, ready to be launched again directly with
            arguments of the same specialization; None when the call went through the JIT
            without one (interpreter, a launch hook, an unknown interface).
        """
        if not self._direct or hooks_installed():
            self._fn[grid](*args, **constexprs, **options)
            return None
        device = torch.cuda.current_device()
        # Constexpr names are fixed per call site, so their values suffice in the key.
        key = (device, *map(_arg_key, args), *constexprs.values(), *options.items())
        launch = self._compiled.get(key)
        if launch is None:
            kernel = self._fn[grid](*args, **constexprs, **options)
            if hasattr(kernel, "result"):  # an asynchronous compile's future
                kernel = kernel.result()
            if not all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata")):
                self._direct = False  # not the compiled-kernel interface this was built on
                return None
            names = list(self._fn.arg_names)
            if names[len(args) :] != list(constexprs):
                raise TypeError(
                    f"{self._fn.__name__}: pass runtime arguments positionally and the "
                    f"constexprs {names[len(args) :]} by keyword, in order"
                )
            launch = DirectLaunch(kernel)
            self._compiled[key] = launch
            return launch
        launch.run(*grid, current_stream_handle(device), *launch.head, *args, *constexprs.values())
        return launch


class DirectLaunch:
    """One compiled kernel, launched without the JIT.

    ``run(grid_x, grid_y, grid_z, stream, *head, *args, *constexpr_values)`` launches it:
    ``args`` are the runtime arguments in parameter order (tensors, or their ``data_ptr()``
    as ints, which skips the launcher's per-pointer ``data_ptr`` call and device-pointer
    query), then every constexpr's value. The caller must pass arguments of the
    specialization the kernel was compiled for (see :class:`CachedLauncher`).
    """

    __slots__ = ("head", "run")

    def __init__(self, kernel: Any) -> None:
        runner = kernel.run
        # The compiled function, its launch metadata and three unused hook slots.
        self.run = runner
        self.head = (kernel.function, kernel.packed_metadata, None, None, None)
        if (
            callable(getattr(runner, "launch", None))
            and getattr(runner, "global_scratch_size", None) == 0
            and getattr(runner, "profile_scratch_size", None) == 0
            and hasattr(runner, "launch_cooperative_grid")
            and hasattr(runner, "launch_pdl")
        ):
            # Triton's CUDA launcher object only allocates scratch memory (none here) and
            # passes its flags on to its C launch: call that directly, one Python frame less.
            self.run = runner.launch
            self.head = (
                kernel.function,
                runner.launch_cooperative_grid,
                runner.launch_pdl,
                None,  # global scratch
                None,  # profile scratch
                *self.head[1:],
            )
