"""A block table's physical block ids as packed int32, kept across calls.

A decode step makes one append-and-attend call per layer for the same sequences, and every
call hands the kernel each sequence's block ids as int32 rows. Rebuilding them from the
table (a list of ``PhysicalBlock``) costs Python work proportional to the context, per
sequence, per layer. A :class:`BlockRow` mirrors the table instead: it is extended when the
table grows (one new block every ``block_size`` tokens) and thrown away whenever the table
changes in any other way.

The ids live in a fixed-size ``array('i')`` (stdlib: the control plane imports no numpy);
readers get read-only ``memoryview`` slices of it, which ``numpy.frombuffer`` turns into an
int32 array without a copy.

Why a stale row can never be served:

* The buffer is append-only and never resized: entries ``[0, n)`` are never written again,
  and a full buffer is replaced by a bigger copy. Slices handed out (:meth:`BlockRow.ids`)
  are read-only views of ``[0, k)``, ``k <= n``, so they stay exact snapshots of the table
  at the time, whatever happens to the table later.
* Every change other than appending - copy-on-write of the shared last block, the
  truncation of `cancel_write` or of a rolled-back batch - goes through
  ``Sequence.replace_last_block`` / ``Sequence.truncate_table``, which drop the row; the
  next use rebuilds it from the table.
* As a second line of defence, :meth:`BlockRow.matches` refuses a row whose table object
  was replaced, that is longer than the table, or whose last mirrored entry is no longer
  the table's entry at that position (a missed copy-on-write), and the row is rebuilt.
* A fork gets a table of its own (``Sequence.copy_as``) and no row: two sequences never
  append to one buffer. Freed and lost sequences take their rows with them; eviction only
  takes blocks no table references.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from operator import itemgetter

from cache_service.control.types import PhysicalBlock

__all__ = ["INT32", "BlockRow"]

_WORKER = itemgetter(0)  # PhysicalBlock.worker_id
_INDEX = itemgetter(1)  # PhysicalBlock.index

# The array typecode of a 32-bit signed int (the kernels' block-table dtype).
INT32 = next(code for code in "ilq" if array(code).itemsize == 4)


class BlockRow:
    """The int32 block indices of one block table, in logical order, and the worker they
    all live on (None when the table is empty or spans several workers).

    Build it with ``BlockRow(table)``; bring it up to date with :meth:`extend` after the
    table grew, and only when :meth:`matches` holds.
    """

    __slots__ = ("_buf", "_read_only", "last", "mixed", "n", "table", "worker")

    def __init__(self, table: list[PhysicalBlock]) -> None:
        self.table = table  # the list mirrored (identity is checked by matches)
        self.n = 0  # entries mirrored
        self.last: PhysicalBlock | None = None  # the table's entry n - 1 when mirrored
        self.worker: str | None = None
        self.mixed = False  # blocks on more than one worker
        self._buf = array(INT32, bytes(4 * max(16, 2 * len(table))))
        self._read_only = memoryview(self._buf).toreadonly()
        self.extend(table)

    def matches(self, table: list[PhysicalBlock]) -> bool:
        """Whether this row still mirrors a prefix of `table` (see the module docstring)."""
        n = self.n
        return self.table is table and n <= len(table) and (n == 0 or table[n - 1] is self.last)

    def extend(self, table: Sequence[PhysicalBlock]) -> None:
        """Mirror the entries of `table` past the first `n` (which must be unchanged)."""
        start = self.n
        new = table[start:]
        k = len(new)
        if not k:
            return
        end = start + k
        if end > len(self._buf):
            # A bigger copy: views of the old buffer stay valid (it is never written again).
            buf = array(INT32, bytes(4 * 2 * end))
            buf[:start] = self._buf[:start]
            self._buf = buf
            self._read_only = memoryview(buf).toreadonly()
        # Same-length slice assignment: the buffer is never resized while views exist.
        self._buf[start:end] = array(INT32, map(_INDEX, new))
        if not self.mixed:
            workers = set(map(_WORKER, new))
            if self.worker is None:
                self.worker = _WORKER(new[0])
            workers.discard(self.worker)
            self.mixed = bool(workers)
        self.n = end
        self.last = new[-1]

    def ids(self, num_blocks: int) -> memoryview:
        """A read-only view (format ``INT32``) of the first `num_blocks` (<= n) indices."""
        if not 0 <= num_blocks <= self.n:
            raise ValueError(f"num_blocks must be in [0, {self.n}], got {num_blocks}")
        return self._read_only[:num_blocks]
