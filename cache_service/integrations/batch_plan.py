"""Which columns of a left-padded batch each service sequence receives, step by step.

A Hugging Face batch is a rectangle: row ``b`` holds ``pad[b]`` padding columns, then its
prompt, then the generated tokens. The service instead holds one sequence per row, starting
with the ``cached[b]`` prompt tokens its prefix index already had. The model sees columns
``[consumed, consumed + q)`` in each forward; this module decides, per row, which of those
columns are new to the service (the last ``count`` of the step) and which are padding or
already cached (skipped: nothing written, their attention output unused).

Pure logic: no torch, no transformers, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["BatchPlan", "RowSlice", "StepPlan"]


class RowSlice(NamedTuple):
    """The part of one row that a step sends to the service (a tuple: a decode step
    makes one per row, and a frozen dataclass costs several times as much to build).

    Attributes:
        row: batch row index.
        first_column: column (in the padded batch) of the first token sent.
        count: tokens sent; they are the step's last ``count`` columns. 0 = nothing sent.
        start_position: the service position of the first token sent (tokens already
            written to the sequence before this step).
    """

    row: int
    first_column: int
    count: int
    start_position: int


@dataclass(frozen=True)
class StepPlan:
    """One forward pass: columns ``[start_column, start_column + num_columns)`` of the batch."""

    index: int
    start_column: int
    num_columns: int
    rows: tuple[RowSlice, ...]

    @property
    def tokens_sent(self) -> int:
        """Tokens written to the service by this step (per layer), padding excluded."""
        return sum(r.count for r in self.rows)


class BatchPlan:
    """Tracks, for a left-padded batch, what every row's service sequence already holds.

    Args:
        pads: padding columns at the left of each row (``>= 0``).
        cached: prompt tokens of each row the service already holds (prefix hit), counted
            from the row's first real token.
        prompt_columns: width of the padded prompt (``pads[b] + prompt length of row b``
            for every row; every row ends at the last column).
    """

    def __init__(self, pads: Sequence[int], cached: Sequence[int], prompt_columns: int) -> None:
        if len(pads) == 0:
            raise ValueError("a batch needs at least one row")
        if len(pads) != len(cached):
            raise ValueError(f"pads has {len(pads)} rows but cached has {len(cached)}")
        for b, (p, c) in enumerate(zip(pads, cached, strict=True)):
            if p < 0 or c < 0:
                raise ValueError(f"row {b}: pad {p} and cached {c} must be >= 0")
            if p + c >= prompt_columns:
                # The last prompt token is always computed: its logits pick the first new token.
                raise ValueError(
                    f"row {b}: pad {p} + cached {c} leaves no prompt token to compute "
                    f"in {prompt_columns} columns"
                )
        self._pads = tuple(int(p) for p in pads)
        self._written = [int(c) for c in cached]
        self._cached = tuple(int(c) for c in cached)
        self._prompt_columns = int(prompt_columns)
        # Columns before this one hold nothing the service still needs for any row, so the
        # model can skip them: the cache length transformers sees before the prefill.
        self._consumed = min(p + c for p, c in zip(self._pads, self._cached, strict=True))
        self._steps = 0

    @property
    def batch_size(self) -> int:
        """Number of rows."""
        return len(self._pads)

    @property
    def pads(self) -> tuple[int, ...]:
        """Padding columns of each row."""
        return self._pads

    @property
    def cached(self) -> tuple[int, ...]:
        """Prompt tokens of each row found in the service's prefix cache."""
        return self._cached

    @property
    def written(self) -> tuple[int, ...]:
        """Tokens each row's sequence holds (on every layer) after the committed steps."""
        return tuple(self._written)

    @property
    def consumed(self) -> int:
        """Columns the model has already processed (or may skip): its cache length."""
        return self._consumed

    @property
    def prompt_columns(self) -> int:
        """Width of the padded prompt."""
        return self._prompt_columns

    def plan(self, num_columns: int) -> StepPlan:
        """Plan the next forward over ``num_columns`` columns starting at :attr:`consumed`.

        Raises:
            ValueError: ``num_columns < 1``, or the step would leave a gap in some row
                (its next unwritten token lies before the step's first column).
        """
        if num_columns < 1:
            raise ValueError(f"a step needs at least one column, got {num_columns}")
        start, end = self._consumed, self._consumed + num_columns
        rows = []
        for b, pad in enumerate(self._pads):
            next_column = pad + self._written[b]
            if next_column < start:
                raise ValueError(
                    f"row {b}: its next token is column {next_column} but the step starts at "
                    f"column {start}; tokens would be skipped"
                )
            first = min(next_column, end)
            # Positional: keywords cost a NamedTuple a third more, once per row per forward.
            rows.append(RowSlice(b, first, end - first, self._written[b]))
        return StepPlan(
            index=self._steps, start_column=start, num_columns=num_columns, rows=tuple(rows)
        )

    def commit(self, step: StepPlan) -> None:
        """Record that ``step`` was written on every layer.

        Raises:
            ValueError: ``step`` is not the plan of the current step.
        """
        if step.index != self._steps or step.start_column != self._consumed:
            raise ValueError(
                f"step {step.index} at column {step.start_column} is not the current step "
                f"{self._steps} at column {self._consumed}"
            )
        for r in step.rows:
            self._written[r.row] += r.count
        self._consumed += step.num_columns
        self._steps += 1

    def expected_mask(self, start: int, stop: int) -> list[list[int]]:
        """The 0/1 attention mask columns ``[start, stop)`` must have: 0 on padding only.

        Returns: ``batch_size`` lists of ``stop - start`` ints.
        """
        return [[0 if col < pad else 1 for col in range(start, stop)] for pad in self._pads]
