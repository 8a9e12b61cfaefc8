"""One worker's share of an attention call: its kernel entries and the kernel's tensors.

A :class:`WorkerBatch` is one kernel launch: its :class:`KernelEntry` rows (one per
sequence, or per segment of a sequence spread over workers), and the block tables, lengths
and query offsets built from them once per batch (a decode step's recorded plan serves
every layer). :func:`~cache_service.engine.attention_plan.plan_attention` makes them.
"""

from __future__ import annotations

import functools
import itertools
import secrets
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from workers.kernel_warmup import padded_table_width

__all__ = ["AttentionPlanError", "KernelEntry", "WorkerBatch", "mint_key"]


class AttentionPlanError(ValueError):
    """A sequence view, query count or worker mapping is inconsistent; nothing was sent."""


class KernelEntry(NamedTuple):
    """One sequence row of a worker's kernel batch.

    Attributes:
        sequence: index of the sequence in the planned call.
        block_indices: the worker's physical blocks, logical order (the entry's block table):
            a tuple of ints, or a read-only int32 array for a :class:`~cache_service.engine.attention_plan.OneWorkerView`.
        seq_len: keys the entry sees, counted from its first block.
        first_row: row of its first query in the call's query tensor.
        num_rows: its queries: rows ``first_row .. first_row + num_rows - 1`` (the entry's
            last ``num_rows`` positions).
        part: merge slot (the segment's index within its sequence).

    A NamedTuple: a plan makes one per sequence per call, and tuples are built in C.
    """

    sequence: int
    block_indices: tuple[int, ...] | np.ndarray
    seq_len: int
    first_row: int
    num_rows: int
    part: int


def mint_key() -> int:
    """A fresh random key (63 bits) naming a planned batch's kernel metadata."""
    return secrets.randbits(63)


@dataclass(frozen=True)
class WorkerBatch:
    """Everything one worker computes for a call: one kernel launch.

    Attributes:
        worker_id: the worker.
        entries: its kernel entries, in launch order.
        key: names the batch's kernel metadata (`kernel_args` less the query) for the
            worker, which validates and copies it once for every round that runs this
            batch (a planned step's: every layer). Minted with the plan (a recorded step's
            plan carries the step's key); never names other content.
    """

    worker_id: str
    entries: tuple[KernelEntry, ...]
    key: int = field(default_factory=mint_key)

    @functools.cached_property
    def num_rows(self) -> int:
        """Query rows the worker computes (rows may repeat across entries)."""
        return sum(e.num_rows for e in self.entries)

    @functools.cached_property
    def _rows(self) -> tuple[int, ...]:
        return tuple(e.first_row + i for e in self.entries for i in range(e.num_rows))

    @functools.cached_property
    def _rows_in_order(self) -> bool:
        """Whether the rows are 0, 1, ..., num_rows - 1 (the usual case: no gather)."""
        row = 0
        for e in self.entries:
            if e.first_row != row:
                return False
            row += e.num_rows
        return True

    def rows(self) -> list[int]:
        """The call's query row of each of the worker's query rows, in order."""
        return list(self._rows)

    def covers_in_order(self, num_rows: int) -> bool:
        """Whether the worker's rows are exactly the call's rows ``0 .. num_rows - 1``."""
        return self._rows_in_order and self.num_rows == num_rows

    def kernel_args(
        self, query: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The worker's ``(query [R, Hq, D], block_tables int32 [S, max_blocks], seq_lens int32
        [S], query_start_loc int32 [S + 1])`` for the call's ``query [T, Hq, D]``.

        Raises:
            AttentionPlanError: a block id of a :class:`~cache_service.engine.attention_plan.OneWorkerView` is negative.
        """
        if self.covers_in_order(query.shape[0]):
            q = query
        else:
            q = query.index_select(
                0, torch.tensor(self._rows, dtype=torch.long, device=query.device)
            )
        return (q, *self.metadata_args())

    def metadata_args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`kernel_args` less the query: ``(block_tables int32 [S, max_blocks],
        seq_lens int32 [S], query_start_loc int32 [S + 1])``, made once per batch (every
        round of a planned step sends the same tensors; workers only read them)."""
        return self._metadata_tensors

    @functools.cached_property
    def _metadata_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tables, seq_lens, starts = self._metadata
        return torch.from_numpy(tables), torch.from_numpy(seq_lens), torch.from_numpy(starts)

    @functools.cached_property
    def sequences(self) -> np.ndarray:
        """int64 ``[S]``: the call's sequence index of each entry."""
        return np.array([e.sequence for e in self.entries], dtype=np.int64)

    @functools.cached_property
    def _metadata(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """int32 block tables ``[S, max_blocks]``, seq_lens ``[S]``, query_start_loc
        ``[S + 1]`` of the entries: built once per batch (a decode step's recorded plan
        serves every layer; the workers only read them)."""
        entries = self.entries
        n = len(entries)
        tables = _block_table([e.block_indices for e in entries])
        seq_lens = np.fromiter((e.seq_len for e in entries), dtype=np.int32, count=n)
        # Summed in Python: one numpy call where zeros, fromiter and cumsum took three.
        starts = np.array([0, *itertools.accumulate(e.num_rows for e in entries)], np.int32)
        return tables, seq_lens, starts


# Rows up to which `_array_table` copies row by row (each copy one numpy call).
_FEW_ROWS = 4


def _block_table(rows: list[tuple[int, ...] | np.ndarray]) -> np.ndarray:
    """int32 ``[len(rows), w]``, w the longest row padded as the kernels want it
    (`workers.kernel_warmup.padded_table_width`), each row zero-padded: one array for the
    whole batch. Arrays (from :class:`~cache_service.engine.attention_plan.OneWorkerView`) are copied in with numpy; tuples go
    through one flat list (numpy parses nested lists slowly)."""
    lengths = [len(r) for r in rows]
    width = padded_table_width(max(lengths))
    if all(type(r) is np.ndarray for r in rows):
        return _array_table(rows, lengths, width)
    flat: list[int] = []
    for r, length in zip(rows, lengths, strict=True):
        flat += r.tolist() if type(r) is np.ndarray else r
        if length < width:
            flat += (0,) * (width - length)
    table = np.array(flat, dtype=np.int32).reshape(len(rows), width)
    if any(type(r) is np.ndarray for r in rows) and table.size and int(table.min()) < 0:
        raise AttentionPlanError("a block id of a OneWorkerView is negative")
    return table


def _array_table(rows: list[np.ndarray], lengths: list[int], width: int) -> np.ndarray:
    """`_block_table` of int32 arrays. A few rows are copied in one by one; more take a
    fixed handful of numpy calls (a call per row costs more than the rest of a large
    decode batch's table)."""
    n, shortest = len(rows), min(lengths)
    if shortest == width:
        table = np.concatenate(rows).reshape(n, width)
    elif n <= _FEW_ROWS:
        table = np.zeros((n, width), dtype=np.int32)
        for i, r in enumerate(rows):
            table[i, : len(r)] = r
    else:
        flat = np.concatenate(rows)
        table = np.zeros((n, width), dtype=np.int32)
        if shortest == max(lengths):  # a decode batch of equal contexts
            table[:, :shortest] = flat.reshape(n, shortest)
        else:  # row i's ids fill its first lengths[i] columns, in row-major order
            table[np.arange(width) < np.array(lengths)[:, None]] = flat
    # The views' ids were not checked one by one (that would cost a pass per row).
    if table.size and int(table.min()) < 0:
        raise AttentionPlanError("a block id of a OneWorkerView is negative")
    return table
