"""Per-layer CUDA graphs of a decode step's write-and-attend.

One layer's write-and-attend of a decode batch launches three kernels (write_kv, the slot
fingerprints, paged attention). Launched one by one they cost more host time than the GPU
spends on them for a decode batch (measured per call in
benchmarks/results/archive/service-h200.md, pool_call_breakdown). Replayed as one CUDA
graph they cost one launch.

A graph bakes in addresses and launch configurations, hence:

* graphs belong to a *shape class*: the tensors' shapes and dtypes, the attention options
  and the block-table width rounded up to a bucket (`bucket_width`: a growing context
  crosses a bucket every few hundred tokens, not every block), and whether the write is
  guarded by a finite check (the round's check_finite: KVPool.run_round). A class owns the
  static buffers its graphs read; a call copies its key, value and query into them (one
  transfer through the stager; from page-locked host memory, one DMA of the three when
  they lie there as they lie in the buffers, as a client's shared region lays them out,
  else a DMA per tensor) and, when the step or the callers changed, its metadata (one
  device copy of the key's metadata, packed once as the class lays it out);
* nothing a kernel does may depend on a host decision per call: the paged-attention
  launcher picks its configuration from shapes alone (``check_values=False``), and a
  padded block table's entries past a sequence's length are never read.

A coordinator's round over several layers (``KVPool.run_round`` over pages: sequences of
different layers in one launch, the pool seen as pages) replays a graph too, under the
pseudo-layer :data:`PAGES`: its static inputs also hold each sequence's and each new
token's layer (packed after the query), from which the graph computes the page tables and
page slots on the device; key, value and query may arrive in parts (the round's callers'
rows, joined by the stager's one copy). So a round keeps one graph whichever layers its
callers are on.

A step lease's layers (``KVPool.bind_step``, run by the lease's client on its view of
the pool: workers.lease_client) arrive in the client's fixed buffers on the device, the
same buffers layer after layer: their class is *bound* to those buffers (keyed by their
addresses), its graphs read the inputs where they lie, and each layer's output is its
graph's own tensor, handed to the caller as it is (no copy): it stays valid until that
layer's graph replays again, a step later. `DecodeGraphs.bind` resolves a step's class
once, so its layers' replays skip the class lookup.

A step of more than `MAX_GRAPH_ROWS_PER_SEQUENCE` query rows per sequence (a prefill)
always runs eagerly: its shape seldom repeats, its launches are small beside its kernels,
and a capture costs far more than a launch. The first call of a (class, layer) runs
eagerly too: a shape seen once is not worth a capture. The second runs eagerly on the static buffers (its own work, which
also compiles anything the capture would otherwise meet first), then captures; later calls
replay. The results of a replay live in the graph's memory: the caller copies them out
before the next call. Classes are kept least recently used first.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from workers.checks import AttendOptions
from workers.kernel_warmup import TABLE_WIDTH_MULTIPLE
from workers.metadata_cache import CachedMetadata
from workers.parts import joined, joined_shape, on_host
from workers.staging import HostStager, Staged, bytes_as, packed_offsets

__all__ = [
    "MAX_GRAPH_ROWS_PER_SEQUENCE",
    "PAGES",
    "BoundGraphs",
    "DecodeGraphs",
    "GraphBody",
    "PagesBody",
    "bucket_width",
]

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

# body over pages (slots, key, value, query, block_tables, seq_lens, query_start_loc,
# layers, options, check_finite) -> as GraphBody: block ids and slots per layer, `layers`
# int32 [S + n], each sequence's then each new token's layer (KVPool.run_round over pages).
PagesBody = Callable[
    [
        torch.Tensor,
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

# The graph key of a round over several layers (see the module docstring).
PAGES = -1

# (class, layer) pairs remembered as seen once; past this many the memory starts afresh.
_MAX_SEEN = 4096
# Query rows per sequence beyond which a call is a prefill, never captured (decode: 1; a
# speculative step's few draft tokens stay below).
MAX_GRAPH_ROWS_PER_SEQUENCE = 8
# Entries' metadata kept packed for their class (a few KB each), least recently used out.
_MAX_PACKED = 64


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

    # uint8: key, value, query (and layers) packed as HostStager does; None for a class
    # bound to the caller's buffers (`DecodeGraphs.run`'s `bound`), which nobody loads.
    inputs: torch.Tensor | None
    key: torch.Tensor
    value: torch.Tensor
    query: torch.Tensor
    offsets: tuple[int, ...]  # bytes: where key, value and query start in `inputs`
    head: torch.Tensor | None  # uint8: `inputs` from the key's first byte to the query's last
    metadata: torch.Tensor  # uint8: slots, block tables, lengths, offsets packed (views below)
    # (byte offset, dtype, shape) of each of those four in `metadata`
    index_layout: tuple[tuple[int, torch.dtype, torch.Size], ...]
    slots: torch.Tensor
    block_tables: torch.Tensor  # [S, bucket width]
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    layers: torch.Tensor | None = None  # int32 [S + n] (PAGES classes): packed after query
    loaded: CachedMetadata | None = None  # whose metadata the buffers hold
    graphs: dict[int, tuple[torch.cuda.CUDAGraph, _Outputs]] = field(default_factory=dict)
    failed: set[int] = field(default_factory=set)  # layers whose capture failed
    dropped: bool = False  # evicted or cleared: a BoundGraphs holding it looks again


class DecodeGraphs:
    """Capture and replay of one pool's per-layer write-and-attend (see the module doc).

    Args:
        device: the pool's CUDA device.
        body: the pool's write then attention on validated device tensors.
        stager: the pool's host stager (host inputs reach the static buffers in one copy).
        pages_body: the same over pages of several layers (:data:`PAGES`; None: such
            calls are not replayed).
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
        pages_body: PagesBody | None = None,
    ) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        self._device = device
        self._body = body
        self._pages_body = pages_body
        self._stager = stager
        self._max_classes = max_classes
        self._classes: OrderedDict[tuple[object, ...], _Class] = OrderedDict()
        self._seen: set[tuple[tuple[object, ...], int]] = set()
        self._packed: OrderedDict[int, tuple[CachedMetadata, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()
        self._stream: torch.cuda.Stream | None = None
        self._mempool: object = None
        self.replays = 0  # calls answered by a replay (tests and diagnostics)
        self.captures = 0
        self.packed_loads = 0  # loads of key, value and query in one host-to-device copy
        self.metadata_loads = 0  # a class's metadata replaced (a new step or other callers)

    def __len__(self) -> int:
        """Graphs held."""
        return sum(len(c.graphs) for c in self._classes.values())

    def clear(self) -> None:
        """Drop every graph and static buffer."""
        with self._lock:
            for cls in self._classes.values():
                cls.dropped = True
            self._classes.clear()
            self._seen.clear()
            self._packed.clear()

    def run(
        self,
        layer: int,
        entry: CachedMetadata,
        key: Staged,
        value: Staged,
        query: Staged,
        options: AttendOptions,
        pinned: bool = False,
        check_finite: bool = False,
        layers: torch.Tensor | None = None,
        bound: bool = False,
    ) -> _Outputs | None:
        """One layer's write-and-attend through its graph.

        Args:
            layer: the layer, or :data:`PAGES` for a round over several layers.
            entry: the call's validated metadata, with its slots (``entry.slots``).
            key, value: ``[n, Hkv, D]`` new K/V (pool dtype, validated against the slots);
                with PAGES, possibly in parts (workers.parts).
            query: ``[T, Hq, D]`` (pool dtype, validated against the metadata); in parts
                too with PAGES.
            options: the attention options.
            pinned: key, value and query are in page-locked host memory: copied from there
                asynchronously (the caller waits for the copies before it lets the memory
                go), not staged.
            check_finite: the body masks the write unless every input is finite (graphs
                with and without the check are kept apart).
            layers: with PAGES, host int32 ``[S + n]``: each sequence's layer, then each
                new token's (validated).
            bound: key, value and query are device buffers that outlive the class (a
                lease client's buffers; the class is keyed by their addresses), read by
                the graph where they lie: nothing is loaded but the metadata.

        Returns:
            ``(out [T, Hq, D], lse [T, Hq] float32 or None, finite flag or None)``: tensors
            in the graph's memory when replayed (read them before the layer's graph
            replays again), fresh ones when this call ran eagerly; None when the call
            should take the pool's usual path (a first sighting, or a layer whose capture
            failed), nothing done.
        """
        if not _replayable(entry) or (layer == PAGES) != (layers is not None):
            return None
        if layer == PAGES and (self._pages_body is None or bound):
            return None
        signature = _signature(entry, key, value, query, options, check_finite, layers, bound)
        with self._lock:
            cls = self._classes.get(signature)
            if cls is not None:
                self._classes.move_to_end(signature)
                replay = cls.graphs.get(layer)
                if replay is not None:
                    self._load(cls, entry, key, value, query, pinned, layers)
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
                cls = self._new_class(signature, entry, layers, (key, value, query), bound)
            self._load(cls, entry, key, value, query, pinned, layers)
            result = self._run_body(cls, layer, options, check_finite)  # this call's own work
            try:
                cls.graphs[layer] = self._capture(cls, layer, options, check_finite)
                self.captures += 1
            except Exception:  # a capture is an optimisation: never fail the call for it
                log.exception("capturing layer %d's write-and-attend failed", layer)
                cls.failed.add(layer)
            return result

    def bind(
        self,
        entry: CachedMetadata,
        key: torch.Tensor,
        value: torch.Tensor,
        query: torch.Tensor,
        options: AttendOptions,
        check_finite: bool,
    ) -> BoundGraphs | None:
        """`run` with ``bound`` for every layer of one step on the same buffers, its class
        resolved once: None when the step is never replayed (no slots, a prefill)."""
        if not _replayable(entry):
            return None
        signature = _signature(entry, key, value, query, options, check_finite, None, True)
        return BoundGraphs(self, signature, entry, (key, value, query), options, check_finite)

    # -- internals ---------------------------------------------------------------------

    def _new_class(
        self,
        signature: tuple[object, ...],
        entry: CachedMetadata,
        layers: torch.Tensor | None,
        given: tuple[Staged, Staged, Staged],
        bound: bool,
    ) -> _Class:
        dev = self._device
        key_shape, key_dtype, value_dtype, query_shape, query_dtype = signature[:5]
        inputs = head = None
        offsets: list[int] = [0, 0, 0]
        if bound:  # the caller's buffers are the class's
            views = list(given)
        else:
            # Stand-ins of the joined shapes (no memory) lay the buffers out as the stager
            # packs.
            shapes = [(key_shape, key_dtype), (key_shape, value_dtype), (query_shape, query_dtype)]
            if layers is not None:
                shapes.append((layers.shape, layers.dtype))
            metas = [torch.empty(s, dtype=d, device="meta") for s, d in shapes]  # type: ignore[arg-type]
            offsets, total = packed_offsets(metas)
            inputs = torch.empty(total, dtype=torch.uint8, device=dev)
            views = [
                bytes_as(inputs, off, t.dtype, t.shape)
                for t, off in zip(metas, offsets, strict=True)
            ]
            query = metas[2]
            head = inputs[: offsets[2] + query.numel() * query.element_size()]
        tables = entry.block_tables
        index_shapes = [
            (entry.slots.shape, entry.slots.dtype),  # type: ignore[union-attr]
            ((tables.shape[0], bucket_width(tables.shape[1])), tables.dtype),
            (entry.seq_lens.shape, entry.seq_lens.dtype),
            (entry.query_start_loc.shape, entry.query_start_loc.dtype),
        ]
        index_metas = [torch.empty(s, dtype=d, device="meta") for s, d in index_shapes]  # type: ignore[arg-type]
        index_offsets, index_total = packed_offsets(index_metas)
        index_layout = tuple(
            (off, t.dtype, t.shape) for t, off in zip(index_metas, index_offsets, strict=True)
        )
        # Zeros: a padded table entry is never read, but must name a real block anyway.
        metadata = torch.zeros(index_total, dtype=torch.uint8, device=dev)
        cls = _Class(
            inputs,
            *views[:3],  # type: ignore[arg-type]
            offsets=tuple(offsets[:3]),
            head=head,
            metadata=metadata,
            index_layout=index_layout,
            slots=bytes_as(metadata, *index_layout[0]),
            block_tables=bytes_as(metadata, *index_layout[1]),
            seq_lens=bytes_as(metadata, *index_layout[2]),
            query_start_loc=bytes_as(metadata, *index_layout[3]),
            layers=views[3] if layers is not None else None,
        )
        self._classes[signature] = cls
        while len(self._classes) > self._max_classes:
            self._classes.popitem(last=False)[1].dropped = True
        return cls

    def _load(
        self,
        cls: _Class,
        entry: CachedMetadata,
        key: Staged,
        value: Staged,
        query: Staged,
        pinned: bool,
        layers: torch.Tensor | None = None,
    ) -> None:
        """Copy the call's tensors (and, for a new step, its metadata) into the buffers."""
        if cls.loaded is not entry:
            self._load_metadata(cls, entry)
        if cls.inputs is None:  # bound: the graph reads the caller's buffers
            return
        if layers is not None:
            # A round over pages: its parts (and layers) packed by the stager, one copy.
            staged = (key, value, query, layers)
            if self._stager is not None and all(on_host(t) for t in staged):
                self._stager.load(staged, into=cls.inputs)
            else:
                assert cls.layers is not None
                for dst, src in zip(
                    (cls.key, cls.value, cls.query, cls.layers), staged, strict=True
                ):
                    dst.copy_(joined(src), non_blocking=True)
            return
        assert isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor)
        assert isinstance(query, torch.Tensor)
        tensors = (key, value, query)
        # Pageable host memory goes through the stager's pinned buffer (one copy on the
        # CPU, one transfer); pinned host memory (a registered shared region) is copied
        # directly, asynchronously (the pool waits before returning), as are device tensors:
        # in one copy when the caller's bytes are laid out as the buffers' (about 15 us of
        # host time per copy spared on the H200 host).
        assert cls.head is not None
        if pinned and (span := _packed_span(tensors, cls.offsets, cls.head.numel())) is not None:
            cls.head.copy_(span, non_blocking=True)
            self.packed_loads += 1
        elif not pinned and self._stager is not None and all(t.is_cpu for t in tensors):
            self._stager.load(tensors, into=cls.inputs)
        else:
            for dst, src in zip((cls.key, cls.value, cls.query), tensors, strict=True):
                dst.copy_(src, non_blocking=True)

    def _load_metadata(self, cls: _Class, entry: CachedMetadata) -> None:
        """The entry's metadata into the class's buffers: a new step, or a round of other
        callers of the same shape (most rounds, when callers drift apart). In one device
        copy of the entry's metadata packed as the class packs it (`_packed_metadata`);
        or, when the loaded entry holds the very block-table and query-offset tensors
        this one does (a lease's next decode step, `StepLayers.advance`), only the slots
        and lengths: two copies, nothing packed."""
        loaded = cls.loaded
        if (
            loaded is not None
            and loaded.block_tables is entry.block_tables
            and loaded.query_start_loc is entry.query_start_loc
            and entry.slots is not None
        ):
            cls.slots.copy_(entry.slots)
            cls.seq_lens.copy_(entry.seq_lens)
        else:
            cls.metadata.copy_(self._packed_metadata(cls, entry))
        cls.loaded = entry
        self.metadata_loads += 1

    def _packed_metadata(self, cls: _Class, entry: CachedMetadata) -> torch.Tensor:
        """`entry`'s slots, block tables (padded with zeros to the class's width), lengths
        and query offsets in a device buffer laid out as ``cls.metadata``; made once per
        entry (the calls of a step's layers share it) and kept, most recent last."""
        held = self._packed.get(id(entry))
        if held is not None and held[0] is entry and held[1].shape == cls.metadata.shape:
            self._packed.move_to_end(id(entry))
            return held[1]
        assert entry.slots is not None
        packed = torch.zeros_like(cls.metadata)
        slots, tables, seq_lens, query_start_loc = (
            bytes_as(packed, *at) for at in cls.index_layout
        )
        slots.copy_(entry.slots)
        tables[:, : entry.block_tables.shape[1]].copy_(entry.block_tables)
        seq_lens.copy_(entry.seq_lens)
        query_start_loc.copy_(entry.query_start_loc)
        # Holding the entry keeps its id from being reused while the key is here.
        self._packed[id(entry)] = (entry, packed)
        while len(self._packed) > _MAX_PACKED:
            self._packed.popitem(last=False)
        return packed

    def _run_body(
        self, cls: _Class, layer: int, options: AttendOptions, check_finite: bool
    ) -> _Outputs:
        if layer == PAGES:
            assert self._pages_body is not None and cls.layers is not None
            return self._pages_body(
                cls.slots,
                cls.key,
                cls.value,
                cls.query,
                cls.block_tables,
                cls.seq_lens,
                cls.query_start_loc,
                cls.layers,
                options,
                check_finite,
            )
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
        # No garbage collection during the capture: a collected CUDA graph (another
        # pool's, dropped in a reference cycle) is destroyed in this thread, which a
        # capture in progress refuses, and that breaks the capture.
        with _collector_held():
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


# Captures holding the garbage collector off (`_collector_held`), and whether it ran before
# the first of them began: pools capture from several threads at once.
_HELD_LOCK = threading.Lock()
_held = [0, False]


@contextlib.contextmanager
def _collector_held() -> Iterator[None]:
    """The garbage collector off while any capture in this process runs (as it was before
    the first began once the last ends)."""
    with _HELD_LOCK:
        if _held[0] == 0:
            _held[1] = gc.isenabled()
            gc.disable()
        _held[0] += 1
    try:
        yield
    finally:
        with _HELD_LOCK:
            _held[0] -= 1
            if _held[0] == 0 and _held[1]:
                gc.enable()


def _replayable(entry: CachedMetadata) -> bool:
    """Whether a call of `entry` may take a graph: it writes (its slots are kept) and is
    no prefill (at most `MAX_GRAPH_ROWS_PER_SEQUENCE` query rows per sequence)."""
    return (
        entry.slots is not None
        and entry.num_rows <= MAX_GRAPH_ROWS_PER_SEQUENCE * entry.block_tables.shape[0]
    )


def _signature(
    entry: CachedMetadata,
    key: Staged,
    value: Staged,
    query: Staged,
    options: AttendOptions,
    check_finite: bool,
    layers: torch.Tensor | None,
    bound: bool,
) -> tuple:
    """The shape class of a call (`DecodeGraphs.run`'s arguments; ``entry.slots`` set):
    shapes and dtypes, the slot count, the batch, the bucketed table width, the options,
    the finite check and the layer vector's shape; for bound buffers, their addresses."""
    tables = entry.block_tables
    first_key, first_value, first_query = (_first(t) for t in (key, value, query))
    # Shapes as torch.Size: tuples (hashed and compared as the ints they hold), not
    # converted per call.
    return (
        joined_shape(key),
        first_key.dtype,
        first_value.dtype,
        joined_shape(query),
        first_query.dtype,
        entry.slots.shape,  # type: ignore[union-attr]
        tables.shape[0],
        bucket_width(tables.shape[1]),
        options,
        check_finite,
        None if layers is None else layers.shape,
        (first_key.data_ptr(), first_value.data_ptr(), first_query.data_ptr()) if bound else None,
    )


def _first(t: Staged) -> torch.Tensor:
    """A tensor, or the first of its parts (their dtype is the tensor's)."""
    return t if isinstance(t, torch.Tensor) else t[0]


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


class BoundGraphs:
    """One step's layers on a lease client's fixed buffers (`DecodeGraphs.bind`): a
    layer whose graph exists is one replay, with no per-call class lookup; any other goes
    through `DecodeGraphs.run` (which runs it eagerly, or captures it)."""

    def __init__(
        self,
        graphs: DecodeGraphs,
        signature: tuple[object, ...],
        entry: CachedMetadata,
        inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        options: AttendOptions,
        check_finite: bool,
    ) -> None:
        self._graphs = graphs
        self._signature = signature
        self._entry = entry
        self._inputs = inputs
        self._options = options
        self._check_finite = check_finite
        self._cls: _Class | None = None

    def advance(self, entry: CachedMetadata) -> None:
        """Go on to the next step of the same shape class on the same buffers (a lease's
        next decode step: `StepLayers.advance`); its metadata is loaded at its first
        replay."""
        self._entry = entry

    def run(self, layer: int) -> _Outputs | None:
        """As `DecodeGraphs.run` of this step's layer `layer` (None: run it the pool's
        usual way; nothing done)."""
        graphs = self._graphs
        with graphs._lock:
            cls = self._cls
            if cls is None or cls.dropped:
                # Not made yet when the step began (its first sighting), or dropped since.
                cls = self._cls = graphs._classes.get(self._signature)
            if cls is not None and (replay := cls.graphs.get(layer)) is not None:
                if cls.loaded is not self._entry:
                    graphs._load_metadata(cls, self._entry)
                replay[0].replay()
                graphs.replays += 1
                return replay[1]
        key, value, query = self._inputs
        return graphs.run(
            layer, self._entry, key, value, query, self._options, False, self._check_finite,
            bound=True,
        )  # fmt: skip
