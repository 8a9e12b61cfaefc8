"""Per-layer CUDA graphs of a decode step's write-and-attend.

One layer's write-and-attend of a decode batch launches three kernels (write_kv, the slot
fingerprints, paged attention). On the H200 host their launches cost about 0.2 ms of host
time against about 90 us of GPU time for batch 32 of Llama-3-8B (benchmarks/results/
service-h200.md, pool_call_breakdown). Replayed as one CUDA graph they cost one launch.

A graph bakes in addresses and launch configurations, hence:

* graphs belong to a *shape class*: the tensors' shapes and dtypes, the attention options
  and the block-table width rounded up to a bucket (`bucket_width`: a growing context
  crosses a bucket every few hundred tokens, not every block), and whether the write is
  guarded by a finite check (KVPool.write_and_attend's check_finite). A class owns the
  static buffers its graphs read; a call copies its key, value and query into them (one
  transfer through the stager; from page-locked host memory, one DMA of the three when
  they lie there as they lie in the buffers, as a client's shared region lays them out,
  else a DMA per tensor) and, when the step changed, its metadata (device copies);
* nothing a kernel does may depend on a host decision per call: the paged-attention
  launcher picks its configuration from shapes alone (``check_values=False``), and a
  padded block table's entries past a sequence's length are never read.

The first call of a (class, layer) runs eagerly: a shape seen once (a prefill chunk) is
not worth a capture. The second runs eagerly on the static buffers (its own work, which
also compiles anything the capture would otherwise meet first), then captures; later calls
replay. The results of a replay live in the graph's memory: the caller copies them out
before the next call. Classes are kept least recently used first.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from workers.checks import AttendOptions
from workers.kernel_warmup import TABLE_WIDTH_MULTIPLE
from workers.metadata_cache import CachedMetadata
from workers.staging import HostStager, packed_offsets

__all__ = ["DecodeGraphs", "GraphBody", "bucket_width"]

log = logging.getLogger(__name__)

# body(layer, slots, key, value, query, block_tables, seq_lens, query_start_loc, options,
# check_finite) -> (out, lse or None, finite flag or None): the pool's write (masked unless
# every input is finite, with check_finite) then attention on device tensors.
GraphBody = Callable[
    [
        int,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        AttendOptions,
        bool,
    ],
    tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None],
]

# (class, layer) pairs remembered as seen once; past this many the memory starts afresh.
_MAX_SEEN = 4096


def bucket_width(width: int) -> int:
    """A block-table width rounded up to one of 8 steps per doubling, and to a multiple of
    16 (at most 12.5% more than `width` from 128 on; at least 16), so graphs keyed by it
    survive many steps of a growing context, and the kernels see one specialization of the
    width (as in the coordinator's padded plans; workers.kernel_warmup)."""
    if width <= TABLE_WIDTH_MULTIPLE:
        return TABLE_WIDTH_MULTIPLE
    step = max(TABLE_WIDTH_MULTIPLE, 1 << (width.bit_length() - 4))
    return -(-width // step) * step


# A graph's results: (out, lse or None, finite flag or None), in the graph's memory.
_Outputs = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]


@dataclass
class _Class:
    """The static buffers of one shape class and the graphs captured on them, by layer."""

    inputs: torch.Tensor  # uint8: key, value, query packed as HostStager packs them
    key: torch.Tensor
    value: torch.Tensor
    query: torch.Tensor
    offsets: tuple[int, ...]  # bytes: where key, value and query start in `inputs`
    head: torch.Tensor  # uint8: `inputs` from the key's first byte to the query's last
    slots: torch.Tensor
    block_tables: torch.Tensor  # [S, bucket width]
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    loaded: CachedMetadata | None = None  # whose metadata the buffers hold
    graphs: dict[int, tuple[torch.cuda.CUDAGraph, _Outputs]] = field(default_factory=dict)
    failed: set[int] = field(default_factory=set)  # layers whose capture failed


class DecodeGraphs:
    """Capture and replay of one pool's per-layer write-and-attend (see the module doc).

    Args:
        device: the pool's CUDA device.
        body: the pool's write then attention on validated device tensors.
        stager: the pool's host stager (host inputs reach the static buffers in one copy).
        max_classes: shape classes kept (each holds its static buffers and up to one graph
            per layer).

    Thread-safe: calls run one at a time.
    """

    def __init__(
        self,
        device: torch.device,
        body: GraphBody,
        stager: HostStager | None,
        max_classes: int = 16,
    ) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        self._device = device
        self._body = body
        self._stager = stager
        self._max_classes = max_classes
        self._classes: OrderedDict[tuple[object, ...], _Class] = OrderedDict()
        self._seen: set[tuple[tuple[object, ...], int]] = set()
        self._lock = threading.Lock()
        self._stream: torch.cuda.Stream | None = None
        self._mempool: object = None
        self.replays = 0  # calls answered by a replay (tests and diagnostics)
        self.captures = 0
        self.packed_loads = 0  # loads of key, value and query in one host-to-device copy

    def __len__(self) -> int:
        """Graphs held."""
        return sum(len(c.graphs) for c in self._classes.values())

    def clear(self) -> None:
        """Drop every graph and static buffer."""
        with self._lock:
            self._classes.clear()
            self._seen.clear()

    def run(
        self,
        layer: int,
        entry: CachedMetadata,
        key: torch.Tensor,
        value: torch.Tensor,
        query: torch.Tensor,
        options: AttendOptions,
        pinned: bool = False,
        check_finite: bool = False,
    ) -> _Outputs | None:
        """One layer's write-and-attend through its graph.

        Args:
            layer: the layer.
            entry: the call's validated metadata, with its slots (``entry.slots``).
            key, value: ``[n, Hkv, D]`` new K/V (pool dtype, validated against the slots).
            query: ``[T, Hq, D]`` (pool dtype, validated against the metadata).
            options: the attention options.
            pinned: key, value and query are in page-locked host memory: copied from there
                asynchronously (the caller waits for the copies before it lets the memory
                go), not staged.
            check_finite: the body masks the write unless every input is finite (graphs
                with and without the check are kept apart).

        Returns:
            ``(out [T, Hq, D], lse [T, Hq] float32 or None, finite flag or None)``: tensors
            in the graph's memory when replayed (read them before the next call), fresh
            ones when this call ran eagerly; None when the call should take the pool's
            usual path (a first sighting, or a layer whose capture failed), nothing done.
        """
        if entry.slots is None:
            return None
        tables = entry.block_tables
        # Shapes as torch.Size: tuples (hashed and compared as the ints they hold), not
        # converted per call.
        signature = (
            key.shape,
            key.dtype,
            value.dtype,
            query.shape,
            query.dtype,
            entry.slots.shape,
            tables.shape[0],
            bucket_width(tables.shape[1]),
            options,
            check_finite,
        )
        with self._lock:
            cls = self._classes.get(signature)
            if cls is not None:
                self._classes.move_to_end(signature)
                replay = cls.graphs.get(layer)
                if replay is not None:
                    self._load(cls, entry, key, value, query, pinned)
                    graph, outputs = replay
                    graph.replay()
                    self.replays += 1
                    return outputs
                if layer in cls.failed:
                    return None
            if (signature, layer) not in self._seen:
                if len(self._seen) >= _MAX_SEEN:
                    self._seen.clear()
                self._seen.add((signature, layer))
                return None
            if cls is None:
                cls = self._new_class(signature, entry, key, value, query)
            self._load(cls, entry, key, value, query, pinned)
            result = self._run_body(cls, layer, options, check_finite)  # this call's own work
            try:
                cls.graphs[layer] = self._capture(cls, layer, options, check_finite)
                self.captures += 1
            except Exception:  # a capture is an optimisation: never fail the call for it
                log.exception("capturing layer %d's write-and-attend failed", layer)
                cls.failed.add(layer)
            return result

    # -- internals ---------------------------------------------------------------------

    def _new_class(
        self,
        signature: tuple[object, ...],
        entry: CachedMetadata,
        key: torch.Tensor,
        value: torch.Tensor,
        query: torch.Tensor,
    ) -> _Class:
        dev = self._device
        offsets, total = packed_offsets((key, value, query))
        inputs = torch.empty(total, dtype=torch.uint8, device=dev)
        views = [
            inputs[off : off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            for t, off in zip((key, value, query), offsets, strict=True)
        ]
        tables = entry.block_tables
        cls = _Class(
            inputs,
            *views,
            offsets=tuple(offsets),
            head=inputs[: offsets[2] + query.numel() * query.element_size()],
            slots=torch.empty_like(entry.slots),
            # Zeros: a padded entry is never read, but must name a real block anyway.
            block_tables=torch.zeros(
                (tables.shape[0], bucket_width(tables.shape[1])), dtype=tables.dtype, device=dev
            ),
            seq_lens=torch.empty_like(entry.seq_lens),
            query_start_loc=torch.empty_like(entry.query_start_loc),
        )
        self._classes[signature] = cls
        while len(self._classes) > self._max_classes:
            self._classes.popitem(last=False)
        return cls

    def _load(
        self,
        cls: _Class,
        entry: CachedMetadata,
        key: torch.Tensor,
        value: torch.Tensor,
        query: torch.Tensor,
        pinned: bool,
    ) -> None:
        """Copy the call's tensors (and, for a new step, its metadata) into the buffers."""
        if cls.loaded is not entry:
            assert entry.slots is not None
            cls.slots.copy_(entry.slots)
            cls.block_tables[:, : entry.block_tables.shape[1]].copy_(entry.block_tables)
            cls.seq_lens.copy_(entry.seq_lens)
            cls.query_start_loc.copy_(entry.query_start_loc)
            cls.loaded = entry
        tensors = (key, value, query)
        # Pageable host memory goes through the stager's pinned buffer (one copy on the
        # CPU, one transfer); pinned host memory (a registered shared region) is copied
        # directly, asynchronously (the pool waits before returning), as are device tensors:
        # in one copy when the caller's bytes are laid out as the buffers' (about 15 us of
        # host time per copy spared on the H200 host).
        if pinned and (span := _packed_span(tensors, cls.offsets, cls.head.numel())) is not None:
            cls.head.copy_(span, non_blocking=True)
            self.packed_loads += 1
        elif not pinned and self._stager is not None and all(t.is_cpu for t in tensors):
            self._stager.to_device(tensors, into=cls.inputs)
        else:
            for dst, src in zip((cls.key, cls.value, cls.query), tensors, strict=True):
                dst.copy_(src, non_blocking=True)

    def _run_body(
        self, cls: _Class, layer: int, options: AttendOptions, check_finite: bool
    ) -> _Outputs:
        return self._body(
            layer,
            cls.slots,
            cls.key,
            cls.value,
            cls.query,
            cls.block_tables,
            cls.seq_lens,
            cls.query_start_loc,
            options,
            check_finite,
        )

    def _capture(
        self, cls: _Class, layer: int, options: AttendOptions, check_finite: bool
    ) -> tuple[torch.cuda.CUDAGraph, _Outputs]:
        """A graph of the body on `cls`'s buffers (captured, not run)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self._device)
            self._mempool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(self._device)
        self._stream.wait_stream(current)
        # capture_begin / capture_end rather than torch.cuda.graph(): that one also runs
        # gc.collect() and empties the allocator's cache, milliseconds on a busy server.
        with torch.cuda.stream(self._stream):
            # Thread-local: another thread's CUDA call meanwhile (a shared region being
            # page-locked, say) neither breaks the capture nor is refused by it.
            graph.capture_begin(pool=self._mempool, capture_error_mode="thread_local")
            try:
                outputs = self._run_body(cls, layer, options, check_finite)
            except BaseException:
                try:
                    graph.capture_end()
                except Exception:  # the capture is broken anyway; report the body's error
                    pass
                raise
            graph.capture_end()
        current.wait_stream(self._stream)
        return graph, outputs


def _packed_span(
    tensors: tuple[torch.Tensor, ...], offsets: tuple[int, ...], nbytes: int
) -> torch.Tensor | None:
    """The host bytes holding `tensors` as one uint8 tensor ``[nbytes]``, when they lie in
    one host storage exactly as a class's buffers lie in its `inputs`: each contiguous,
    plain (no lazy negation or conjugation, which a copy would apply and a byte copy would
    not), starting `offsets` bytes after the first tensor's start, and the `nbytes` from
    there within the storage (the bytes between the tensors are read too: they must be
    the caller's own memory). Else None: the caller copies tensor by tensor.

    Shapes and dtypes are the class's (its signature), so equal offsets mean equal bytes
    wherever the buffers' views read.
    """
    first = tensors[0]
    if not first.is_cpu:
        return None
    start = first.data_ptr()
    for t, offset in zip(tensors, offsets, strict=True):
        if (
            not t.is_cpu
            or t.data_ptr() - start != offset
            or not t.is_contiguous()
            or t.is_neg()
            or t.is_conj()
        ):
            return None
    storage = first.untyped_storage()
    at = start - storage.data_ptr()  # bytes into the storage
    if at < 0 or at + nbytes > storage.nbytes():
        return None
    # A uint8 view of the storage's bytes (set_ onto a fresh empty tensor: no copy).
    return torch.empty(0, dtype=torch.uint8).set_(storage, at, (nbytes,))
