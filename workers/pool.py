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
from dataclasses import dataclass, replace
from typing import TypeVar

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
    check_query,
    check_write,
)
from workers.config import PoolConfig
from workers.decode_graphs import PAGES, DecodeGraphs
from workers.errors import InvalidWorkerRequest, NonFiniteInput, PoolAllocationError
from workers.fingerprints import BadSlot, SlotFingerprints
from workers.kernel_warmup import decode_warm_up_launches, dummy_decode_inputs
from workers.layout import KVLayout
from workers.metadata_cache import CachedMetadata, MetadataCache
from workers.parts import TensorParts, check_out_parts, fill, joined, on_host, stand_in
from workers.pinned_ranges import REGISTERED
from workers.sizing import free_device_bytes, resolve_num_blocks
from workers.staging import HostStager, Staged

__all__ = ["KVPool", "ReferenceInputs", "resolve_device"]

IndexLike = torch.Tensor | Sequence[int]
_INT32_MAX = 2**31 - 1
AttendResult = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
# An output delivered in parts (write_and_attend_pages' `out`), with the LSE if asked.
PartsResult = TensorParts | tuple[TensorParts, torch.Tensor]
_T = TypeVar("_T")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``device`` as a torch device; None picks the current CUDA device if any, else CPU.

    A bare "cuda" becomes "cuda:<current>", so the pool reports the GPU it really uses.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise PoolAllocationError(f"device {device!r} asked for, but CUDA is not available")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise PoolAllocationError(f"pools live on 'cuda' or 'cpu' devices, got {device!r}")
    return dev


@dataclass(frozen=True)
class ReferenceInputs:
    """An online check's recomputation, staged (`KVPool.reference_inputs`): the layer,
    query ``[T, Hq, D]``, int32 block tables ``[S, max_blocks]``, seq_lens ``[S]`` and
    query_start_loc ``[S + 1]`` on the pool's device (tensors of its own), the options, and
    the slots whose data no longer matches its fingerprint."""

    layer: int
    query: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    options: AttendOptions
    bad: list[BadSlot]


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
    ) -> None:
        # PoolConfig validates the size and the backend; keep one set of rules.
        config = PoolConfig(layout, num_blocks=num_blocks, debug=debug, backend=backend)
        self._layout = layout
        self._device = resolve_device(device)
        self._num_blocks = resolve_num_blocks(config, self._device)
        self._debug = debug
        self._backend = backend
        shape = (self._num_blocks, *layout.block_shape)
        fill = math.nan if debug else 0.0
        try:
            # Zeros rather than empty(): recycled device memory may hold NaNs that a masked
            # but multiplied-by-zero lane would spread.
            self._data = torch.full(shape, fill, dtype=layout.torch_dtype(), device=self._device)
        except torch.OutOfMemoryError as exc:
            raise PoolAllocationError(
                f"allocating {self._num_blocks} blocks ({self._num_blocks * layout.bytes_per_block}"
                f" bytes) on {self._device} failed: {exc}"
            ) from None
        self._fingerprints = (
            SlotFingerprints(layout, self._num_blocks, self._device) if fingerprints else None
        )
        # Requests arrive on the host: a GPU pool takes each request's tensors in one copy.
        self._stager = HostStager(self._device) if self._device.type == "cuda" else None
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

    def key_cache(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s K view ``[num_blocks, Hkv, block_size, D]``."""
        check_layer(layer, self._layout.num_layers)
        return self._data[:, layer, 0]

    def value_cache(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s V view ``[num_blocks, Hkv, block_size, D]``."""
        check_layer(layer, self._layout.num_layers)
        return self._data[:, layer, 1]

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

    def attend(
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
        metadata_key: int | None = None,
        to_host: bool = False,
    ) -> AttendResult:
        """Paged attention of a batch of sequences over one layer (one kernel launch).

        Args:
            layer: layer index.
            query: ``[T, Hq, D]`` in the pool dtype; rows ``query_start_loc[s]:[s+1]`` are the
                last tokens of sequence s (query i of n at position ``seq_len - n + i``).
            block_tables: int ``[S, max_blocks]`` physical block ids of this pool.
            seq_lens: int ``[S]`` KV tokens per sequence.
            query_start_loc: int ``[S + 1]``.
            causal, return_lse, scale, sliding_window, softcap: as in
                ``kernels.paged_attention``.
            metadata_key: names (block_tables, seq_lens, query_start_loc) for later calls
                passing the same content: validated and copied to the device once, then
                reused (`workers.metadata_cache`). The caller must never name other
                content with the same key. None: nothing is kept.
            to_host: return the results on the host (in pinned memory, copied when the call
                is done) rather than on the pool's device.

        Returns:
            out ``[T, Hq, D]`` (pool dtype, pool device); with ``return_lse`` also lse float32
            ``[T, Hq]`` (natural log; -inf for a row that saw no key).

        Raises:
            InvalidWorkerRequest: a malformed argument.
        """
        options = AttendOptions(causal, return_lse, scale, sliding_window, softcap)
        check_layer(layer, self._layout.num_layers)
        batch = (block_tables, seq_lens, query_start_loc)
        entry = self._cached_metadata(metadata_key, query, *batch)
        if entry is not None:
            (q,) = self._on_device(query)
            result = self._attend_on_device(layer, q, *entry.tables(), options)
            return self._deliver(result, to_host)
        indices = check_attend(self._layout, self._num_blocks, layer, query, *batch)
        staged = self._on_device(*_attend_inputs(query, *indices))
        self._remember_metadata(metadata_key, staged[1:], query.shape[0])
        return self._deliver(self._attend_on_device(layer, *staged, options), to_host)

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

    def write_and_attend(
        self,
        layer: int,
        slot_mapping: IndexLike,
        key: torch.Tensor,
        value: torch.Tensor,
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
        metadata_key: int | None = None,
        to_host: bool = False,
        out: torch.Tensor | None = None,
        check_finite: bool = False,
    ) -> AttendResult:
        """:meth:`write` then :meth:`attend` on one layer: a model layer's step.

        Both halves are validated before the write, so a bad attention argument leaves the
        pool unchanged. metadata_key, to_host: as in :meth:`attend`. On CUDA the calls a
        decode step repeats (another layer under a known key, with its slots) replay a
        CUDA graph of the write and the attention (:mod:`workers.decode_graphs`).

        out: with `to_host`, host memory of the output's shape and dtype to copy the output
        into (e.g. a caller's shared-memory slot); the result is then `out`. Ignored when
        it does not fit.
        check_finite: refuse a NaN or infinity in key, value or query (NonFiniteInput,
            nothing written). Checked on the pool's device, where the data goes anyway: the
            write's slots are masked (negative: skipped) unless every value is finite, so
            the check costs no extra wait (on CUDA, part of the decode graph).

        Raises:
            InvalidWorkerRequest: a malformed argument; NonFiniteInput (check_finite).
        """
        if out is not None and not (
            to_host
            and out.device.type == "cpu"
            and out.dtype == self._data.dtype
            and out.shape == query.shape
            and out.is_contiguous()
        ):
            out = None
        options = AttendOptions(causal, return_lse, scale, sliding_window, softcap)
        check_layer(layer, self._layout.num_layers)
        batch = (block_tables, seq_lens, query_start_loc)
        entry = self._cached_metadata(metadata_key, query, *batch)
        if entry is not None and entry.slots is not None and entry.same_slots(slot_mapping):
            # Another layer of the step: slots validated and on the device already.
            check_new_kv(self._layout, layer, entry.slots.shape[0], key, value)
            pinned = self._pinned_host(key, value, query)
            if self._graphs is not None:
                replayed = self._graphs.run(
                    layer, entry, key, value, query, options, pinned, check_finite
                )
                if replayed is not None:
                    # A replay's results live in the graph's memory: copied out here.
                    return self._finish(
                        replayed, options, to_host, owned=False, wait=pinned, out=out
                    )
            k, v, q = self._on_device(key, value, query, pinned=pinned)
            done = self._write_and_attend_on_device(
                layer, entry.slots, k, v, q, *entry.tables(), options, check_finite
            )
            return self._finish(done, options, to_host, wait=pinned, out=out)
        slots = check_write(self._layout, self._num_blocks, layer, slot_mapping, key, value)
        if entry is not None:
            staged = self._on_device(*_write_inputs(slots, key, value), query)
            # The key's other layers will find these slots kept.
            self._keep_metadata(metadata_key, entry, slot_mapping, staged[0])
            done = self._write_and_attend_on_device(
                layer, *staged, *entry.tables(), options, check_finite
            )
            return self._finish(done, options, to_host, out=out)
        indices = check_attend(self._layout, self._num_blocks, layer, query, *batch)
        # Both halves' tensors reach the device in one staged copy.
        staged = self._on_device(
            *_write_inputs(slots, key, value), *_attend_inputs(query, *indices)
        )
        self._remember_metadata(metadata_key, staged[4:], query.shape[0], slot_mapping, staged[0])
        done = self._write_and_attend_on_device(layer, *staged, options, check_finite)
        return self._finish(done, options, to_host, out=out)

    def write_and_attend_pages(
        self,
        slot_mapping: IndexLike,
        key: torch.Tensor | Sequence[torch.Tensor],
        value: torch.Tensor | Sequence[torch.Tensor],
        query: torch.Tensor | Sequence[torch.Tensor],
        block_tables: torch.Tensor | Sequence[Sequence[int]],
        seq_lens: IndexLike,
        query_start_loc: IndexLike,
        *,
        causal: bool = True,
        return_lse: bool = False,
        scale: float | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
        to_host: bool = False,
        check_finite: bool = False,
        out: Sequence[torch.Tensor] | None = None,
    ) -> AttendResult | PartsResult:
        """:meth:`write_and_attend` for sequences of different layers in one call.

        Block ids (in ``block_tables`` and in the blocks of ``slot_mapping``'s slots) are
        *page* ids: page ``block * num_layers + layer`` is ``block`` of ``layer``, so each
        sequence (and each new token) names its layer through its pages and one launch of
        each kernel serves them all. Shapes, options, `to_host`, `check_finite` and errors
        as in :meth:`write_and_attend`, with ``num_blocks * num_layers`` pages.

        Several callers' rows in one call (a coordinator's round): key, value and query may
        each be given in parts (a list of host tensors, joined along dim 0:
        :mod:`workers.parts`), read where they lie; `out`, host memory for the output in
        parts (contiguous, the pool's dtype, ``[rows_i, Hq, D]`` with the rows adding up
        to the query's), receives each part's rows (page-locked memory by DMA, one wait),
        and the result's output is then that list. A refused call (bad arguments,
        NonFiniteInput) leaves `out` untouched.
        """
        options = AttendOptions(causal, return_lse, scale, sliding_window, softcap)
        pages = self._num_blocks * self._layout.num_layers
        whole = (stand_in("key", key), stand_in("value", value), stand_in("query", query))
        slots = check_write(self._layout, pages, 0, slot_mapping, *whole[:2])
        batch = (block_tables, seq_lens, query_start_loc)
        indices = check_attend(self._layout, pages, 0, whole[2], *batch)
        outs = None if out is None else check_out_parts(out, whole[2])
        staged = self._on_device(
            *_write_inputs(slots, key, value), *_attend_inputs(query, *indices)
        )
        slots_on, k, v, q = staged[:4]
        slots_on, finite = self._guarded(slots_on, k, v, q, check_finite)
        self._write_pages_on_device(slots_on, k, v)
        result = self._attend_on_device(None, *staged[3:], options)
        if finite is None and not to_host and outs is None:
            return result
        return self._deliver(result, to_host, finite=finite, out=outs)

    def write_and_attend_layers(
        self,
        seq_layers: Sequence[int],
        slot_layers: Sequence[int],
        slot_mapping: IndexLike,
        key: torch.Tensor | Sequence[torch.Tensor],
        value: torch.Tensor | Sequence[torch.Tensor],
        query: torch.Tensor | Sequence[torch.Tensor],
        block_tables: torch.Tensor | Sequence[Sequence[int]],
        seq_lens: IndexLike,
        query_start_loc: IndexLike,
        *,
        causal: bool = True,
        return_lse: bool = False,
        scale: float | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
        metadata_key: int | None = None,
        to_host: bool = False,
        check_finite: bool = False,
        out: Sequence[torch.Tensor] | None = None,
    ) -> AttendResult | PartsResult:
        """:meth:`write_and_attend_pages` with each sequence's layer and each new token's
        layer given, and block tables and slots per layer (block ids, flat slots) as a
        one-layer call takes them: a coordinator's round whose callers are on different
        layers. The pool turns them into pages on its device.

        Args:
            seq_layers: ``[S]`` the layer of each sequence (row of ``block_tables``).
            slot_layers: ``[n]`` the layer of each new token (entry of ``slot_mapping``).
            metadata_key: as in :meth:`write_and_attend`: the block tables, lengths, query
                offsets and (when equal) slots are validated and kept on the device once
                per key; a round under a known key checks only its layers, and on CUDA
                replays a graph of the whole round (:data:`workers.decode_graphs.PAGES`),
                whichever layers its sequences are on.
            key, value, query, out, to_host, check_finite and the options: as in
                :meth:`write_and_attend_pages` (parts too).

        Raises:
            InvalidWorkerRequest: a malformed argument (a layer outside the layout, layers
                not one per sequence and per new token); NonFiniteInput (check_finite).
        """
        options = AttendOptions(causal, return_lse, scale, sliding_window, softcap)
        lay = self._layout
        if self._num_blocks * lay.num_layers > _INT32_MAX:
            raise InvalidWorkerRequest(
                f"{self._num_blocks} blocks x {lay.num_layers} layers are too many pages for "
                "one launch (int32 page ids); call per layer"
            )
        whole = (stand_in("key", key), stand_in("value", value), stand_in("query", query))
        batch = (block_tables, seq_lens, query_start_loc)
        outs = None if out is None else check_out_parts(out, whole[2])
        entry = self._cached_metadata(metadata_key, whole[2], *batch)
        if entry is not None and entry.slots is not None and entry.same_slots(slot_mapping):
            check_new_kv(lay, 0, entry.slots.shape[0], whole[0], whole[1])
            layers = _layer_vector(
                seq_layers, slot_layers, entry.block_tables.shape[0], entry.slots.shape[0], lay
            )
            if self._graphs is not None:
                replayed = self._graphs.run(
                    PAGES, entry, key, value, query, options, False, check_finite, layers
                )
                if replayed is not None:
                    return self._finish(replayed, options, to_host, owned=False, out=outs)
            k, v, q, layers_on = self._on_device(key, value, query, layers)
            done = self._write_and_attend_layers_on_device(
                entry.slots, k, v, q, *entry.tables(), layers_on, options, check_finite
            )
            return self._finish(done, options, to_host, out=outs)
        slots = check_write(lay, self._num_blocks, 0, slot_mapping, whole[0], whole[1])
        indices = check_attend(lay, self._num_blocks, 0, whole[2], *batch)
        layers = _layer_vector(seq_layers, slot_layers, indices[0].shape[0], slots.shape[0], lay)
        staged = self._on_device(
            *_write_inputs(slots, key, value), *_attend_inputs(query, *indices), layers
        )
        self._remember_metadata(
            metadata_key, staged[4:7], whole[2].shape[0], slot_mapping, staged[0]
        )
        done = self._write_and_attend_layers_on_device(*staged, options, check_finite)
        return self._finish(done, options, to_host, out=outs)

    def attend_pages(
        self,
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
    ) -> AttendResult:
        """:meth:`attend` for sequences of different layers in one launch: block ids are
        page ids as in :meth:`write_and_attend_pages`."""
        options = AttendOptions(causal, return_lse, scale, sliding_window, softcap)
        pages = self._num_blocks * self._layout.num_layers
        indices = check_attend(
            self._layout, pages, 0, query, block_tables, seq_lens, query_start_loc
        )
        return self._attend_on_device(
            None, *self._on_device(*_attend_inputs(query, *indices)), options
        )

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
        """:meth:`attend` recomputed by the torch reference, plus a fingerprint check of every
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
        on_device = self._on_device(*_attend_inputs(query, tables, lens, starts))
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
        result = self._attend_on_device(
            inputs.layer,
            inputs.query,
            inputs.block_tables,
            inputs.seq_lens,
            inputs.query_start_loc,
            inputs.options,
            reference=True,
        )
        return result if isinstance(result, tuple) else (result, None)

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

    def release_blocks(self, block_ids: IndexLike) -> None:
        """The listed blocks are no longer used: in debug mode poison them with NaN (a later
        read without a write shows up as NaN output); otherwise only validate the ids."""
        ids = check_block_ids("block_ids", block_ids, self._num_blocks, distinct=False)
        if self._debug and ids.numel():
            self._data.index_fill_(0, self._to_device(ids, torch.int64), math.nan)

    # -- internals ---------------------------------------------------------------------

    def _to_device(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return t.to(device=self._device, dtype=dtype)

    def _cached_metadata(
        self,
        metadata_key: int | None,
        query: torch.Tensor,
        block_tables: object,
        seq_lens: object,
        query_start_loc: object,
    ) -> CachedMetadata | None:
        """The device copies kept under `metadata_key`, after checking that this call fits
        them (query shape and rows, the shapes of the index tensors passed); None when the
        key is None or unknown (validate and stage as usual).

        Raises:
            InvalidWorkerRequest: a malformed key, or a call that does not fit the
                metadata its key names (a caller reusing a key for other content).
        """
        if metadata_key is None:
            return None
        if type(metadata_key) is not int:
            raise InvalidWorkerRequest(
                f"metadata_key must be an int or None, got {type(metadata_key).__name__}"
            )
        entry = self._metadata.get(metadata_key)
        if entry is None:
            return None
        check_query(self._layout, query)
        # Compared as torch.Size (a tuple: equal to the tuples they hold); tuples for the
        # message only.
        given = (_shape(block_tables), _shape(seq_lens), _shape(query_start_loc))
        if query.shape[0] != entry.num_rows or given != entry.shapes():
            shown = tuple(None if s is None else tuple(s) for s in given)
            raise InvalidWorkerRequest(
                f"metadata_key {metadata_key} names metadata of {entry.num_rows} query rows "
                f"and index shapes {[list(x) for x in entry.shapes()]}; this call has "
                f"{query.shape[0]} rows and {shown}: a key must name one content"
            )
        return entry

    def _remember_metadata(
        self,
        metadata_key: int | None,
        staged: Sequence[torch.Tensor],
        num_rows: int,
        slot_mapping: object = None,
        slots: torch.Tensor | None = None,
    ) -> None:
        """Keep validated index tensors (already on the device: views the next staged copy
        overwrites, hence the copies) under `metadata_key`, with a write's slots as in
        :meth:`_keep_metadata`."""
        if metadata_key is not None:
            tables, lens, starts = (t.clone() for t in staged)
            entry = CachedMetadata(tables, lens, starts, num_rows)
            self._keep_metadata(metadata_key, entry, slot_mapping, slots)

    def _keep_metadata(
        self,
        metadata_key: int | None,
        entry: CachedMetadata,
        slot_mapping: object = None,
        slots: torch.Tensor | None = None,
    ) -> None:
        """Store `entry` under `metadata_key` (None: nothing is kept); with a write's
        `slot_mapping` as passed and its validated device `slots` (a staged view, hence the
        copy), those too, so the key's other layers skip validating and copying them."""
        if metadata_key is None:
            return
        if slots is not None and (source := _slot_source(slot_mapping)) is not None:
            entry = replace(entry, slot_source=source, slots=slots.clone())
        self._metadata.put(metadata_key, entry)

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
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The write (guarded by `check_finite`), then the attention, on validated device
        tensors: what every write_and_attend path runs, and what a decode graph captures.
        Returns (out, lse or None, finite flag or None)."""
        slots, finite = self._guarded(slots, key, value, query, check_finite)
        self._write_on_device(layer, slots, key, value)
        result = self._attend_on_device(
            layer, query, block_tables, seq_lens, query_start_loc, options
        )
        out, lse = result if isinstance(result, tuple) else (result, None)
        return out, lse, finite

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
        """write_and_attend_layers on validated device tensors: the page tables and page
        slots computed here from the per-layer ones and `layers` (int32 ``[S + n]``, each
        sequence's then each new token's layer), then the guarded write and the attention
        over pages. What a graph over pages captures (workers.decode_graphs.PAGES)."""
        n_layers, bs = self._layout.num_layers, self._layout.block_size
        num_seqs = block_tables.shape[0]
        seq_layers, slot_layers = layers[:num_seqs], layers[num_seqs:]
        # Padded table entries (past a sequence's length, never read) stay valid pages.
        tables = block_tables * n_layers + seq_layers[:, None]
        pages = torch.where(
            slots >= 0, ((slots // bs) * n_layers + slot_layers) * bs + slots % bs, slots
        )
        pages, finite = self._guarded(pages, key, value, query, check_finite)
        self._write_pages_on_device(pages, key, value)
        result = self._attend_on_device(None, query, tables, seq_lens, query_start_loc, options)
        out, lse = result if isinstance(result, tuple) else (result, None)
        return out, lse, finite

    @staticmethod
    def _guarded(
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
        finite = torch.isfinite(key).all() & torch.isfinite(value).all()
        finite &= torch.isfinite(query).all()
        return torch.where(finite, slots, -1), finite

    def _finish(
        self,
        done: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None],
        options: AttendOptions,
        to_host: bool,
        *,
        owned: bool = True,
        wait: bool = False,
        out: torch.Tensor | TensorParts | None = None,
    ) -> AttendResult | PartsResult:
        """`_deliver` of `_write_and_attend_on_device`'s (or its over-layers form's) (out,
        lse, finite flag)."""
        got, lse, finite = done
        result = (got, lse) if options.return_lse else got
        return self._deliver(result, to_host, owned=owned, wait=wait, out=out, finite=finite)

    def _deliver(
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
        pinned memory (`_pinned_host`), so the call does not return before the device is
        done with them. `finite`: the call's flag from `_guarded`; False raises
        NonFiniteInput, read before anything reaches `out` (a refused call leaves the
        caller's memory as it was)."""
        if type(out) is list:
            return self._deliver_parts(result, out, finite)
        tensors = result if isinstance(result, tuple) else (result,)
        if finite is not None and out is not None:
            # Waits for the flag before `out` is touched; the copy into `out` then waits
            # again. Kept as two: the flag is known only once the call's kernels ran, and
            # the copy may start only after it is. One wait would mean copying the output
            # elsewhere (pinned staging) and then into `out` on the CPU: a host copy of
            # the whole output for one wait, no clear gain.
            _refuse_non_finite(finite)
            finite = None
        if out is not None:
            # The output straight into the caller's memory (write_and_attend checked it).
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
            _refuse_non_finite(finite)
        return tensors if isinstance(result, tuple) else tensors[0]  # type: ignore[return-value]

    def _deliver_parts(
        self, result: AttendResult, out: TensorParts, finite: torch.Tensor | None
    ) -> PartsResult:
        """`_deliver` of an output in parts: the flag read first (a refused call leaves
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
            _refuse_non_finite(stager.to_host_parts(got, out, finite))
            return out
        if finite is not None:
            _refuse_non_finite(finite)
        fill(out, got)
        if lse is not None:
            lse = lse.to("cpu", non_blocking=self._device.type == "cuda")
        if self._device.type == "cuda":
            torch.cuda.current_stream(self._device).synchronize()
        return out if lse is None else (out, lse)

    def _pinned_host(self, *tensors: torch.Tensor) -> bool:
        """Whether a GPU pool's inputs all lie in the caller's page-locked host memory (a
        shared region the server registered with CUDA): then they go to the device by DMA
        straight from there, with no staging copy on the CPU, and the call must not
        return before those copies are done (`_deliver`'s wait)."""
        return self._stager is not None and all(_is_pinned_host(t) for t in tensors)

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
        self._write_on_device(layer, *self._on_device(*_write_inputs(slots, key, value)))

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
                self._data[:, lyr, 0],
                self._data[:, lyr, 1],
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
        self._kernel(kernels.write_kv, key, value, *self._page_caches(), slots)
        if self._fingerprints is not None:
            dtype = self._data.dtype
            self._fingerprints.record_pages(slots, key.to(dtype), value.to(dtype))

    def _page_caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every layer as pages ``[num_blocks * L, Hkv, block_size, D]`` (views:
        page ``b * L + l`` is block b of layer l; dim 0 strides over the K/V pair)."""
        lay = self._layout
        pages = self._data.view(
            self._num_blocks * lay.num_layers, 2, lay.num_kv_heads, lay.block_size, lay.head_dim
        )
        return pages[:, 0], pages[:, 1]

    def _attend_on_device(
        self,
        layer: int | None,
        query: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        options: AttendOptions,
        *,
        reference: bool = False,
    ) -> AttendResult:
        """The attention with validated arguments already on the pool's device, over one
        layer (None: over pages of every layer, see write_and_attend_pages)."""
        if layer is None:
            key_cache, value_cache = self._page_caches()
        else:
            key_cache, value_cache = self._data[:, layer, 0], self._data[:, layer, 1]
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
        if reference:
            # The torch reference whatever the pool's backend, its errors as they are.
            return kernels.paged_attention(*args, **kwargs, backend="torch", check_values=False)
        return self._kernel(kernels.paged_attention, *args, **kwargs)


def _layer_vector(
    seq_layers: object, slot_layers: object, num_seqs: int, num_slots: int, layout: KVLayout
) -> torch.Tensor:
    """Host int32 ``[num_seqs + num_slots]``: each sequence's layer then each new token's,
    validated (one per sequence and per token, each within the layout).

    Raises:
        InvalidWorkerRequest: anything else.
    """
    for name, given, count in (
        ("seq_layers", seq_layers, num_seqs),
        ("slot_layers", slot_layers, num_slots),
    ):
        if type(given) is not list or len(given) != count:
            shown = len(given) if isinstance(given, list) else type(given).__name__
            raise InvalidWorkerRequest(
                f"{name} must be a list of {count} layers (one per "
                f"{'sequence' if name == 'seq_layers' else 'new token'}), got {shown}"
            )
        if given and (
            not all(type(x) is int for x in given)
            or min(given) < 0
            or max(given) >= layout.num_layers
        ):
            raise InvalidWorkerRequest(
                f"{name} must hold layer indices in [0, {layout.num_layers}), got {given}"
            )
    return torch.tensor(seq_layers + slot_layers, dtype=torch.int32)  # type: ignore[operator]


def _shape(t: object) -> torch.Size | None:
    """A tensor's shape; None for anything else (a list of ints, say)."""
    return t.shape if isinstance(t, torch.Tensor) else None


def _is_pinned_host(t: torch.Tensor) -> bool:
    """``t.device.type == "cpu" and t.is_pinned()``, answered from the registrations the
    process made itself (`workers.pinned_ranges.REGISTERED`: the shared regions) when
    `t`'s bytes lie in one, without the driver call ``is_pinned()`` makes (about 5 us);
    other tensors are asked as before. A registered range is exact (its owner removes it
    before unregistering), and a wrong answer would only cost speed (see that module)."""
    if not t.is_cpu:
        return False
    nbytes = t.nbytes
    # Contiguous: its bytes are [data_ptr, data_ptr + nbytes). (Empty: asked as before.)
    if nbytes and t.is_contiguous() and REGISTERED.covers(t.data_ptr(), nbytes):
        return True
    return t.is_pinned()


def _refuse_non_finite(finite: torch.Tensor | bool) -> None:
    """NonFiniteInput unless the call's flag (`KVPool._guarded`, or its value read on the
    host) says every value was finite (reading a device flag waits for the device; the
    write was masked otherwise)."""
    if not bool(finite):
        raise NonFiniteInput(
            "the key, value or query holds NaN or infinite values; nothing was written"
        )


def _slot_source(slot_mapping: object) -> list[int] | torch.Tensor | None:
    """A copy of a write's slot mapping as its caller passed it (a list or a tensor), to
    recognise the same slots in a later call (CachedMetadata.same_slots); None otherwise."""
    if type(slot_mapping) is list:
        return list(slot_mapping)
    if isinstance(slot_mapping, torch.Tensor):
        return slot_mapping.clone()
    return None


def _write_inputs(
    slots: torch.Tensor, key: Staged, value: Staged
) -> tuple[torch.Tensor, Staged, Staged]:
    """A write's tensors in the dtypes the kernels take (slots int64)."""
    return slots.to(torch.int64), key, value


def _attend_inputs(
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
