"""The client's side of the shared-memory path: one region, mapped, that a batch call's
tensors go through instead of the gRPC message (see CreateSharedRegion in kvcache.proto).

`SharedMemoryPath.stage` takes the region for one call (or answers None: send bytes), lays
the call's inputs and outputs out in it, copies the inputs in (straight from the device
for CUDA tensors) and returns a `Staged` call: the `SharedTensor` references and output
slices to encode, and `output` to copy each reply tensor out into a fresh tensor (never a
view of the region, which the next call overwrites).

The region is made on first use: CreateSharedRegion, then the client opens and maps the
file the server named. Whether the path is usable is learnt once:
- the server refuses (FAILED_PRECONDITION: disabled; UNIMPLEMENTED: an older server) or
  the file cannot be opened (the client runs on another host, in another container or as
  another user): the region is released and every later call sends bytes;
- a call needing more than the region holds gets a larger one (the old one released);
  a size the server refuses (RESOURCE_EXHAUSTED) is sent as bytes from then on, and no
  region is asked for during the next `_REFUSAL_PAUSE_S` seconds;
- the region vanished on the server (NOT_FOUND: deleted after its idle timeout, or the
  server restarted): `forget` drops it, the next call makes a new one.

A lock guards the region: a call that finds it taken (another thread's call is using it)
sends bytes instead of waiting. With `required=True` (``shared_memory=True`` on the
client) set-up failures raise instead of falling back.
"""

from __future__ import annotations

import mmap
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from cache_service.client.errors import KVCacheError, ResourceExhaustedError
from cache_service.wire.request_codec import SharedTensor, SliceRef
from cache_service.wire.tensor_codec import (
    TensorCodecError,
    dtype_from_proto,
    dtype_to_proto,
    tensor_from_proto,
)

__all__ = ["SharedMemoryPath", "SharedMemoryUnavailable", "Staged"]

MiB = 1 << 20
# Each tensor starts on a 256-byte boundary (a cache line, any element size): the rule by
# which a GPU pool packs a call's key, value and query into its CUDA graphs' input buffer
# (workers.staging.packed_offsets), so a server's pool reading them from the region finds
# them laid out alike and loads the three with one copy (any layout is accepted).
_ALIGN = 256
# Smallest region asked for: a decode step's tensors fit many times over, so the region is
# not remade as the batch grows a little.
_MIN_REGION = 4 * MiB
# After a refused creation, no region is asked for this long (every call would pay a
# failing round trip while a limit stays reached).
_REFUSAL_PAUSE_S = 10.0
# Views of a region kept for reuse (see _Mapped.view), and call layouts kept (see
# SharedMemoryPath.stage): a few per decode step's shapes; the bounds guard odd callers.
_MAX_VIEWS = 64
_MAX_LAYOUTS = 64
# The wire's byte order is little-endian; the views over the region use the host's.
_USABLE_HOST = sys.byteorder == "little"


class SharedMemoryUnavailable(RuntimeError):
    """The shared-memory path was required (``shared_memory=True``) but cannot be set up;
    the message says why."""


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _region_size(needed: int) -> int:
    """The size to ask for: at least `needed`, a power of two from `_MIN_REGION` up, so a
    growing batch remakes the region a few times at most."""
    size = _MIN_REGION
    while size < needed:
        size *= 2
    return size


class _Mapped:
    """One region the client mapped: the server's id and the file's bytes as uint8."""

    def __init__(self, region_id: str, path: str, size: int) -> None:
        flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(path, flags)
        try:
            actual = os.fstat(fd).st_size
            if actual != size:  # not the server's file (same name elsewhere): do not use it
                raise OSError(f"{path} holds {actual} bytes, the server announced {size}")
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.region_id = region_id
        self.size = size
        self._bytes: torch.Tensor | None = torch.frombuffer(self._mm, dtype=torch.uint8)
        # A decode step asks for the same few slices layer after layer: their views are
        # made once (three torch calls each) and kept until the region is unmapped.
        self._views: dict[tuple[int, torch.dtype, tuple[int, ...]], torch.Tensor] = {}

    def view(self, offset: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """The region's bytes at `offset` as a tensor of `dtype` and `shape` (a view: it
        must not outlive the call that made it)."""
        key = (offset, dtype, tuple(shape))
        view = self._views.get(key)
        if view is None:
            assert self._bytes is not None, "the region is unmapped"
            n = _nbytes(dtype, shape)
            view = self._bytes[offset : offset + n].view(dtype).view(key[2])
            if len(self._views) >= _MAX_VIEWS:  # odd callers: many shapes
                self._views.clear()
            self._views[key] = view
        return view

    def close(self) -> None:
        """Unmap (views still alive keep the memory until they go)."""
        self._views = {}
        self._bytes = None
        try:
            self._mm.close()
        except BufferError:  # a view escaped: the mapping goes with its last view
            pass


def _nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    n = dtype.itemsize
    for s in shape:
        n *= s
    return n


class _Layout:
    """Where one kind of call (its inputs' and outputs' dtypes and shapes) lies in a
    region: computed once, and bound to the region in use (`place`) when it changes.

    Attributes:
        size: bytes the call needs; empty: some tensor has no elements.
        out_specs: (dtype, shape) of each output.
        region: the region the views and references below are of (None: not placed).
        input_views: each input's slice of the region, as a tensor of its dtype and shape.
        shared: each input as a `SharedTensor` of the region.
        refs: each output's (region id, offset).
    """

    def __init__(
        self,
        in_specs: list[tuple[torch.dtype, tuple[int, ...]]],
        out_specs: list[tuple[torch.dtype, tuple[int, ...]]],
    ) -> None:
        sizes = [_nbytes(d, s) for d, s in in_specs + out_specs]
        self.empty = min(sizes) == 0
        self.offsets = []
        at = 0
        for n in sizes:
            self.offsets.append(at)
            at += _aligned(n)
        self.size = at
        self.in_specs = in_specs
        self.out_specs = out_specs
        self.region: _Mapped | None = None
        self.input_views: list[torch.Tensor] = []
        self.shared: list[SharedTensor] = []
        self.refs: list[SliceRef] = []

    def place(self, region: _Mapped) -> None:
        """Bind the views and references to `region` (one at least `size` bytes)."""
        n = len(self.in_specs)
        self.input_views = [
            region.view(o, d, s) for (d, s), o in zip(self.in_specs, self.offsets, strict=False)
        ]
        self.shared = [
            SharedTensor(d, s, region.region_id, o)
            for (d, s), o in zip(self.in_specs, self.offsets, strict=False)
        ]
        self.refs = [(region.region_id, o) for o in self.offsets[n:]]
        self.region = region


def _layout(
    inputs: Sequence[torch.Tensor], outputs: Sequence[tuple[torch.dtype, tuple[int, ...]]]
) -> _Layout:
    """The layout of a call with these inputs and outputs.

    Raises:
        TensorCodecError: an input's dtype cannot travel (the bytes path's error).
    """
    for t in inputs:
        dtype_to_proto(t.dtype)
    in_specs = [(t.dtype, tuple(t.shape)) for t in inputs]
    return _Layout(in_specs, [(d, tuple(s)) for d, s in outputs])


@dataclass
class Staged:
    """One call's use of the region; `done` must follow (it frees the region).

    Attributes:
        inputs: the call's input tensors as `SharedTensor` references, in order.
        outputs: where the server is to write each output (region id, offset), in order.
    """

    inputs: list[SharedTensor]
    outputs: list[SliceRef]
    _region: _Mapped
    _out_specs: list[tuple[torch.dtype, tuple[int, ...]]]
    _owner: SharedMemoryPath

    @property
    def region_id(self) -> str:
        """The region's id (a NOT_FOUND naming it means the server deleted it)."""
        return self._region.region_id

    def output(self, msg: Any, index: int, field: str) -> torch.Tensor:
        """Reply tensor `msg` (the `index`-th output asked for) as a new CPU tensor: copied
        out of the region when the reply carries its slice, decoded when it carries bytes.

        Raises:
            TensorCodecError: the reply's tensor is not what was asked for (a server bug).
        """
        if msg.data or not msg.HasField("shared"):
            return tensor_from_proto(msg, field)
        dtype = dtype_from_proto(msg.dtype, f"{field}.dtype")
        shape = tuple(msg.shape)
        want_dtype, want_shape = self._out_specs[index]
        region_id, offset = self.outputs[index]
        if (
            msg.shared.region_id != region_id
            or msg.shared.offset != offset
            or (dtype, shape) != (want_dtype, want_shape)
        ):
            raise TensorCodecError(
                f"{field}: the reply points at {msg.shared.offset} in region "
                f"{msg.shared.region_id!r} as {dtype} {list(shape)}, not at the slice asked for"
            )
        return self._region.view(offset, dtype, shape).clone()

    def done(self) -> None:
        """The call is over: another call may use the region."""
        self._owner._lock.release()


class SharedMemoryPath:
    """A client's shared-memory region and the decision whether to use one.

    Args:
        create: CreateSharedRegion as a function (size_bytes, timeout_s) -> the response;
            raises the client's KVCacheError subclasses.
        release: ReleaseSharedRegion as a function (region_id, timeout_s) -> None.
        required: raise `SharedMemoryUnavailable` (or the server's error) where the
            default falls back to bytes.
        clock: monotonic seconds.
    """

    def __init__(
        self,
        create: Callable[[int, float | None], Any],
        release: Callable[[str, float | None], None],
        *,
        required: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._create = create
        self._release = release
        self._required = required
        self._clock = clock
        self._lock = threading.Lock()
        self._region: _Mapped | None = None
        self._off_for_good: str | None = None  # why, once the path is known unusable
        self._refused_size: int | None = None  # smallest size the server refused
        self._paused_until = 0.0
        # (dtype, shape) of each input and output -> where they go in a region.
        self._layouts: dict[tuple[Any, ...], _Layout] = {}
        if not _USABLE_HOST:  # pragma: no cover - no big-endian CI host
            self._off_for_good = "the host is big-endian; the wire's byte order is little"

    @property
    def active(self) -> bool:
        """Whether a region is mapped now (the last batch call went through it)."""
        return self._region is not None

    @property
    def unusable_reason(self) -> str | None:
        """Why the path was given up for good (None: it was not)."""
        return self._off_for_good

    def stage(
        self,
        inputs: Sequence[torch.Tensor],
        outputs: Sequence[tuple[torch.dtype, tuple[int, ...]]],
        timeout_s: float | None,
    ) -> Staged | None:
        """Take the region for one call and copy `inputs` into it; None: send bytes (the
        path is off, the region is busy with another thread's call, or it cannot hold
        the call).

        Args:
            inputs: the call's tensors (float16 / bfloat16 / float32, any device, any
                strides), in request order.
            outputs: (dtype, shape) of each tensor the reply will carry, in order.
            timeout_s: the deadline of a CreateSharedRegion this may need.

        Raises:
            TensorCodecError: an input's dtype cannot travel.
            SharedMemoryUnavailable / KVCacheError: with `required`, when the region cannot
                be set up.
        """
        if self._off_for_good is not None:
            if self._required:
                raise SharedMemoryUnavailable(self._off_for_good)
            return None
        key = (*((t.dtype, t.shape) for t in inputs), *((d, tuple(s)) for d, s in outputs))
        layout = self._layouts.get(key)
        if layout is None:
            layout = _layout(inputs, outputs)
            if len(self._layouts) >= _MAX_LAYOUTS:
                self._layouts.clear()
            self._layouts[key] = layout
        if layout.empty:
            return None  # nothing to share; the server refuses such calls anyway
        if not self._lock.acquire(blocking=False):
            return None
        try:
            region = self._region_for(layout.size, timeout_s)
            if region is None:
                self._lock.release()
                return None
            if layout.region is not region:
                layout.place(region)
            for view, t in zip(layout.input_views, inputs, strict=True):
                view.copy_(t)
            return Staged(layout.shared, layout.refs, region, layout.out_specs, self)
        except BaseException:
            self._lock.release()
            raise

    def _region_for(self, needed: int, timeout_s: float | None) -> _Mapped | None:
        """A mapped region of at least `needed` bytes (made or remade now), or None."""
        region = self._region
        if region is not None and region.size >= needed:
            return region
        if self._refused_size is not None and needed >= self._refused_size:
            if self._required:
                raise SharedMemoryUnavailable(
                    f"the server refused a shared region of {self._refused_size} bytes; "
                    f"this call needs {needed}"
                )
            return None
        if not self._required and self._clock() < self._paused_until:
            return None
        if region is not None:  # too small: the new one replaces it
            self._drop(release=True)
        return self._make(needed, timeout_s)

    def _make(self, needed: int, timeout_s: float | None) -> _Mapped | None:
        size = _region_size(needed)
        try:
            try:
                reply = self._create(size, timeout_s)
            except ResourceExhaustedError:
                if size == needed:
                    raise
                reply = self._create(needed, timeout_s)  # the power of two was over a limit
        except ResourceExhaustedError:
            self._refused_size = min(needed, self._refused_size or needed)
            self._paused_until = self._clock() + _REFUSAL_PAUSE_S
            if self._required:
                raise
            return None
        except KVCacheError as exc:
            if exc.code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED):
                self._off_for_good = f"the server does not offer shared memory ({exc})"
                if self._required:
                    raise SharedMemoryUnavailable(self._off_for_good) from exc
                return None
            if self._required:
                raise
            return None  # e.g. UNAVAILABLE: this call sends bytes (and likely fails too)
        try:
            self._region = _Mapped(reply.region_id, reply.path, int(reply.size_bytes))
        except (OSError, ValueError) as exc:
            # Another host, container or user: the server's file is not ours to map.
            self._off_for_good = f"cannot map the server's shared region {reply.path}: {exc}"
            self._release_quietly(reply.region_id)
            if self._required:
                raise SharedMemoryUnavailable(self._off_for_good) from exc
            return None
        return self._region

    def forget(self) -> None:
        """The server no longer has the region (NOT_FOUND naming it): unmap it without
        releasing; the next call makes a new one. Call while holding a `Staged`."""
        if self._region is not None:
            # First the kept layouts: their views of the region would keep it mapped.
            self._layouts.clear()
            self._region.close()
            self._region = None

    def _drop(self, release: bool) -> None:
        region, self._region = self._region, None
        if region is not None:
            # First the kept layouts: their views of the region would keep it mapped.
            self._layouts.clear()
            region.close()
            if release:
                self._release_quietly(region.region_id)

    def _release_quietly(self, region_id: str) -> None:
        try:
            self._release(region_id, 5.0)
        except KVCacheError:  # gone already, or the server is away: it reaps idle regions
            pass

    def close(self, timeout_s: float = 30.0) -> None:
        """Release the region on the server and unmap it; later calls send bytes. Waits up
        to `timeout_s` for a call in flight on another thread to finish with it."""
        got = self._lock.acquire(timeout=timeout_s)
        try:
            self._off_for_good = "the client is closed"
            self._required = False
            self._drop(release=True)
        finally:
            if got:
                self._lock.release()
