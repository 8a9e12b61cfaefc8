"""Shared-memory regions of same-host clients: the server's registry, whose one job is to
own them (create, look up, bounds-check, copy in and out, reap, delete).

A model executor on the coordinator's host sends the tensors of its per-layer batch calls
through a region instead of inside the gRPC message (CreateSharedRegion in kvcache.proto):
a file in /dev/shm that the server creates and maps and the client maps too. The file has a
random, unguessable name (after the server process's owner tag: workers.owned_files) and mode 0600, so only processes of the server's user can open it;
the region id the RPCs use is a second random token, not the file name (a listing of
/dev/shm reveals no ids). Each region belongs to the tenant that created it: any other
tenant's lookup gets `SharedRegionNotFound` with the message an unknown id gets, so ids
cannot be probed across tenants.

Inputs are copied out of the region when a request is decoded (`read`): the client could
change the bytes while the coordinator works, so the coordinator never sees a live view.
The exceptions (`zero_copy`) are a server whose pools are CUDA pools in its own process
(`pin_for_cuda`): there each region is page-locked for CUDA when it is created
(workers.cuda_pinning), and a call reads its inputs as views of the region (`reader`),
which the pool copies to the GPU by DMA; and a server whose Ray workers are reached over
worker channels, where the views are copied into the channel's arena (the copy that
remains), so a copy out of the region first would be a second one. The view is the copy
that is avoided, and the region stays mapped until the call ends. A server whose worker
channels may name region files to the workers (`share_with_workers`, channels over shared
memory) records each region's mapping in `workers.shared_files.SHARED_FILES` while its file
exists: a worker on this node then maps the file and reads the view's bytes where they lie
(and writes an output produced in place there), with no copy at all. What a client changes in its region during its own call can then change
what is written to its own sequences (as sending other values would), nothing else: the
coordinator's checks of shapes and finiteness still ran, and no other tenant's region or
block is reachable.
Outputs are range-checked before the coordinator runs (`check_writable`, which also keeps
the region mapped until the call ends, even if it is released meanwhile) and written only
after the call succeeded (`OutputSlot.write`), so a failed call writes nothing. On a server
that pins its regions for CUDA, the other layers of a decode step (the coordinator's
repeated-step path) have their output copied by the GPU straight into the slot
(`OutputSlot.tensor`) instead: a call that fails after its kernels ran (rare: a worker lost
mid-call) may leave output bytes there; a refused call still writes nothing.

Regions no call used for `idle_timeout_s` are deleted by `reap_forever` (a client that died
never releases its own); `close` deletes every region at server stop, and
`remove_orphans`, at server start, the files of a server that was killed. Not thread-safe: the
servicer and the reaper use it from the event loop only.
"""

from __future__ import annotations

import asyncio
import logging
import math
import mmap
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from cache_service.config import SharedMemoryConfig
from cache_service.errors import (
    InvalidRequest,
    SharedMemoryDisabled,
    SharedMemoryLimit,
    SharedRegionNotFound,
)
from cache_service.wire.tensor_codec import tensor_from_bytes, tensor_payload
from workers.cuda_pinning import pin, unpin
from workers.owned_files import owned_prefix, reclaim_orphans
from workers.shared_files import SHARED_FILES, NoRoom, create_mapped, unlink_quietly

__all__ = [
    "MappedRegion",
    "OutputSlot",
    "RegionInfo",
    "RegionReader",
    "SharedRegions",
    "default_directory",
]

log = logging.getLogger("kvcache.shared_regions")

# Names read "kvcache-region-<owner>-<random>" (workers.owned_files): a coordinator starting
# removes those of one that is gone (`remove_orphans`).
_FILE_PREFIX = "kvcache-region-"
# Views read the region's bytes in place: the wire's order (little-endian) must be the host's.
_VIEWS_OK = sys.byteorder == "little"
# The reaper looks this often (at most): a region is deleted between idle_timeout_s and
# idle_timeout_s + this after its last use.
_MAX_REAP_INTERVAL_S = 30.0


def default_directory() -> str:
    """/dev/shm where it exists (memory-backed: the fast path), else the temporary
    directory (a disk file still works, the page cache serving most of it)."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK):
        return "/dev/shm"
    return tempfile.gettempdir()


@dataclass(frozen=True)
class RegionInfo:
    """A created region, as CreateSharedRegionResponse reports it.

    Attributes:
        region_id: the id SharedSlice.region_id names it by.
        path: the file to map.
        size_bytes: the region's (and the file's) size, bytes.
    """

    region_id: str
    path: str
    size_bytes: int


# Views kept per region (`_Mapping.view`): a client's calls of one kind read the same few
# slices every time; past this many distinct ones the cache starts afresh.
_MAX_VIEWS = 64


class _Mapping:
    """A region's file as mapped: the mmap and, where the server reads regions in place
    (`zero_copy`), a uint8 tensor over all of it (the base of zero-copy views), whether
    CUDA accepted its registration (`pin_for_cuda`), and the views handed out so far
    (reused: same bytes, same tensor)."""

    __slots__ = ("base", "mm", "pinned", "views")

    def __init__(self, mm: mmap.mmap, pin_for_cuda: bool, zero_copy: bool) -> None:
        self.mm = mm
        self.base: torch.Tensor | None = None
        self.pinned = False
        self.views: dict[tuple[int, torch.dtype, tuple[int, ...]], torch.Tensor] = {}
        if zero_copy or pin_for_cuda:
            self.base = torch.frombuffer(mm, dtype=torch.uint8)
        if pin_for_cuda:
            self.pinned = pin(self.base)

    def view(
        self, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> torch.Tensor:
        """A tensor over bytes [offset, offset + nbytes) of the base (range checked by the
        caller), made once per (offset, dtype, shape)."""
        key = (offset, dtype, shape)
        view = self.views.get(key)
        if view is None:
            if len(self.views) >= _MAX_VIEWS:
                self.views.clear()
            base = self.base
            assert base is not None  # only regions with a base hand out views
            view = self.views[key] = base[offset : offset + nbytes].view(dtype).view(shape)
        return view

    def close(self) -> None:
        """Unregister and unmap; raises BufferError while views of the mapping exist."""
        self.views.clear()
        if self.pinned:
            unpin(self.base)  # type: ignore[arg-type]
            self.pinned = False
        self.base = None
        self.mm.close()


class MappedRegion:
    """One mapped file. `users` counts the output slots and zero-copy readers of calls in
    flight: a release or the reaper never unmaps a region under them (see
    `SharedRegions._drop`)."""

    __slots__ = (
        "last_used",
        "mapping",
        "mm",
        "path",
        "region_id",
        "released",
        "size",
        "tenant",
        "users",
    )

    def __init__(
        self, region_id: str, tenant: str, path: str, size: int, mapping: _Mapping, now: float
    ) -> None:
        self.region_id = region_id
        self.tenant = tenant
        self.path = path
        self.size = size
        self.mapping = mapping
        self.mm = mapping.mm
        self.last_used = now
        self.users = 0
        self.released = False

    def let_go(self) -> None:
        """One user (an output slot or a reader of a call) is done with the region."""
        self.users -= 1
        self.unmap_if_unused()

    def unmap_if_unused(self) -> None:
        if self.released and self.users == 0 and not self.mm.closed:
            try:
                self.mapping.close()
            except BufferError:  # pragma: no cover - no view outlives a read or write
                log.warning("shared region still has views; left to the GC", extra=self._log())

    def _log(self) -> dict[str, object]:
        return {"region": self.region_id, "tenant": self.tenant}


class OutputSlot:
    """A checked byte range of a region that one output will be written to.

    While open it keeps the region mapped (a concurrent release or the reaper deletes the
    file but unmaps only after `close`), so writing after a successful call cannot fail.
    Use as a context manager, or call `close`.
    """

    __slots__ = ("_region", "dtype", "nbytes", "offset", "region_id", "shape")

    def __init__(
        self,
        region: MappedRegion,
        offset: int,
        nbytes: int,
        dtype: torch.dtype = torch.uint8,
        shape: tuple[int, ...] | None = None,
    ) -> None:
        self._region: MappedRegion | None = region
        self.region_id = region.region_id
        self.offset = offset
        self.nbytes = nbytes
        self.dtype = dtype
        self.shape = (nbytes,) if shape is None else shape
        region.users += 1

    @property
    def region(self) -> MappedRegion | None:
        """The region the slot lies in (None once closed)."""
        return self._region

    def tensor(self) -> torch.Tensor | None:
        """The slot as a host tensor of its dtype and shape, a view of the region (where it
        has a tensor base: `zero_copy`), to produce the output in place; None elsewhere
        (then `write` copies it in)."""
        region = self._region
        if region is None or region.mapping.base is None or self.nbytes == 0:
            return None
        return region.mapping.view(self.offset, self.nbytes, self.dtype, self.shape)

    def write(self, tensor: torch.Tensor) -> None:
        """Write `tensor`'s raw little-endian, C-contiguous bytes (exactly `nbytes`; any
        device) at the slot's offset.

        Raises:
            ValueError: the tensor's byte size differs from the slot's (a caller's bug), or
                the slot is closed.
        """
        region = self._region
        if region is None:
            raise ValueError("the output slot is closed")
        base = region.mapping.base
        if (
            base is not None
            and tensor.device.type == "cpu"
            and tensor.data_ptr() == base.data_ptr() + self.offset
            and tensor.numel() * tensor.element_size() == self.nbytes
            and tensor.is_contiguous()
        ):
            return  # produced in place (`tensor`)
        data = tensor_payload(tensor)
        if len(data) != self.nbytes:
            raise ValueError(f"{len(data)} output bytes for a slot of {self.nbytes}")
        region.mm[self.offset : self.offset + self.nbytes] = data

    def close(self) -> None:
        """Stop using the region (idempotent)."""
        region, self._region = self._region, None
        if region is not None:
            region.let_go()

    def __enter__(self) -> OutputSlot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RegionReader:
    """The shared-memory inputs of one call (a `tensor_codec.SharedReader`).

    Copies by default; where the server reads regions in place (`zero_copy`), views
    of the regions, each region held mapped (`users`) until `close`. Use it as a context
    manager around the whole call, the coordinator's work included.
    """

    __slots__ = ("_held", "_regions", "_tenant", "_zero_copy")

    def __init__(self, regions: SharedRegions, tenant: str, zero_copy: bool) -> None:
        self._regions = regions
        self._tenant = tenant
        self._zero_copy = zero_copy
        self._held: list[MappedRegion] = []

    def __call__(
        self, region_id: str, offset: int, dtype: torch.dtype, shape: list[int], field: str
    ) -> torch.Tensor:
        if not self._zero_copy:
            return self._regions.read(self._tenant, region_id, offset, dtype, shape, field)
        tensor, region = self._regions.view(self._tenant, region_id, offset, dtype, shape, field)
        if region is not None:
            self.hold(region)
        return tensor

    @property
    def held(self) -> tuple[MappedRegion, ...]:
        """The regions of the views read so far, one per view (in the order read)."""
        return tuple(self._held)

    def hold(self, region: MappedRegion) -> None:
        """Keep `region` mapped until `close`, as reading a view of it does (for views
        read by an earlier call and reused by this one)."""
        region.users += 1
        self._held.append(region)

    def close(self) -> None:
        """The call has ended: its regions may be unmapped (idempotent)."""
        held, self._held = self._held, []
        for region in held:
            region.let_go()

    def __enter__(self) -> RegionReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SharedRegions:
    """The server's shared-memory regions, by id, each owned by one tenant.

    Args:
        config: the limits and the idle timeout (`enabled` False: `create` refuses).
        directory: where the files go (default: `default_directory()`).
        on_change: called with (regions, bytes) after every change of either, e.g. the
            metrics gauges' setter.
        clock: monotonic seconds (tests pass a fake one to age regions).
        pin_for_cuda: page-lock every region for CUDA and let calls read their inputs as
            views (`reader`): for a server whose pools are CUDA pools in its process.
        zero_copy: let calls read their inputs as views, and produce outputs in place
            (`OutputSlot.tensor`), without pinning: for a server whose workers copy the
            views anyway (worker channels). Implied by `pin_for_cuda`.
        share_with_workers: record every region's mapping in
            `workers.shared_files.SHARED_FILES` while its file exists, so worker channels
            name the files to their workers instead of copying (channels over shared
            memory). Implies `zero_copy`.
    """

    def __init__(
        self,
        config: SharedMemoryConfig,
        *,
        directory: str | None = None,
        on_change: Callable[[int, int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        pin_for_cuda: bool = False,
        zero_copy: bool = False,
        share_with_workers: bool = False,
    ) -> None:
        self._config = config
        self._pin_for_cuda = pin_for_cuda
        self._share = share_with_workers
        self._zero_copy = zero_copy or pin_for_cuda or share_with_workers
        self.directory = directory if directory is not None else default_directory()
        self._on_change = on_change
        self._clock = clock
        self._regions: dict[str, MappedRegion] = {}
        self._drop_listeners: list[Callable[[str], None]] = []
        self._per_tenant: dict[str, int] = {}  # regions held or being created
        self._bytes = 0  # of the regions held
        self._pending_bytes = 0  # of the regions being created
        self._report()

    @property
    def enabled(self) -> bool:
        """Whether `create` serves (config `enabled`)."""
        return self._config.enabled

    @property
    def zero_copy(self) -> bool:
        """Whether calls read their inputs as views of the regions (`reader`)."""
        return self._zero_copy

    def add_drop_listener(self, listener: Callable[[str], None]) -> None:
        """Call `listener(region_id)` whenever a region is dropped (released, reaped,
        server stop), before it is unmapped: whoever keeps views of regions beyond a call
        lets go of them there (a mapping with views cannot be closed)."""
        self._drop_listeners.append(listener)

    def touch(self, tenant: str, region: MappedRegion) -> bool:
        """Whether `region` is still one of `tenant`'s regions; if so, it counts as used
        now (as a lookup of its id does)."""
        if region.released or region.tenant != tenant:
            return False
        region.last_used = self._clock()
        return True

    @property
    def num_regions(self) -> int:
        """Regions held, all tenants."""
        return len(self._regions)

    @property
    def total_bytes(self) -> int:
        """Bytes of all regions held, all tenants."""
        return self._bytes

    # -- lifecycle of regions --------------------------------------------------------------

    async def create(self, tenant: str, size_bytes: int) -> RegionInfo:
        """A new region of `size_bytes` bytes for `tenant`: a zero-filled file, mode 0600,
        with its memory reserved (posix_fallocate), mapped read-write.

        The file is made on a thread (reserving 256 MiB of tmpfs takes tens of
        milliseconds, which would stall every call on the event loop); its bytes count
        against the limits from the start, so concurrent creations cannot overshoot them.

        Raises:
            SharedMemoryDisabled: config `enabled` is False.
            InvalidRequest: size_bytes < 1.
            SharedMemoryLimit: max_region_bytes, max_regions_per_tenant or max_total_bytes
                would be exceeded, or the file system has no room; the message names which.
        """
        self._admit(tenant, size_bytes)
        made = asyncio.get_running_loop().run_in_executor(None, self._new_file, size_bytes)
        try:
            # Shielded: a cancelled call still learns of the file, to delete it.
            path, mapping = await asyncio.shield(made)
        except BaseException:
            self._per_tenant_dec(tenant)
            self._pending_bytes -= size_bytes
            made.add_done_callback(_discard_file)  # nothing to do if the creation failed
            raise
        self._pending_bytes -= size_bytes
        region_id = secrets.token_hex(16)
        self._regions[region_id] = MappedRegion(
            region_id, tenant, path, size_bytes, mapping, self._clock()
        )
        self._bytes += size_bytes
        self._report()
        log.debug("shared region created", extra={"region": region_id, "bytes": size_bytes})
        return RegionInfo(region_id, path, size_bytes)

    def _admit(self, tenant: str, size_bytes: int) -> None:
        """Check a creation against the configuration and count it (a region of the
        tenant, pending bytes); raises what `create` documents."""
        cfg = self._config
        if not cfg.enabled:
            raise SharedMemoryDisabled(
                "shared memory is disabled on this server (shared_memory.enabled: false); "
                "send tensors as bytes"
            )
        if size_bytes < 1:
            raise InvalidRequest(f"size_bytes must be >= 1, got {size_bytes}")
        if size_bytes > cfg.max_region_bytes:
            raise SharedMemoryLimit(
                f"size_bytes {size_bytes} exceeds shared_memory.max_region_bytes "
                f"({cfg.max_region_bytes})"
            )
        held = self._per_tenant.get(tenant, 0)
        if held >= cfg.max_regions_per_tenant:
            raise SharedMemoryLimit(
                f"the tenant holds {held} shared regions, shared_memory.max_regions_per_tenant "
                f"({cfg.max_regions_per_tenant}): release one first"
            )
        if size_bytes > cfg.max_total_bytes - self._bytes - self._pending_bytes:
            # No figure of other tenants' use in the message: only the configured limit.
            raise SharedMemoryLimit(
                f"{size_bytes} more bytes would exceed shared_memory.max_total_bytes "
                f"({cfg.max_total_bytes}, the regions of all tenants together)"
            )
        self._per_tenant[tenant] = held + 1
        self._pending_bytes += size_bytes

    def _per_tenant_dec(self, tenant: str) -> None:
        left = self._per_tenant[tenant] - 1
        if left:
            self._per_tenant[tenant] = left
        else:
            del self._per_tenant[tenant]

    def _new_file(self, size: int) -> tuple[str, _Mapping]:
        """A new file of `size` bytes under the directory, mapped (and pinned for CUDA when
        configured); nothing left behind on failure."""
        try:
            path, mm = create_mapped(self.directory, owned_prefix(_FILE_PREFIX), size)
        except NoRoom:
            raise SharedMemoryLimit(
                f"no room for {size} bytes in {self.directory} (the file system holding the "
                "shared regions is full: enlarge it, e.g. docker --shm-size, or lower "
                "shared_memory.max_total_bytes)"
            ) from None
        try:
            mapping = _Mapping(mm, self._pin_for_cuda, self._zero_copy)
        except BaseException:
            mm.close()
            unlink_quietly(path)
            raise
        if self._share and mapping.base is not None:
            SHARED_FILES.add(mapping.base.data_ptr(), size, (path, size))
        return path, mapping

    def release(self, tenant: str, region_id: str) -> None:
        """Delete `tenant`'s region: the file is unlinked at once, the mapping closed once
        no call in flight writes to it.

        Raises:
            SharedRegionNotFound: unknown id, or another tenant's.
        """
        region = self._lookup(tenant, region_id, "region_id")
        self._drop(region)
        self._report()

    def _drop(self, region: MappedRegion) -> None:
        del self._regions[region.region_id]
        self._per_tenant_dec(region.tenant)
        self._bytes -= region.size
        region.released = True
        for listener in self._drop_listeners:
            listener(region.region_id)
        base = region.mapping.base
        if self._share and base is not None:
            # Before the unlink: no worker is sent to a path that is gone (one already on
            # its way finds it gone and the call is sent again with its tensors copied).
            SHARED_FILES.remove(base.data_ptr())
        unlink_quietly(region.path)
        region.unmap_if_unused()

    def reap_idle(self) -> int:
        """Delete every region that no call has used for `idle_timeout_s` (and none is
        writing to now). Returns how many went."""
        limit = self._clock() - self._config.idle_timeout_s
        idle = [r for r in self._regions.values() if r.users == 0 and r.last_used <= limit]
        for region in idle:
            self._drop(region)
            log.info("idle shared region deleted", extra=region._log())
        if idle:
            self._report()
        return len(idle)

    async def reap_forever(self) -> None:
        """`reap_idle` every idle_timeout_s / 4 (at most every 30 s), until cancelled."""
        interval = min(self._config.idle_timeout_s / 4, _MAX_REAP_INTERVAL_S)
        while True:
            await asyncio.sleep(interval)
            try:
                self.reap_idle()
            except Exception:  # keep reaping; a file system error is logged, not fatal
                log.exception("reaping shared regions failed")

    def remove_orphans(self) -> list[str]:
        """Delete the region files in the directory whose coordinator process is gone (one
        killed outright never deletes its own); a live coordinator's files stay. Returns
        the paths removed."""
        return reclaim_orphans(self.directory, _FILE_PREFIX)

    def close(self) -> None:
        """Delete every region (server stop). Idempotent."""
        for region in list(self._regions.values()):
            self._drop(region)
            # Calls have ended (the server stopped first): nothing writes any more.
            region.users = 0
            region.unmap_if_unused()
        self._report()

    # -- data ------------------------------------------------------------------------------

    def read(
        self,
        tenant: str,
        region_id: str,
        offset: int,
        dtype: torch.dtype,
        shape: Sequence[int],
        field: str,
    ) -> torch.Tensor:
        """A new CPU tensor of `dtype` and `shape` holding a COPY of the region's bytes at
        `offset` (little-endian, C-contiguous; product(shape) * itemsize bytes).

        Args:
            tenant: the caller's tenant.
            region_id, offset: the request's SharedSlice.
            dtype, shape: the Tensor message's, already checked (sizes >= 0).
            field: the request field, for messages (e.g. "key").

        Raises:
            SharedRegionNotFound: unknown region, or another tenant's.
            InvalidRequest: the offset is not a multiple of the element size, or the bytes
                do not lie within the region.
        """
        region, nbytes = self._slice(tenant, region_id, offset, dtype, shape, f"{field}.shared")
        return _copy_out(region, offset, nbytes, dtype, shape, field)

    def reader(self, tenant: str) -> RegionReader:
        """The reader of one call's shared inputs (`tensor_codec.SharedReader`): copies
        (`read`), or views where the server reads regions in place (`zero_copy`); close
        it (or use it as a context manager) when the call ends."""
        return RegionReader(self, tenant, self._zero_copy)

    def view(
        self,
        tenant: str,
        region_id: str,
        offset: int,
        dtype: torch.dtype,
        shape: Sequence[int],
        field: str,
    ) -> tuple[torch.Tensor, MappedRegion | None]:
        """`read` without the copy where the region has a tensor base (`zero_copy`):
        a view of `dtype` and `shape` at `offset`, and the region, which the caller must
        keep mapped (`users`) while it uses the view; elsewhere `read`'s copy and None.

        Raises:
            as `read`.
        """
        region, nbytes = self._slice(tenant, region_id, offset, dtype, shape, f"{field}.shared")
        if region.mapping.base is None or not _VIEWS_OK:
            return _copy_out(region, offset, nbytes, dtype, shape, field), None
        if nbytes == 0:
            return torch.empty(tuple(shape), dtype=dtype), None
        return region.mapping.view(offset, nbytes, dtype, tuple(shape)), region

    def check_writable(
        self,
        tenant: str,
        region_id: str,
        offset: int,
        dtype: torch.dtype,
        shape: Sequence[int],
        field: str,
    ) -> OutputSlot:
        """The slot an output of `dtype` and `shape` will be written to, checked now so a
        bad range fails the call before anything changes. Close the slot when the call ends.

        Raises:
            SharedRegionNotFound / InvalidRequest: as `read`, naming `field` (e.g.
            "output_to").
        """
        region, nbytes = self._slice(tenant, region_id, offset, dtype, shape, field)
        if offset % 16 or not _VIEWS_OK:  # views only of aligned slots in the wire's order
            return OutputSlot(region, offset, nbytes)
        return OutputSlot(region, offset, nbytes, dtype, tuple(shape))

    def _slice(
        self,
        tenant: str,
        region_id: str,
        offset: int,
        dtype: torch.dtype,
        shape: Sequence[int],
        field: str,
    ) -> tuple[MappedRegion, int]:
        """The tenant's region and the byte count of the slice of `dtype` and `shape` at
        `offset`, checked to lie within it (raises what `read` documents, naming `field`)."""
        region = self._lookup(tenant, region_id, field)
        nbytes = math.prod(shape) * dtype.itemsize
        _check_range(region, offset, nbytes, dtype.itemsize, field)
        return region, nbytes

    def _lookup(self, tenant: str, region_id: str, field: str) -> MappedRegion:
        region = self._regions.get(region_id)
        if region is None or region.tenant != tenant:
            # One message for unknown and foreign ids: existence does not leak.
            raise SharedRegionNotFound(
                f"{field}: shared region {region_id!r} not found (unknown, released, deleted "
                "after its idle timeout, or not yours): create a new one"
            )
        region.last_used = self._clock()
        return region

    def _report(self) -> None:
        if self._on_change is not None:
            self._on_change(len(self._regions), self._bytes)


def _copy_out(
    region: MappedRegion,
    offset: int,
    nbytes: int,
    dtype: torch.dtype,
    shape: Sequence[int],
    field: str,
) -> torch.Tensor:
    """A new CPU tensor holding a copy of the region's checked slice (the one copy)."""
    with memoryview(region.mm) as whole, whole[offset : offset + nbytes] as part:
        return tensor_from_bytes(part, dtype, shape, field)


def _check_range(region: MappedRegion, offset: int, nbytes: int, itemsize: int, field: str) -> None:
    """offset aligned to the element size, [offset, offset + nbytes) within the region.

    Written as `nbytes > size - offset` after `offset <= size`: Python ints cannot wrap,
    but this is the form that stays right for any uint64 offset in any language.
    """
    if offset % itemsize:
        raise InvalidRequest(
            f"{field}.offset {offset} is not a multiple of the element size ({itemsize} bytes)"
        )
    if offset > region.size or nbytes > region.size - offset:
        raise InvalidRequest(
            f"{field}: {nbytes} bytes at offset {offset} do not fit in the shared region of "
            f"{region.size} bytes"
        )


def _discard_file(made: asyncio.Future[tuple[str, _Mapping]]) -> None:
    """Delete the file a creation made for a call that was cancelled meanwhile."""
    if made.cancelled() or made.exception() is not None:
        return
    path, mapping = made.result()
    mapping.close()
    unlink_quietly(path)
