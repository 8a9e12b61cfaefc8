"""A decode step's other layers (see `steps`): what the step's first layer planned
is recorded, and each later layer of the same batch of sequences and tokens repeats it.

The full path (`Coordinator.append_attend`) records a qualifying call's plan
(`remember_step`) and reuses it for a call that repeats it (`reusable_step`,
`step_part`). The stacked short path (`Coordinator.append_attend_stacked`, `repeat_now`)
goes further: a batch already stacked is checked with a few comparisons
(`stacked_step`), locked in the step's order, and runs as the step's one part, with a
short commit (`BlockManager.commit_repeated`). Whatever the short path does not accept
goes the full way, which raises the precise error.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from cache_service.control.types import WritePlan
from cache_service.engine.attention_plan import OneWorkerView
from cache_service.engine.batching import Part
from cache_service.engine.call_deadline import check_deadline, current_deadline
from cache_service.engine.call_tensors import Spans, in_dtype, joined_rows, repeat_answer
from cache_service.engine.input_checks import FLOAT_DTYPES
from cache_service.engine.rounds import Rounds, answered_by_future
from cache_service.engine.sequence_locks import SequenceLocks
from cache_service.engine.steps import Step, StepCache
from cache_service.engine.values import AppendAttendItem, StackedAppendAttend
from cache_service.engine.worker_interface import AttentionResult
from workers.errors import NonFiniteInput

if TYPE_CHECKING:
    from cache_service.engine.coordinator import Coordinator

__all__ = ["StepRepeats"]


class StepRepeats:
    """Recorded layer steps and the short path that repeats them, for one coordinator.

    Args:
        owner: the coordinator (its `block_manager`, `layout` and `metrics` are read at
            each use: recovery replaces the block manager).
        locks: the coordinator's sequence locks.
        steps: the recorded steps, per client batch.
        epochs: worker id -> epoch of every registered worker (a step on a lost worker
            no longer applies).
        rounds: the round runner the repeated parts go to.
        cancel_writes: releases what a failed call reserved (tenant, sequence ids).
    """

    def __init__(
        self,
        owner: Coordinator,
        locks: SequenceLocks,
        steps: StepCache,
        epochs: Mapping[str, str],
        rounds: Rounds,
        cancel_writes: Callable[[str, Sequence[str]], None],
    ) -> None:
        self._owner = owner
        self._layout = owner.layout
        self._pool_dtype = owner.layout.torch_dtype()
        self._locks = locks
        self._steps = steps
        self._epochs = epochs
        self._rounds = rounds
        self._cancel_writes = cancel_writes

    def stacked_step(self, tenant: str, layer: int, batch: StackedAppendAttend) -> Step | None:
        """The recorded step `batch` can repeat on `layer`, judged by what needs no lock:
        the same batch of sequences, its token and query row counts, tensors of the layout's
        shapes and float dtypes. None: take the full path. Whether every value is finite
        is left to the round (`Rounds.run_parts`): the worker's device checks it where the data
        goes anyway, or the coordinator when the round is shared."""
        step = self._recorded_step(tenant, batch.seq_ids)
        if step is None or type(layer) is not int or not 0 <= layer < self._layout.num_layers:
            return None
        key, value, query = batch.key, batch.value, batch.query
        b, n, m = len(batch.seq_ids), step.snapshot.num_tokens, step.num_queries[0]
        hkv, d = self._layout.num_kv_heads, self._layout.head_dim
        if not (
            type(key) is type(value) is type(query) is torch.Tensor
            and key.dtype in FLOAT_DTYPES
            and value.dtype in FLOAT_DTYPES
            and query.dtype in FLOAT_DTYPES
            and key.shape == (b, n, hkv, d)
            and value.shape == (b, n, hkv, d)
            and query.ndim == 4
            and query.shape[:2] == (b, m)
            and query.shape[3] == d
            and query.shape[2] >= 1
            and query.shape[2] % hkv == 0
            and len(batch.token_ids) == b * n
            and key.is_contiguous()
            and value.is_contiguous()
            and query.is_contiguous()
        ):
            return None
        return step

    async def repeat_step(
        self,
        tenant: str,
        layer: int,
        step: Step,
        batch: StackedAppendAttend,
        return_lse: bool,
        out: torch.Tensor | None = None,
        rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> AttentionResult | None:
        """Run `batch` on `layer` through `step` (checked by `stacked_step`); None, having
        changed nothing, when under the locks the step no longer applies. out, rows: as in
        `Coordinator.append_attend_stacked`."""
        async with self._locks.holding(step.lock_order):  # sorted ids, as the full path locks
            part = self._repeat_part(tenant, layer, step, batch, return_lse, out, rows)
            if part is None:
                return None
            try:
                rows_of = [(list(range(len(batch.seq_ids))), part)]
                (output,) = await self._rounds.execute(layer, rows_of, batch.query.shape[2])
                answer = repeat_answer(batch, output, return_lse)
                check_deadline()
                self._repeat_committed(layer, step, part)
            except NonFiniteInput:
                # Refused before anything was written; the full path's check names the
                # sequence and tensor.
                self._cancel_writes(tenant, batch.seq_ids)
                return None
            except BaseException:
                self._cancel_writes(tenant, batch.seq_ids)
                raise
        self._count_repeat(batch, step)
        return answer

    def repeat_now(
        self,
        tenant: str,
        layer: int,
        batch: StackedAppendAttend,
        return_lse: bool,
        out: torch.Tensor | None,
        rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
        origin: int | None,
        finished: Callable[[AttentionResult | BaseException | None], None],
    ) -> bool:
        """See `Coordinator.repeat_now`."""
        step = self.stacked_step(tenant, layer, batch)
        if step is None or not self._locks.try_acquire(step.lock_order):
            return False
        try:
            part = self._repeat_part(tenant, layer, step, batch, return_lse, out, rows)
            if part is not None:
                answered_by_future(part, layer, origin)
                self._rounds.batcher(layer, step.worker_id, batch.query.shape[2]).submit(part)
        except BaseException:
            self._locks.release(step.lock_order)
            raise
        if part is None:
            self._locks.release(step.lock_order)
            return False
        part.future.add_done_callback(
            functools.partial(
                self._repeated_now, tenant, layer, step, batch, part, finished, current_deadline()
            )
        )
        return True

    def _repeated_now(
        self,
        tenant: str,
        layer: int,
        step: Step,
        batch: StackedAppendAttend,
        part: Part,
        finished: Callable[[AttentionResult | BaseException | None], None],
        deadline: float,
        future: asyncio.Future[AttentionResult],
    ) -> None:
        """`repeat_now`'s round is back: commit (or cancel: an error, or past the call's
        commit `deadline`), release, report."""
        try:
            answer = repeat_answer(batch, future.result(), part.return_lse)
            check_deadline(deadline)
            self._repeat_committed(layer, step, part)
        except BaseException as exc:
            self._cancel_writes(tenant, batch.seq_ids)
            self._locks.release(step.lock_order)
            finished(None if isinstance(exc, NonFiniteInput) else exc)
            return
        self._locks.release(step.lock_order)
        self._count_repeat(batch, step)
        finished(answer)

    def _repeat_part(
        self,
        tenant: str,
        layer: int,
        step: Step,
        batch: StackedAppendAttend,
        return_lse: bool,
        out: torch.Tensor | None,
        rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    ) -> Part | None:
        """Under the step's sequence locks: the call's part when the step still applies
        (another call may have replaced it or moved a sequence meanwhile, or its worker
        may have gone), else None, nothing changed."""
        if self._recorded_step(tenant, batch.seq_ids) is not step or not (
            self._owner.block_manager.repeatable(step.snapshot, layer, batch.token_ids)
        ):
            return None
        if rows is None:
            # `stacked_step` checked the shapes: [b, m, Hq, D] and [b, n, Hkv, D].
            rows = (batch.query.flatten(0, 1), batch.key.flatten(0, 1), batch.value.flatten(0, 1))
        part = self.step_part(step, *rows, return_lse, out)
        part.finite_checked = False
        return part

    def _repeat_committed(self, layer: int, step: Step, part: Part) -> None:
        """A repeated layer's round is back: its short commit (`repeatable` said yes under
        the locks still held) and the kernel plan the step keeps."""
        self._owner.block_manager.commit_repeated(step.snapshot, layer)
        step.plan = part.plan

    def _count_repeat(self, batch: StackedAppendAttend, step: Step) -> None:
        """A committed repeated layer's tokens, in the metrics."""
        if self._owner.metrics is not None:
            b = len(batch.seq_ids)
            self._owner.metrics.add_tokens_appended(b * step.snapshot.num_tokens)
            self._owner.metrics.add_attention_tokens(b * step.num_queries[0])

    def _recorded_step(self, tenant: str, seq_ids: Sequence[str]) -> Step | None:
        """The step recorded for this batch (tenant, sequence ids in order), if its worker
        is still one of the coordinator's."""
        step = self._steps.get(tenant, tuple(seq_ids))
        if step is None or step.worker_id not in self._epochs:
            return None
        return step

    def reusable_step(
        self, tenant: str, layer: int, seq_ids: list[str], items: Sequence[AppendAttendItem]
    ) -> Step | None:
        """The recorded step of this batch when this call is another layer of it: the same
        token ids and query rows per sequence, the worker still known, and the block
        manager confirming the write would be planned the same (`repeatable`)."""
        step = self._recorded_step(tenant, seq_ids)
        if step is None:
            return None
        n = step.snapshot.num_tokens
        m = step.num_queries[0]
        tokens: list[object] = []
        for it in items:
            ids = it.token_ids
            if len(ids) != n or it.query.shape[0] != m:
                return None
            tokens += ids
        if not self._owner.block_manager.repeatable(step.snapshot, layer, tokens):
            return None
        return step

    def step_part(
        self,
        step: Step,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        return_lse: bool,
        out: torch.Tensor | None = None,
    ) -> Part:
        """The call's one part from a recorded step: its views, slots and kernel plan, with
        this call's queries ``[rows, Hq, D]`` and new K/V ``[tokens, Hkv, D]`` (sequence by
        sequence, cast to the pool's dtype here), and where its output may go (`out`;
        run_attention uses it only where it fits the plan and the pool's dtype)."""
        dtype = self._pool_dtype
        return Part(
            views=step.views,  # type: ignore[arg-type]
            num_queries=step.num_queries,
            seq_ids=list(step.snapshot.seq_ids),
            query=in_dtype(query, dtype),
            writes={step.worker_id: (step.slots, in_dtype(key, dtype), in_dtype(value, dtype))},
            return_lse=return_lse,
            plan=step.plan,
            out=out,
            step=step,
        )

    def step_parts(
        self,
        step: Step,
        queries: list[torch.Tensor],
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        spans: Spans,
        return_lse: bool,
    ) -> list[tuple[list[int], Part]]:
        """A full-path call that repeats `step` (`reusable_step`) as its one part holding
        every item in order: the items' queries ``[m, Hq, D]`` and new K/V ``[n, Hkv, D]``
        joined (views where `spans` or their memory allow)."""
        dtype = self._pool_dtype
        k_span, v_span, q_span = spans
        part = self.step_part(
            step,
            joined_rows(queries, dtype, q_span),
            joined_rows(keys, dtype, k_span),
            joined_rows(values, dtype, v_span),
            return_lse,
        )
        return [(list(range(len(queries))), part)]

    def remember_step(
        self,
        tenant: str,
        seq_ids: list[str],
        plans: list[WritePlan],
        parts: list[tuple[list[int], Part]],
    ) -> None:
        """Record a planned call for the step's other layers when it qualifies: one part
        holding every item in order, every sequence and slot on one worker, the same query
        rows per sequence, and writes the block manager can snapshot."""
        self._steps.discard(tenant, tuple(seq_ids))
        if len(parts) != 1:
            return
        idx, part = parts[0]
        if len(part.writes) != 1 or len(set(part.num_queries)) != 1:
            return
        ((worker_id, (slots, _, _)),) = part.writes.items()
        for v in part.views:
            if type(v) is not OneWorkerView or v.worker_id != worker_id:
                return
        if idx != list(range(len(seq_ids))):
            return
        snapshot = self._owner.block_manager.snapshot_writes(tenant, seq_ids, plans)
        if snapshot is None:
            return
        views: list[OneWorkerView] = part.views  # type: ignore[assignment]
        self._steps.put(Step(snapshot, worker_id, part.num_queries, views, list(slots), part.plan))
