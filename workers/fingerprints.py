"""Per-slot fingerprints of a pool's K/V, taken when the data is written, checked later.

The online correctness check recomputes sampled attention calls with the torch reference
from the same blocks. That catches a kernel computing a wrong answer, but not a block whose
contents changed after they were written (a stray write, a block reused while still
referenced, memory corruption): kernel and reference read the same wrong data and agree.
So every written slot also gets a fingerprint, computed from the data *as it was sent*; the
check recomputes it from the pool and compares.

A fingerprint is a weighted sum (float64) of one slot's row ``[Hkv, D]`` for one layer and
one of K/V, with fixed pseudo-random weights, so swapped or sign-flipped values show up
too, not only changed sums. The store is ``[num_slots, L, 2]`` float64 (plus one spare
block): 8 bytes per slot, layer and K/V, next to ``Hkv * D`` elements of data (0.4% for 8
heads of 128 in bf16).

Torch only; every tensor lives on the pool's device.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

import kernels
from kernels.reference import fingerprint_rows
from workers.layout import KVLayout
from workers.pool_memory import allocate

__all__ = ["BadSlot", "SlotFingerprints"]

# Relative tolerance of a fingerprint: the same float values summed in float64 in another
# order differ by ~1e-16 relative; any real change of a value is far above this.
_RTOL = 1e-9


class BadSlot(NamedTuple):
    """A slot whose data no longer matches its fingerprint.

    Attributes:
        entry: the kernel-batch entry (row of the block table) that reads it.
        block: physical block id in the pool.
        offset: slot within the block (token position ``% block_size``).
        kind: 0 = key, 1 = value.
    """

    entry: int
    block: int
    offset: int
    kind: int


class SlotFingerprints:
    """Fingerprints of every slot of one pool (see the module docstring).

    Args:
        layout: the pool's layout.
        num_blocks: blocks in the pool.
        device: the pool's device.
        sums: the store of another process's pool, mapped into this one
            (`workers.pool_memory`); None: allocated here, mappable.
    """

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        device: torch.device,
        sums: torch.Tensor | None = None,
    ) -> None:
        self._layout = layout
        self._bs = layout.block_size
        gen = torch.Generator().manual_seed(0x5EED)
        weights = torch.rand((layout.num_kv_heads, layout.head_dim), generator=gen) + 0.5
        self._weights = weights.to(device=device, dtype=torch.float64)
        self._flat_weights = self._weights.reshape(-1)
        # One spare block past the pool's: skipped (negative) slots of a write land there
        # and are never read, so a write needs no host round trip to filter them out.
        self._spare = num_blocks * layout.block_size
        shape = ((num_blocks + 1) * layout.block_size, layout.num_layers, 2)
        if sums is not None and (tuple(sums.shape) != shape or sums.dtype != torch.float64):
            raise ValueError(f"fingerprint sums must be {shape} float64, got {tuple(sums.shape)}")
        self._sums = sums if sums is not None else allocate(shape, torch.float64, device)

    @property
    def sums(self) -> torch.Tensor:
        """The store ``[(num_blocks + 1) * block_size, L, 2]`` float64 (shared, not a copy)."""
        return self._sums

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., Hkv, D]`` -> ``[...]`` float64 fingerprints."""
        return fingerprint_rows(x, self._weights)

    def record(
        self, layer: int | None, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """Fingerprint a write.

        Args:
            layer: the layer, or None for every layer.
            slots: int64 ``[n]`` flat slots on the pool's device (negative: skipped).
            key, value: ``[n, Hkv, D]`` (``[L, n, Hkv, D]`` for layer None), as written.
        """
        if slots.numel() == 0:
            return
        if layer is None:  # a whole-sequence write: rare, torch is fine
            slots = torch.where(slots >= 0, slots, self._spare)
            both = torch.stack([self._rows(key), self._rows(value)], dim=-1)  # [L, n, 2]
            self._sums[slots] = both.transpose(0, 1)  # [n, L, 2]
            return
        self._record(layer, slots, key, value)

    def planned_places(self, slots: torch.Tensor) -> torch.Tensor:
        """long ``[L, 2 * n]``: per layer, the places in the flattened store of the K then
        the V fingerprints of slots ``slots`` (int ``[n]``, none negative): what
        :meth:`record_at` takes, for a planned step's layers."""
        per_slot = self._sums.shape[1] * 2
        base = slots.long() * per_slot
        both = torch.cat([base, base + 1])
        layers = torch.arange(0, per_slot, 2, device=both.device)
        return both[None, :] + layers[:, None]

    def record_at(self, places: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Fingerprint a write of key and value ``[n, Hkv, D]`` (as written) at `places`
        (a row of :meth:`planned_places`): one product for the K and V rows together, in
        a few operations where a CPU pool's time is their count."""
        n = key.shape[0]
        rows = torch.cat([key.reshape(n, -1), value.reshape(n, -1)]).to(torch.float64)
        self._sums.view(-1).index_copy_(0, places, rows @ self._flat_weights)

    def record_pages(self, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Fingerprint a write addressed by pages (page ``block * L + layer``, slot ``page *
        block_size + offset``; see workers.pages): key, value ``[n, Hkv,
        D]``, each token on its own layer."""
        if slots.numel() != 0:
            self._record(None, slots, key, value)

    def _record(
        self, layer: int | None, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        # One Triton launch on CUDA instead of ~8 torch ops (kernels.slot_fingerprints); the
        # pool validated the slots.
        kernels.record_fingerprints(
            key, value, self._weights, self._sums, slots, layer, self._bs, check_values=False
        )

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Block ``src[i]``'s fingerprints become ``dst[i]``'s (int64 ids, device)."""
        per_block = self._sums.view(-1, self._bs, *self._sums.shape[1:])
        per_block[dst] = per_block[src].clone()

    def record_blocks(self, block_ids: torch.Tensor, data: torch.Tensor) -> None:
        """Fingerprint whole imported blocks ``data [n, L, 2, Hkv, bs, D]`` (device)."""
        rows = self._rows(data.transpose(-3, -2))  # [n, L, 2, bs]
        per_block = self._sums.view(-1, self._bs, *self._sums.shape[1:])
        per_block[block_ids] = rows.permute(0, 3, 1, 2)

    def check(
        self,
        pool_data: torch.Tensor,
        layer: int,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        max_reported: int = 16,
    ) -> list[BadSlot]:
        """The slots read by a kernel batch whose data differs from its fingerprint.

        Args:
            pool_data: the pool tensor ``[num_blocks, L, 2, Hkv, bs, D]``.
            layer: the layer the batch reads.
            block_tables: int ``[S, max_blocks]``; seq_lens: int ``[S]`` (validated).
            max_reported: at most this many slots are returned (the first ones).

        Returns:
            Bad slots in (entry, position) order; empty when every slot matches.
        """
        bs = self._bs
        device = pool_data.device
        lens = seq_lens.to(device=device, dtype=torch.long)
        total = int(lens.sum())
        if total == 0:
            return []
        # Every (entry, position) read, built on the device: no per-sequence host work.
        entry = torch.repeat_interleave(
            torch.arange(lens.shape[0], device=device), lens, output_size=total
        )
        first = torch.cumsum(lens, 0) - lens
        pos = torch.arange(total, device=device) - first[entry]
        tables = block_tables.to(device=device, dtype=torch.long)
        blocks = tables[entry, pos // bs]
        offsets = pos % bs
        # Advanced indices around slices: the result is [n, 2, Hkv, D].
        now = self._rows(pool_data[blocks, layer, :, :, offsets, :])
        then = self._sums[blocks * bs + offsets, layer]
        bad = ~((now - then).abs() <= _RTOL * (then.abs() + 1.0))
        if not bool(bad.any()):
            return []
        where = bad.nonzero().tolist()[:max_reported]
        blocks_cpu, offsets_cpu, entry_cpu = blocks.tolist(), offsets.tolist(), entry.tolist()
        return [BadSlot(entry_cpu[i], blocks_cpu[i], offsets_cpu[i], kind) for i, kind in where]
