"""One device's KV block pool: the tensor, its per-layer views, and the operations on it.

The pool is a single tensor ``[num_blocks, L, 2, Hkv, block_size, D]``: a physical block is
one contiguous run (all layers, K and V), so copying, exporting or importing a block is one
copy. Per layer, ``key_cache(layer)`` / ``value_cache(layer)`` are
``[num_blocks, Hkv, block_size, D]`` views with a dim-0 stride of ``L * 2 * Hkv * bs * D``,
which the kernels accept.

Every method validates its arguments (:mod:`workers.checks`) before touching the pool, then
moves them to the pool's device. Results stay on the pool's device (the actor moves them to
the host).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import torch

import kernels
from kernels.attention import num_sms
from workers.checks import (
    AttendOptions,
    check_attend,
    check_block_data,
    check_block_ids,
    check_layer,
    check_new_kv,
    check_write,
)
from workers.config import PoolConfig
from workers.decode_graphs import PAGES, BoundGraphs, DecodeGraphs
from workers.delivery import (
    AttendResult,
    Delivery,
    PartsResult,
    all_finite_on_host,
    guard_finite,
    host_out,
)
from workers.errors import InvalidWorkerRequest, PoolAllocationError
from workers.fingerprints import BadSlot, SlotFingerprints
from workers.host_tier import HostTier, check_move
from workers.kernel_warmup import decode_warm_up_launches, dummy_decode_inputs
from workers.layout import KVLayout
from workers.metadata_cache import CachedMetadata, MetadataCache
from workers.pages import check_page_count, layer_vector, page_caches, page_tables, to_pages
from workers.parts import check_out_parts, joined, on_host, stand_in
from workers.pool_memory import allocate
from workers.reference_check import ReferenceInputs, reference_attention
from workers.round import Round
from workers.sizing import free_device_bytes, resolve_device, resolve_num_blocks
from workers.staging import HostStager, Staged, attend_inputs, write_inputs

__all__ = [
    "AttendResult",
    "IndexLike",
    "KVPool",
    "MappedPool",
    "PartsResult",
    "ReferenceInputs",
    "Round",
    "StepLayers",
    "resolve_device",
]

IndexLike = torch.Tensor | Sequence[int]
_T = TypeVar("_T")
_DEFAULT_OPTIONS = AttendOptions()


@dataclass(frozen=True)
class MappedPool:
    """Another process's pool memory, mapped into this one (`workers.pool_memory`).

    Attributes:
        data: the pool tensor ``[num_blocks, L, 2, Hkv, block_size, D]``.
        fingerprint_sums: the pool's slot fingerprints (`SlotFingerprints.sums`), or None
            when the pool keeps none.
    """

    data: torch.Tensor
    fingerprint_sums: torch.Tensor | None = None


class KVPool:
    """The K/V blocks of one device for one layout.

    Args:
        layout: the KV layout.
        num_blocks: blocks in the pool.
        device: where the pool lives (see :func:`resolve_device`).
        debug: fill the fresh pool and released blocks with NaN (stale reads show up).
        backend: kernels backend ("auto", "triton", "torch").
        fingerprints: keep per-slot fingerprints of what was written, for
            :meth:`reference_attend` (the online correctness check).
        cuda_graphs: on CUDA with Triton kernels, replay the repeated per-layer calls of
            decode steps as CUDA graphs (:mod:`workers.decode_graphs`).
        host_blocks: blocks of a host tier for this pool (:mod:`workers.host_tier`); 0: none.
        mapped: the pool's memory made by another process and mapped into this one
            (`workers.lease_client`: a co-located client runs a leased step on the worker's
            pool); `num_blocks` must be its first dimension. None: allocated here, in
            memory another process can map (`workers.pool_memory`).

    Raises:
        PoolAllocationError: the size is malformed or does not fit on the device.
    """

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        device: str | torch.device | None = "cpu",
        *,
        debug: bool = False,
        backend: str = "auto",
        fingerprints: bool = False,
        cuda_graphs: bool = True,
        host_blocks: int = 0,
        mapped: MappedPool | None = None,
    ) -> None:
        # PoolConfig validates the size and the backend; keep one set of rules.
        config = PoolConfig(layout, num_blocks=num_blocks, debug=debug, backend=backend)
        self._layout = layout
        self._device = resolve_device(device)
        self._num_blocks = resolve_num_blocks(config, self._device)
        self._debug = debug
        self._backend = backend
        shape = (self._num_blocks, *layout.block_shape)
        if mapped is not None:
            self._data = mapped.data
            if tuple(mapped.data.shape) != shape or mapped.data.dtype != layout.torch_dtype():
                raise PoolAllocationError(
                    f"a mapped pool of {tuple(mapped.data.shape)} {mapped.data.dtype} is not "
                    f"{shape} {layout.torch_dtype()}"
                )
        else:
            fill = math.nan if debug else 0.0
            try:
                # Zeros rather than empty(): recycled device memory may hold NaNs that a
                # masked but multiplied-by-zero lane would spread.
                self._data = allocate(shape, layout.torch_dtype(), self._device, fill)
            except (torch.OutOfMemoryError, OSError) as exc:
                raise PoolAllocationError(
                    f"allocating {self._num_blocks} blocks ({self._num_blocks * layout.bytes_per_block}"
                    f" bytes) on {self._device} failed: {exc}"
                ) from None
        # Each layer's K and V caches, viewed once: a view costs microseconds of host time,
        # and a decode step takes two per layer.
        self._layer_caches = [
            (self._data[:, layer, 0], self._data[:, layer, 1]) for layer in range(layout.num_layers)
        ]
        sums = mapped.fingerprint_sums if mapped is not None else None
        self._fingerprints = (
            SlotFingerprints(layout, self._num_blocks, self._device, sums)
            if fingerprints or sums is not None
            else None
        )
        self._host_tier = (
            HostTier(layout, host_blocks, self._device)
            if host_blocks and not isinstance(host_blocks, bool)
            else None
        )
        # Requests arrive on the host: a GPU pool takes each request's tensors in one copy.
        self._stager = HostStager(self._device) if self._device.type == "cuda" else None
        self._delivery = Delivery(self._device, self._stager)
        # The attention metadata of recent decode steps, validated and on the device.
        self._metadata = MetadataCache()
        self._graphs = (
            DecodeGraphs(
                self._device,
                self._write_and_attend_on_device,
                self._stager,
                pages_body=self._write_and_attend_layers_on_device,
            )
            if cuda_graphs and self._device.type == "cuda" and backend != "torch"
            else None
        )

    @classmethod
    def from_config(cls, config: PoolConfig, device: str | torch.device | None = None) -> KVPool:
        """A pool sized by ``config`` (a block count, or a fraction of free device memory)."""
        dev = resolve_device(device)
        return cls(
            config.layout,
            resolve_num_blocks(config, dev),
            dev,
            debug=config.debug,
            backend=config.backend,
            fingerprints=config.fingerprints,
            cuda_graphs=config.cuda_graphs,
            host_blocks=config.host_blocks,
        )

    @classmethod
    def serving(cls, config: PoolConfig, device: str | torch.device | None = None) -> KVPool:
        """`from_config`, then the warm-up the config asks for (`warm_up`): the pool a
        worker serves from."""
        pool = cls.from_config(config, device)
        if config.warm_up_query_heads:
            pool.warm_up(config.warm_up_query_heads, config.warm_up_max_batch)
        return pool

    # -- shape -------------------------------------------------------------------------

    @property
    def layout(self) -> KVLayout:
        return self._layout

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_slots(self) -> int:
        """Token slots: ``num_blocks * block_size``."""
        return self._num_blocks * self._layout.block_size

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def debug(self) -> bool:
        return self._debug

    @property
    def nbytes(self) -> int:
        """Bytes of the pool tensor."""
        return self._data.numel() * self._data.element_size()

    @property
    def data(self) -> torch.Tensor:
        """The pool tensor ``[num_blocks, L, 2, Hkv, block_size, D]`` (shared, not a copy)."""
        return self._data

    @property
    def fingerprint_sums(self) -> torch.Tensor | None:
        """The slot fingerprints' store (`SlotFingerprints.sums`), or None: none kept."""
        return self._fingerprints.sums if self._fingerprints is not None else None

    def key_cache(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s K view ``[num_blocks, Hkv, block_size, D]``."""
        check_layer(layer, self._layout.num_layers)
        return self._layer_caches[layer][0]

    def value_cache(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s V view ``[num_blocks, Hkv, block_size, D]``."""
        check_layer(layer, self._layout.num_layers)
        return self._layer_caches[layer][1]

    def free_bytes(self) -> int:
        """Free memory on the pool's device, bytes."""
        return free_device_bytes(self._device)

    # -- data ops ----------------------------------------------------------------------

    def write(
        self,
        layer: int | None,
        slot_mapping: IndexLike,
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> None:
        """Write new tokens' K/V into their slots.

        Args:
            layer: layer index, or None to write every layer.
            slot_mapping: int ``[n]`` flat slots (``block * block_size + offset``); negative
                entries are skipped; the others distinct.
            key, value: ``[n, Hkv, D]`` (``[L, n, Hkv, D]`` with ``layer=None``), pool dtype.

        Raises:
            InvalidWorkerRequest: a malformed argument; nothing was written.
        """
        slots = check_write(self._layout, self._num_blocks, layer, slot_mapping, key, value)
        self._write_checked(layer, slots, key, value)

    def run_round(self, round: Round, *, to_host: bool = False) -> AttendResult | PartsResult:
        """One worker call of an attention round (:class:`workers.round.Round`): the write
        of its new tokens, if it has any, then paged attention over its sequences.

        The pool picks how: a round on one layer with whole tensors runs on that layer (on
        CUDA, a write under a known step key replays a graph of the write and the
        attention: :mod:`workers.decode_graphs`); any other round (sequences of several
        layers, or tensors in parts: a coordinator's round of several callers) runs over
        pages of every layer, page ``block * num_layers + layer``, whose tables and slots
        are made here on the device from the round's per-layer ones (one launch of each
        kernel; on CUDA one graph per round shape under a known key, whichever layers).

        Both halves are validated before the write: a refused round (a malformed argument,
        NonFiniteInput with ``check_finite``) writes nothing and leaves `round.out`
        untouched. The round's step key names its metadata (`workers.metadata_cache`):
        validated and kept on the device on first sight, reused by later rounds under it;
        a round without index tensors asks for the key's.

        Args:
            round: the round (shapes and dtypes in its docstring).
            to_host: return the results on the host (in pinned memory, copied when the
                call is done) rather than on the pool's device; with it, `round.out` (host
                memory of the output's shape and dtype, or one part per query part)
                receives the output, and the result's output is then `round.out`.

        Returns:
            out ``[T, Hq, D]`` (pool dtype), or the parts of `round.out`; with
            ``options.return_lse`` also lse float32 ``[T, Hq]`` (natural log; -inf for a
            row that saw no key).

        Raises:
            InvalidWorkerRequest: a malformed argument (a layer outside the layout, layers
                not one per sequence and per new token, an unknown step key without index
                tensors); NonFiniteInput (``check_finite``).
        """
        options = round.options or _DEFAULT_OPTIONS
        layers = round.layers
        in_parts = type(round.query) is list or type(round.key) is list
        if type(layers) is int and not in_parts:
            if round.slot_mapping is None:
                return self._attend(layers, round, options, to_host)
            return self._write_and_attend(layers, round, options, to_host)
        if round.slot_mapping is None:
            return self._attend_over_layers(round, options, to_host)
        return self._write_and_attend_over_layers(round, options, to_host)

    def step_metadata(
        self,
        block_tables: torch.Tensor | Sequence[Sequence[int]],
        seq_lens: IndexLike,
        query_start_loc: IndexLike,
        slot_mapping: Sequence[int],
        num_q_heads: int,
    ) -> CachedMetadata:
        """A planned step's metadata validated once and kept on the pool's device, for its
        layers (:meth:`bind_step`): :meth:`check_step`, then :meth:`planned_step`.

        Raises:
            InvalidWorkerRequest: malformed metadata or slots.
        """
        return self.planned_step(
            *self.check_step(block_tables, seq_lens, query_start_loc, slot_mapping, num_q_heads)
        )

    def check_step(
        self,
        block_tables: torch.Tensor | Sequence[Sequence[int]],
        seq_lens: IndexLike,
        query_start_loc: IndexLike,
        slot_mapping: Sequence[int],
        num_q_heads: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """A planned step's metadata checked against this pool's size and layout, as a
        round's is: what a round's first sighting of a step key checks.

        Args:
            block_tables: int ``[S, max_blocks]``; seq_lens: int ``[S]``; query_start_loc:
                int ``[S + 1]`` (as in :class:`workers.round.Round`).
            slot_mapping: the step's new tokens' flat slots ``[n]`` (no negative ones).
            num_q_heads: query heads of the step's layers.

        Returns:
            Host tensors: block tables, lengths, query offsets (int32) and slots (int64).

        Raises:
            InvalidWorkerRequest: malformed metadata or slots.
        """
        lay = self._layout
        if type(num_q_heads) is not int or num_q_heads < 1 or num_q_heads % lay.num_kv_heads:
            raise InvalidWorkerRequest(
                f"num_q_heads must be a positive multiple of {lay.num_kv_heads}, got {num_q_heads!r}"
            )
        starts = torch.as_tensor(query_start_loc)
        if starts.ndim != 1 or starts.numel() < 2 or not 0 < int(starts[-1]) <= 1 << 20:
            raise InvalidWorkerRequest(
                f"query_start_loc must be [S + 1] ending in 1 to 2**20 rows, got {starts.tolist()[:8]}"
            )
        if any(type(s) is not int or s < 0 for s in slot_mapping):
            raise InvalidWorkerRequest("a leased step's slots must be non-negative ints")
        rows, dtype = int(starts[-1]), lay.torch_dtype()
        new_kv = torch.empty((len(slot_mapping), lay.num_kv_heads, lay.head_dim), dtype=dtype)
        query = torch.empty((rows, num_q_heads, lay.head_dim), dtype=dtype)
        slots = check_write(lay, self._num_blocks, 0, slot_mapping, new_kv, new_kv)
        indices = check_attend(lay, self._num_blocks, 0, query, block_tables, seq_lens, starts)
        _, tables, lens, starts = attend_inputs(query, *indices)
        return tables.cpu(), lens.cpu(), starts.cpu(), slots.to("cpu", torch.int64)

    def planned_step(
        self,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> CachedMetadata:
        """:meth:`step_metadata` of metadata validated already against this pool's size
        and layout (a lease's plan, which the worker's grant checked): host int tensors
        (tables, lengths, offsets int32; slots int64) moved to the pool's device in one
        copy (the slots as int32 where the pool's slot numbers fit)."""
        wide = self.num_slots >= 1 << 31
        parts = (block_tables, seq_lens, query_start_loc) + (() if wide else (slot_mapping,))
        flat = torch.cat([t.reshape(-1).to(torch.int32) for t in parts])
        if self._device.type == "cuda":
            # From pageable memory the copy would wait for the stream's queued work.
            flat = flat.pin_memory().to(self._device, non_blocking=True)
        tables, lens, starts, *slots = flat.split([t.numel() for t in parts])
        on_device = slot_mapping.to(self._device) if wide else slots[0]
        rows = int(query_start_loc[-1])
        return CachedMetadata(
            tables.view(block_tables.shape), lens, starts, rows, None, on_device.to(torch.int64)
        )

    def bind_step(
        self,
        step: CachedMetadata,
        key: torch.Tensor,
        value: torch.Tensor,
        query: torch.Tensor,
        options: AttendOptions = _DEFAULT_OPTIONS,
    ) -> StepLayers:
        """A planned step (:meth:`step_metadata`, :meth:`planned_step`) bound to the
        buffers its layers' inputs arrive in: :meth:`StepLayers.run` then runs one layer.

        Args:
            key, value: ``[n, Hkv, D]``; query: ``[rows, Hq, D]``, n and rows the step's,
                in the pool's dtype on its device: the caller's fixed buffers (a lease
                client's, `workers.lease_client`), refilled layer after layer (the graphs
                are keyed by their addresses). The caller sized them for the step.
        """
        graphs = None
        if self._graphs is not None:
            graphs = self._graphs.bind(step, key, value, query, options, True)
        return StepLayers(self, step, (key, value, query), options, graphs)

    @property
    def metadata_hits(self) -> int:
        """Rounds whose metadata (block tables, lengths, query offsets) came from the copy
        kept under their step key instead of being validated and copied again."""
        return self._metadata.hits

    def warm_up(self, num_q_heads: Sequence[int], max_batch: int) -> int:
        """Compile, before serving, the kernel variants that decode calls will need: one
        attention launch per distinct launch configuration (`workers.kernel_warmup`) for
        each query head count, over block 0, and masked writes (per layer and by pages)
        that touch no slot. A CUDA pool running Triton kernels only; elsewhere nothing is
        compiled and nothing runs.

        Args:
            num_q_heads: the query head counts callers will use (each a multiple of the
                layout's KV heads).
            max_batch: the most sequences one call will carry.

        Returns:
            The attention launches made (0 where nothing is compiled).

        Raises:
            ValueError: a head count that is not a positive multiple of the KV heads.
        """
        if self._device.type != "cuda" or self._backend == "torch":
            return 0
        lay = self._layout
        sm_count = num_sms(self._device)
        plans = [
            launch
            for hq in num_q_heads
            for launch in decode_warm_up_launches(lay, hq, max_batch, sm_count)
        ]
        options = AttendOptions()
        for launch in plans:
            self._attend_on_device(0, *dummy_decode_inputs(launch, lay, self._device), options)
        # Slot -1 is skipped by the write (and lands in the fingerprints' spare row).
        nowhere = torch.full((1,), -1, dtype=torch.int64, device=self._device)
        kv = torch.zeros(
            (1, lay.num_kv_heads, lay.head_dim), dtype=self._data.dtype, device=self._device
        )
        self._write_on_device(0, nowhere, kv, kv)
        self._write_pages_on_device(nowhere, kv, kv)
        torch.cuda.synchronize(self._device)
        return len(plans)

    def reference_attend(
        self,
        layer: int,
        query: torch.Tensor,
        block_tables: torch.Tensor | Sequence[Sequence[int]],
        seq_lens: IndexLike,
        query_start_loc: IndexLike,
        *,
        causal: bool = True,
        return_lse: bool = False,
        scale: float | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[BadSlot]]:
        """The attention of a round on one layer recomputed by the torch reference, plus a fingerprint check of every
        slot it reads (the online correctness check): :meth:`reference_inputs` then
        :meth:`reference_output`.

        Returns:
            ``(out [T, Hq, D] pool dtype, lse float32 [T, Hq] or None, bad slots)``; the bad
            slots are empty when fingerprints are off (``fingerprints=False``) or all match.

        Raises:
            InvalidWorkerRequest: a malformed argument.
        """
        options = AttendOptions(causal, return_lse, scale, sliding_window, softcap)
        inputs = self.reference_inputs(
            layer, query, block_tables, seq_lens, query_start_loc, options
        )
        out, lse = self.reference_output(inputs)
        return out, lse, inputs.bad

    def reference_inputs(
        self,
        layer: int,
        query: torch.Tensor,
        block_tables: torch.Tensor | Sequence[Sequence[int]],
        seq_lens: IndexLike,
        query_start_loc: IndexLike,
        options: AttendOptions,
    ) -> ReferenceInputs:
        """The first half of :meth:`reference_attend`, the part that uses the pool's shared
        state (the host stager) and so must run under the caller's lock: the arguments
        validated and on the device in tensors of their own, and the fingerprint check.

        Raises:
            InvalidWorkerRequest: a malformed argument.
        """
        tables, lens, starts = check_attend(
            self._layout, self._num_blocks, layer, query, block_tables, seq_lens, query_start_loc
        )
        # Own copies: the stager's views last only until its next request.
        on_device = self._on_device(*attend_inputs(query, tables, lens, starts))
        q, t, n, s = (x.clone() for x in on_device)
        bad: list[BadSlot] = []
        if self._fingerprints is not None:
            bad = self._fingerprints.check(self._data, layer, t, n)
        return ReferenceInputs(layer, q, t, n, s, options, bad)

    def reference_output(self, inputs: ReferenceInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The second half of :meth:`reference_attend`: the torch reference over the pool's
        blocks, ``(out [T, Hq, D] pool dtype, lse float32 [T, Hq] or None)``.

        Uses no shared state of the pool but the blocks it reads, so a worker may run it
        outside its lock, beside other calls: the online check's recomputation is most of
        its time and would otherwise hold up every call behind it. Whatever those calls
        write lands in slots the reference does not read (positions past `seq_lens`, other
        layers, other blocks) unless a block it reads was freed and reused meanwhile, and
        the coordinator discards such a check (cache_service.engine.running_checks).
        """
        layer = inputs.layer
        return reference_attention(inputs, *self._layer_caches[layer])

    def copy_blocks(self, src: IndexLike, dst: IndexLike) -> None:
        """Copy whole blocks (all layers, K and V) ``src[i] -> dst[i]`` (copy-on-write).

        ``dst`` ids are distinct; sources are read before any destination is written.
        """
        src_ids = check_block_ids("src", src, self._num_blocks, distinct=False)
        dst_ids = check_block_ids("dst", dst, self._num_blocks, distinct=True)
        if src_ids.shape != dst_ids.shape:
            raise InvalidWorkerRequest(
                f"src has {src_ids.shape[0]} entries but dst has {dst_ids.shape[0]}"
            )
        if not src_ids.numel():
            return
        # The K and V halves, not the pool twice: copying one tensor twice would re-read
        # sources that the first pass already overwrote when src and dst overlap.
        src_dev = self._to_device(src_ids, torch.int64)
        dst_dev = self._to_device(dst_ids, torch.int64)
        self._kernel(
            kernels.copy_blocks, self._data[:, :, 0], self._data[:, :, 1], src_dev, dst_dev
        )
        if self._fingerprints is not None:
            self._fingerprints.copy_blocks(src_dev, dst_dev)

    def export_blocks(self, block_ids: IndexLike) -> torch.Tensor:
        """Copies of the listed blocks ``[n, L, 2, Hkv, block_size, D]`` on the host."""
        ids = check_block_ids("block_ids", block_ids, self._num_blocks, distinct=False)
        out = self._data.index_select(0, self._to_device(ids, torch.int64))
        return out.cpu()

    def import_blocks(self, block_ids: IndexLike, data: torch.Tensor) -> None:
        """Overwrite the listed (distinct) blocks with ``data`` ``[n, L, 2, Hkv, bs, D]``
        (what :meth:`export_blocks` returns, from any pool of the same layout)."""
        ids = check_block_ids("block_ids", block_ids, self._num_blocks, distinct=True)
        check_block_data(data, ids.shape[0], self._layout)
        if not ids.numel():
            return
        ids_dev = self._to_device(ids, torch.int64)
        data_dev = data.to(self._device)
        self._data.index_copy_(0, ids_dev, data_dev)
        if self._fingerprints is not None:
            self._fingerprints.record_blocks(ids_dev, data_dev)

    @property
    def host_blocks(self) -> int:
        """Blocks of the pool's host tier (0: none)."""
        return self._host_tier.num_blocks if self._host_tier is not None else 0

    def offload_blocks(self, block_ids: IndexLike, host_ids: IndexLike) -> int:
        """Copy blocks ``block_ids[i]`` (all layers, K and V) to host tier blocks
        ``host_ids[i]`` (distinct), in one batched copy (:class:`HostTier`).

        Returns:
            Bytes copied.

        Raises:
            InvalidWorkerRequest: no host tier, ids out of range, repeated host ids, or
                lists of different lengths.
        """
        tier = self._require_host_tier()
        src = check_move("block_ids", block_ids, self._num_blocks, distinct=False)
        dst = check_move("host_ids", host_ids, tier.num_blocks, distinct=True)
        _same_length(src, dst)
        return tier.offload(self._data, src, dst)

    def restore_blocks(self, host_ids: IndexLike, block_ids: IndexLike) -> int:
        """Copy host tier blocks ``host_ids[i]`` into blocks ``block_ids[i]`` (distinct) in
        one batched copy; every later kernel on the pool reads the restored bytes.

        Returns:
            Bytes copied.

        Raises:
            InvalidWorkerRequest: as `offload_blocks`.
        """
        tier = self._require_host_tier()
        src = check_move("host_ids", host_ids, tier.num_blocks, distinct=False)
        dst = check_move("block_ids", block_ids, self._num_blocks, distinct=True)
        _same_length(src, dst)
        moved = tier.restore(self._data, src, dst)
        if self._fingerprints is not None and dst:
            ids = torch.tensor(dst, dtype=torch.int64, device=self._device)
            self._fingerprints.record_blocks(ids, self._data.index_select(0, ids))
        return moved

    def _require_host_tier(self) -> HostTier:
        if self._host_tier is None:
            raise InvalidWorkerRequest("this pool has no host tier (PoolConfig.host_blocks = 0)")
        return self._host_tier

    def release_blocks(self, block_ids: IndexLike) -> None:
        """The listed blocks are no longer used: in debug mode poison them with NaN (a later
        read without a write shows up as NaN output); otherwise only validate the ids."""
        ids = check_block_ids("block_ids", block_ids, self._num_blocks, distinct=False)
        if self._debug and ids.numel():
            self._data.index_fill_(0, self._to_device(ids, torch.int64), math.nan)

    # -- internals ---------------------------------------------------------------------

    def _to_device(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return t.to(device=self._device, dtype=dtype)

    def _attend(self, layer: int, r: Round, options: AttendOptions, to_host: bool) -> AttendResult:
        """An attend-only round on one layer (one kernel launch)."""
        check_layer(layer, self._layout.num_layers)
        query, batch = r.query, r.metadata()
        entry = self._metadata.lookup(r.step_key, self._layout, query, *batch)
        if entry is not None:
            (q,) = self._on_device(query)
            result = self._attend_on_device(layer, q, *entry.tables(), options)
            return self._delivery.deliver(result, to_host)
        indices = check_attend(self._layout, self._num_blocks, layer, query, *batch)
        staged = self._on_device(*attend_inputs(query, *indices))
        self._metadata.remember(r.step_key, staged[1:], query.shape[0])
        return self._delivery.deliver(self._attend_on_device(layer, *staged, options), to_host)

    def _write_and_attend(
        self, layer: int, r: Round, options: AttendOptions, to_host: bool
    ) -> AttendResult:
        """A round on one layer with whole tensors: one write launch, one attention launch;
        on CUDA a graph replay for another layer of a known step (its slots validated and
        on the device already)."""
        slot_mapping, key, value, query = r.slot_mapping, r.key, r.value, r.query
        step_key, check_finite = r.step_key, r.check_finite
        out = host_out(r.out, to_host, self._data.dtype, query.shape)
        check_layer(layer, self._layout.num_layers)
        batch = r.metadata()
        entry = self._metadata.lookup(step_key, self._layout, query, *batch)
        if entry is not None and entry.slots is not None and entry.same_slots(slot_mapping):
            check_new_kv(self._layout, layer, entry.slots.shape[0], key, value)
            pinned = self._delivery.pinned_host(key, value, query)
            if self._graphs is not None:
                replayed = self._graphs.run(
                    layer, entry, key, value, query, options, pinned, check_finite
                )
                if replayed is not None:
                    # A replay's results live in the graph's memory: copied out here.
                    return self._delivery.finish(
                        replayed, options, to_host, owned=False, wait=pinned, out=out
                    )
            k, v, q = self._on_device(key, value, query, pinned=pinned)
            done = self._write_and_attend_on_device(
                layer, entry.slots, k, v, q, *entry.tables(), options, check_finite, entry
            )
            return self._delivery.finish(done, options, to_host, wait=pinned, out=out)
        slots = check_write(self._layout, self._num_blocks, layer, slot_mapping, key, value)
        if entry is not None:
            staged = self._on_device(*write_inputs(slots, key, value), query)
            # The key's other layers will find these slots kept.
            self._metadata.keep(step_key, entry, slot_mapping, staged[0])
            done = self._write_and_attend_on_device(
                layer, *staged, *entry.tables(), options, check_finite
            )
            return self._delivery.finish(done, options, to_host, out=out)
        indices = check_attend(self._layout, self._num_blocks, layer, query, *batch)
        # Both halves' tensors reach the device in one staged copy.
        staged = self._on_device(*write_inputs(slots, key, value), *attend_inputs(query, *indices))
        self._metadata.remember(step_key, staged[4:], query.shape[0], slot_mapping, staged[0])
        done = self._write_and_attend_on_device(layer, *staged, options, check_finite)
        return self._delivery.finish(done, options, to_host, out=out)

    def _write_and_attend_over_layers(
        self, r: Round, options: AttendOptions, to_host: bool
    ) -> AttendResult | PartsResult:
        """A round of several layers or in parts: the write and the attention over pages
        (`_write_and_attend_layers_on_device`), each caller's tensors read where they lie
        and each output part delivered into `r.out`'s parts; on CUDA a graph replay of the
        whole round under a known key, whichever layers its sequences are on."""
        lay = self._layout
        check_page_count(self._num_blocks, lay)
        key, value, query, check_finite = r.key, r.value, r.query, r.check_finite
        whole = (stand_in("key", key), stand_in("value", value), stand_in("query", query))
        outs = check_out_parts(r.out, whole[2]) if type(r.out) is list else None
        entry = self._metadata.lookup(r.step_key, lay, whole[2], *r.metadata())
        if entry is not None and entry.slots is not None and entry.same_slots(r.slot_mapping):
            check_new_kv(lay, 0, entry.slots.shape[0], whole[0], whole[1])
            layers = self._layer_vector(r, entry.block_tables.shape[0], entry.slots.shape[0])
            if self._graphs is not None:
                replayed = self._graphs.run(
                    PAGES, entry, key, value, query, options, False, check_finite, layers
                )
                if replayed is not None:
                    return self._delivery.finish(replayed, options, to_host, owned=False, out=outs)
            k, v, q, layers_on = self._on_device(key, value, query, layers)
            done = self._write_and_attend_layers_on_device(
                entry.slots, k, v, q, *entry.tables(), layers_on, options, check_finite
            )
            return self._delivery.finish(done, options, to_host, out=outs)
        slots = check_write(lay, self._num_blocks, 0, r.slot_mapping, whole[0], whole[1])
        if entry is not None:
            layers = self._layer_vector(r, entry.block_tables.shape[0], slots.shape[0])
            staged = self._on_device(*write_inputs(slots, key, value), query, layers)
            self._metadata.keep(r.step_key, entry, r.slot_mapping, staged[0])
            done = self._write_and_attend_layers_on_device(
                *staged[:4], *entry.tables(), staged[4], options, check_finite
            )
            return self._delivery.finish(done, options, to_host, out=outs)
        indices = check_attend(lay, self._num_blocks, 0, whole[2], *r.metadata())
        layers = self._layer_vector(r, indices[0].shape[0], slots.shape[0])
        staged = self._on_device(
            *write_inputs(slots, key, value), *attend_inputs(query, *indices), layers
        )
        self._metadata.remember(
            r.step_key, staged[4:7], whole[2].shape[0], r.slot_mapping, staged[0]
        )
        done = self._write_and_attend_layers_on_device(*staged, options, check_finite)
        return self._delivery.finish(done, options, to_host, out=outs)

    def _attend_over_layers(self, r: Round, options: AttendOptions, to_host: bool) -> AttendResult:
        """An attend-only round of sequences on several layers: one launch over pages."""
        lay = self._layout
        check_page_count(self._num_blocks, lay)
        query = r.query
        whole = stand_in("query", query)
        entry = self._metadata.lookup(r.step_key, lay, whole, *r.metadata())
        if entry is not None:
            layers = self._layer_vector(r, entry.block_tables.shape[0], 0)
            q, layers_on = self._on_device(query, layers)
            tables, lens, starts = entry.tables()
        else:
            indices = check_attend(lay, self._num_blocks, 0, whole, *r.metadata())
            layers = self._layer_vector(r, indices[0].shape[0], 0)
            q, tables, lens, starts, layers_on = self._on_device(
                *attend_inputs(query, *indices), layers
            )
            self._metadata.remember(r.step_key, (tables, lens, starts), whole.shape[0])
        pages = page_tables(tables, layers_on, lay)
        result = self._attend_on_device(None, q, pages, lens, starts, options)
        return self._delivery.deliver(result, to_host)

    def _layer_vector(self, r: Round, num_seqs: int, num_slots: int) -> torch.Tensor:
        """Host int32 ``[num_seqs + num_slots]``: the layer of each of the round's sequences
        then of each new token (`r.layers` one int for all, or one per sequence with
        `r.slot_layers` one per new token), validated.

        Raises:
            InvalidWorkerRequest: a layer outside the layout, or not one per sequence and
                per new token.
        """
        layers = r.layers
        if type(layers) is int:
            check_layer(layers, self._layout.num_layers)
            return torch.full((num_seqs + num_slots,), layers, dtype=torch.int32)
        slot_layers = r.slot_layers if num_slots or r.slot_layers is not None else []
        return layer_vector(layers, slot_layers, num_seqs, num_slots, self._layout)

    def _write_and_attend_on_device(
        self,
        layer: int,
        slots: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        query: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        options: AttendOptions,
        check_finite: bool,
        kept: CachedMetadata | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The write (guarded by `check_finite`), then the attention, on validated device
        tensors: what every one-layer round runs, and what a decode graph captures.
        `kept`: the metadata these tensors came from, kept for the step's other layers (a
        CPU pool plans the write's rows and the attention's gathers once there).
        Returns (out, lse or None, finite flag or None)."""
        planned = self._planned_rows(kept) if kept is not None else None
        if planned is None:
            slots, finite = guard_finite(slots, key, value, query, check_finite)
            self._write_on_device(layer, slots, key, value)
        else:  # a CPU pool: the flag is read on the spot, which costs nothing there
            checked = check_finite and slots.numel() > 0
            ok = not checked or all_finite_on_host(key, value, query)
            if ok:
                self._write_rows_on_device(layer, planned, key, value)
            finite = torch.tensor(ok) if checked else None
        result = self._attend_on_device(
            layer, query, block_tables, seq_lens, query_start_loc, options, kept
        )
        out, lse = result if isinstance(result, tuple) else (result, None)
        return out, lse, finite

    def _planned_rows(self, kept: CachedMetadata) -> _PlannedRows | None:
        """Where a CPU pool writes a kept step's new tokens on any layer: their rows
        (`kernels.slot_rows`) and their fingerprints' places
        (`SlotFingerprints.planned_places`), derived once for the step's layers; None on
        other devices, where the write reads its slots on the device (a guarded write's
        slots are masked there), or without slots."""
        if self._device.type != "cpu" or kept.slots is None:
            return None
        planned = kept.derived.get("write_rows")
        if planned is None:
            fingerprints = self._fingerprints
            planned = kept.derived["write_rows"] = _PlannedRows(
                kernels.slot_rows(self._data[:, 0, 0], kept.slots),
                fingerprints.planned_places(kept.slots) if fingerprints is not None else None,
            )
        return planned

    def _write_rows_on_device(
        self, layer: int, planned: _PlannedRows, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """:meth:`_write_on_device` of one layer of a kept step, at the places
        :meth:`_planned_rows` derived."""
        dtype = self._data.dtype
        key, value = key.to(dtype), value.to(dtype)
        kernels.write_rows(planned.rows, key, value, *self._layer_caches[layer])
        if self._fingerprints is not None and planned.fingerprint_places is not None:
            self._fingerprints.record_at(planned.fingerprint_places[layer], key, value)

    def _write_and_attend_layers_on_device(
        self,
        slots: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        query: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        layers: torch.Tensor,
        options: AttendOptions,
        check_finite: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """A round over layers on validated device tensors: the page tables and page
        slots computed here from the per-layer ones and `layers` (int32 ``[S + n]``, each
        sequence's then each new token's layer), then the guarded write and the attention
        over pages. What a graph over pages captures (workers.decode_graphs.PAGES)."""
        tables, pages = to_pages(block_tables, slots, layers, self._layout)
        pages, finite = guard_finite(pages, key, value, query, check_finite)
        self._write_pages_on_device(pages, key, value)
        result = self._attend_on_device(None, query, tables, seq_lens, query_start_loc, options)
        out, lse = result if isinstance(result, tuple) else (result, None)
        return out, lse, finite

    def _on_device(self, *tensors: Staged, pinned: bool = False) -> list[torch.Tensor]:
        """``tensors`` on the pool's device (one given in parts joined: workers.parts):
        host tensors of a GPU pool in one staged copy (views valid until the next staged
        request; only kernels of this call read them), or with `pinned` (see
        `_pinned_host`; whole tensors only) each by an asynchronous copy."""
        if pinned:
            return [t.to(self._device, non_blocking=True) for t in tensors]
        if self._stager is not None and all(on_host(t) for t in tensors):
            return self._stager.to_device(tensors)
        return [joined(t).to(self._device) for t in tensors]

    def _kernel(self, fn: Callable[..., _T], *args: object, **kwargs: object) -> _T:
        # Arguments were validated on the host; a kernel-side complaint means a mismatch
        # between the two validators, still reported as a bad request rather than a crash.
        try:
            return fn(*args, backend=self._backend, check_values=False, **kwargs)
        except kernels.KernelArgumentError as exc:
            raise InvalidWorkerRequest(str(exc)) from exc

    def _write_checked(
        self, layer: int | None, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        self._write_on_device(layer, *self._on_device(*write_inputs(slots, key, value)))

    def _write_on_device(
        self, layer: int | None, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """The write with validated arguments already on the pool's device."""
        if slots.shape[0] == 0:
            return
        key, value = key.contiguous(), value.contiguous()
        layers = range(self._layout.num_layers) if layer is None else (layer,)
        for i, lyr in enumerate(layers):
            k, v = (key[i], value[i]) if layer is None else (key, value)
            self._kernel(
                kernels.write_kv,
                k,
                v,
                *self._layer_caches[lyr],
                slots,
            )
        if self._fingerprints is not None:
            dtype = self._data.dtype
            self._fingerprints.record(layer, slots, key.to(dtype), value.to(dtype))

    def _write_pages_on_device(
        self, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """A write addressed by pages (validated, on the pool's device)."""
        if slots.shape[0] == 0:
            return
        key, value = key.contiguous(), value.contiguous()
        self._kernel(
            kernels.write_kv,
            key,
            value,
            *page_caches(self._data, self._num_blocks, self._layout),
            slots,
        )
        if self._fingerprints is not None:
            dtype = self._data.dtype
            self._fingerprints.record_pages(slots, key.to(dtype), value.to(dtype))

    def _attend_on_device(
        self,
        layer: int | None,
        query: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        options: AttendOptions,
        kept: CachedMetadata | None = None,
    ) -> AttendResult:
        """The attention with validated arguments already on the pool's device, over one
        layer (None: over pages of every layer, see workers.pages); through the torch plan
        derived once from `kept` (the metadata's, kept for the step's layers) where the
        attention runs in torch."""
        if layer is None:
            key_cache, value_cache = page_caches(self._data, self._num_blocks, self._layout)
        else:
            key_cache, value_cache = self._layer_caches[layer]
        if kept is not None and layer is not None:
            plan_key = ("attention", options.causal, options.sliding_window)
            if plan_key not in kept.derived:
                kept.derived[plan_key] = kernels.paged_attention_plan(
                    query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                    causal=options.causal, sliding_window=options.sliding_window,
                    backend=self._backend,
                )  # fmt: skip
            plan = kept.derived[plan_key]
            if plan is not None:
                try:
                    out, lse = kernels.attend_planned(
                        plan, query, key_cache, value_cache,
                        scale=options.scale, softcap=options.softcap,
                    )  # fmt: skip
                except kernels.KernelArgumentError as exc:  # see _kernel
                    raise InvalidWorkerRequest(str(exc)) from exc
                return (out, lse) if options.return_lse else out
        args = (
            query.contiguous(),
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            query_start_loc,
        )
        kwargs = dict(
            scale=options.scale,
            causal=options.causal,
            sliding_window=options.sliding_window,
            softcap=options.softcap,
            return_lse=options.return_lse,
        )
        return self._kernel(kernels.paged_attention, *args, **kwargs)


def _same_length(src: list[int], dst: list[int]) -> None:
    if len(src) != len(dst):
        raise InvalidWorkerRequest(f"{len(src)} source ids but {len(dst)} destination ids")


class _PlannedRows(NamedTuple):
    """A kept step's write places on a CPU pool (`KVPool._planned_rows`).

    Attributes:
        rows: long ``[n * Hkv]``: the new tokens' rows in any layer's caches.
        fingerprint_places: long ``[L, 2 * n]``: per layer, the places of the tokens' K
            then V fingerprints in the store (None: the pool keeps none).
    """

    rows: torch.Tensor
    fingerprint_places: torch.Tensor | None


class StepLayers:
    """A step's layers on fixed input buffers (`KVPool.bind_step`)."""

    def __init__(
        self,
        pool: KVPool,
        step: CachedMetadata,
        inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        options: AttendOptions,
        graphs: BoundGraphs | None,
    ) -> None:
        self._pool = pool
        self._step = step
        self._inputs = inputs
        self._options = options
        self._graphs = graphs

    def advance(self, step: CachedMetadata) -> None:
        """Go on to the next decode step of a lease on the same buffers: `step` has the
        current one's shapes, block tables and query offsets (the same tensors), its own
        lengths and slots (`workers.lease_client.LeaseClient.advance`)."""
        self._step = step
        if self._graphs is not None:
            self._graphs.advance(step)

    def run(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One layer: the write of the buffers' new K/V (masked unless every input is
        finite) and the attention of their queries, enqueued on the current stream
        without waiting for the device (a CUDA graph replay where the step's shape was
        seen before).

        Returns:
            (the output ``[rows, Hq, D]`` in the pool's dtype: a replayed graph's own
            tensor, valid until that layer's graph replays again, a step later; the
            finite flag, a 0-d bool on the device: False means nothing was written, or
            None when there was nothing to write).

        Raises:
            InvalidWorkerRequest: a layer outside the layout; nothing was enqueued.
        """
        pool = self._pool
        check_layer(layer, pool.layout.num_layers)
        if self._graphs is not None:
            replayed = self._graphs.run(layer)
            if replayed is not None:
                return replayed[0], replayed[2]
        step = self._step
        out, _, finite = pool._write_and_attend_on_device(
            layer, step.slots, *self._inputs, *step.tables(), self._options, True, step
        )
        return out, finite
