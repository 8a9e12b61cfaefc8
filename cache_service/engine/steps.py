"""A decode step planned once: the :class:`Step` its later layers repeat.

A model's decode step calls append-and-attend once per layer with the same sequences and
the same new token ids: every layer writes the same positions into the same slots and
attends over the same block ids, so the slots, the attention views and the kernel batch
are the same for all of them. Only the first layer of the step has to reserve positions
and plan; the coordinator keeps what it planned as a :class:`Step`, named by a key, and the
other layers reuse it after `BlockManager.repeatable` confirmed that nothing about those
sequences changed in between (see its docstring for what is checked).

The key goes down with every round of the step (`workers.round.Round.step_key`): the
worker keeps the step's metadata (block tables, lengths, query offsets, slots) validated on
its device under it, so no layer below has to find out again that a call repeats a step.

What a step holds is immutable once built (views are read-only snapshots of the block
ids), except `plan`, which the first run fills in when the step was recorded without one.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from cache_service.control.block_manager import WriteSnapshot
from cache_service.engine.attention_plan import AttentionPlan, OneWorkerView
from cache_service.engine.worker_batch import mint_key

__all__ = ["Step", "StepCache"]

_Key = tuple[str, tuple[str, ...]]  # (tenant, the batch's sequence ids in order)


@dataclass(slots=True)
class Step:
    """One batch's planned write-and-attend, reusable by the step's other layers.

    Attributes:
        snapshot: the writes as the block manager planned them.
        worker_id: the one worker holding every sequence (and every new slot).
        num_queries: query rows of each sequence (the same for all).
        views: per sequence, what attention reads after the write (seq_len = start + n).
        slots: flat slots of the new tokens, sequence by sequence (n per sequence).
        plan: the kernel batch for exactly these views and query rows, once computed
            (its one batch carries `key`).
        key: names the step for the worker (its rounds' `step_key`): the key of the plan
            the first layer ran with, or one minted when the step was recorded without a
            plan (the plan then made for it carries it).
        lock_order: the batch's sequence ids, distinct and sorted: the order the
            coordinator takes their locks in, worked out once for every layer.
        planned_only: planned for a step lease without writing any layer (a StepLease
            with token ids), rather than by a call that wrote its first layer.
        steps: decode steps planned (a multi-step lease): the snapshot reserved `steps`
            positions per sequence, the views and plan are the last step's, `slots` step
            by step.
    """

    snapshot: WriteSnapshot
    worker_id: str
    num_queries: list[int]
    views: list[OneWorkerView]
    slots: list[int]
    plan: AttentionPlan | None = None
    planned_only: bool = False
    steps: int = 1
    key: int = field(init=False)
    lock_order: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        self.lock_order = tuple(sorted(set(self.snapshot.seq_ids)))
        plan = self.plan
        self.key = plan.batches[0].key if plan is not None and plan.batches else mint_key()


class StepCache:
    """The latest :class:`Step` per (tenant, batch of sequence ids), least recently
    used dropped first beyond `capacity` (one entry per client batch in flight)."""

    def __init__(self, capacity: int = 256) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._capacity = capacity
        self._steps: OrderedDict[_Key, Step] = OrderedDict()
        # seq_id -> keys of the steps naming it: a freed sequence's steps go at once
        # (a step holds the sequence's bookkeeping alive).
        self._by_seq: dict[str, set[_Key]] = {}

    def __len__(self) -> int:
        return len(self._steps)

    def get(self, tenant: str, seq_ids: tuple[str, ...]) -> Step | None:
        """The step recorded for this batch, if any (marks it recently used)."""
        key = (tenant, seq_ids)
        step = self._steps.get(key)
        if step is not None:
            self._steps.move_to_end(key)
        return step

    def put(self, step: Step) -> None:
        """Record `step` for its batch, replacing the previous one."""
        key = (step.snapshot.tenant, step.snapshot.seq_ids)
        if key not in self._steps:
            for seq_id in key[1]:
                self._by_seq.setdefault(seq_id, set()).add(key)
        self._steps[key] = step
        self._steps.move_to_end(key)
        if len(self._steps) > self._capacity:
            self._drop(next(iter(self._steps)))

    def discard(self, tenant: str, seq_ids: tuple[str, ...]) -> None:
        """Forget the batch's step (nothing if none)."""
        if (tenant, seq_ids) in self._steps:
            self._drop((tenant, seq_ids))

    def forget_sequence(self, seq_id: str) -> None:
        """Forget every step naming `seq_id` (it was freed)."""
        for key in list(self._by_seq.get(seq_id, ())):
            self._drop(key)

    def _drop(self, key: _Key) -> None:
        del self._steps[key]
        for seq_id in key[1]:
            keys = self._by_seq.get(seq_id)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_seq[seq_id]
