"""Online correctness check: a sampled fraction of attention calls is recomputed and compared.

For a sampled worker round (one `plan_attention` plan run by `run_attention`), every worker
of the plan recomputes its part with the torch reference from the same blocks
(``reference_attend``), the partials are merged as the real ones were, and the result is
compared with the output the callers got, with a tolerance set by the pool dtype. The
workers also compare every slot they read with the fingerprint taken when it was written
(``workers.fingerprints``), which catches blocks whose contents changed after the write:
kernel and reference read the same blocks, so only the fingerprints can see that.

Every check that ran to a verdict is timed (``kvcache_correctness_check_seconds``: its
count is the number of checks). A mismatch is counted
(``ServiceMetrics.add_correctness_mismatch(worker, layer)``) and logged with the sequences
and layer; the callers were answered as computed (the check reports, it does not repair).

The coordinator answers a checked round's callers first and runs the check beside the
traffic (``cache_service.engine.running_checks``), so a check adds no latency to any call. The
data it reads stays as it was unless one of its blocks goes free (a freed sequence, a
copy-on-write copy replacing a shared block, an eviction: the block may then be reused)
or one of its sequences has a write cancelled (a slot may then be written again) while
it runs; the coordinator then marks the check void (``valid`` returns False) and its
result, which may have read another owner's data, is discarded and counted
(``kvcache_correctness_checks_discarded_total``), never reported as a mismatch. A failing
check (worker gone, ...) is logged and counted as an error; it never fails a call.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cache_service.engine.attention_plan import AttentionPlan, WorkerBatch, merge_partials
from cache_service.engine.worker_interface import AttentionResult

__all__ = [
    "CheckOutcome",
    "CorrectnessChecker",
    "compare_outputs",
    "tolerance_for",
]

log = logging.getLogger("kvcache.correctness")

# (atol, rtol) per pool dtype: two correct implementations round differently (accumulation
# order, the output's final rounding), by about one unit in the last place of the dtype.
_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
}


def tolerance_for(dtype: torch.dtype) -> tuple[float, float]:
    """``(atol, rtol)`` for outputs in ``dtype`` (float16 / bfloat16 / float32).

    Raises:
        ValueError: another dtype.
    """
    try:
        return _TOLERANCES[dtype]
    except KeyError:
        raise ValueError(
            f"no tolerance for dtype {dtype}; use float16, bfloat16 or float32"
        ) from None


def compare_outputs(
    out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype
) -> tuple[float, list[int]]:
    """Compare an attention output with its reference.

    Args:
        out, ref: ``[T, Hq, D]`` (any float dtypes; compared in float32).
        dtype: the pool dtype that sets the tolerance.

    Returns:
        ``(max |out - ref|, rows that differ beyond atol + rtol * |ref|)``; NaN anywhere in
        ``out`` counts as a difference.

    Raises:
        ValueError: the shapes differ.
    """
    if out.shape != ref.shape:
        raise ValueError(f"output shape {list(out.shape)} differs from reference {list(ref.shape)}")
    if out.numel() == 0:
        return 0.0, []
    atol, rtol = tolerance_for(dtype)
    a, b = out.float(), ref.float()
    diff = (a - b).abs()
    ok = diff <= atol + rtol * b.abs()  # False for NaN
    bad_rows = (~ok).flatten(1).any(1).nonzero().flatten().tolist()
    finite = diff[torch.isfinite(diff)]
    max_err = float(finite.max()) if finite.numel() else 0.0
    if not bool(torch.isfinite(diff).all()):
        max_err = float("nan")
    return max_err, bad_rows


@dataclass(frozen=True)
class CheckOutcome:
    """What one check found.

    Attributes:
        max_error: largest absolute difference between the served output and the reference.
        bad_rows: query rows of the round whose output differs beyond tolerance.
        bad_slots: per worker, slots whose data changed since written:
            ``(sequence index in the round, block, offset, kind 0=K 1=V)``.
        mismatched_workers: workers the mismatch is attributed to (counted once each).
    """

    max_error: float
    bad_rows: list[int]
    bad_slots: dict[str, list[tuple[int, int, int, int]]]
    mismatched_workers: list[str]

    @property
    def ok(self) -> bool:
        return not self.mismatched_workers


@dataclass
class CorrectnessChecker:
    """Samples worker rounds and checks them (see the module docstring).

    Args:
        fraction: share of rounds checked, in [0, 1] (0: never).
        pool_dtype: the pools' dtype (sets the tolerance).
        metrics: a ServiceMetrics (or None).
        seed: seed of the sampler (None: from the OS).
        sequences: check at most this many of a round's sequences, drawn at random (None:
            all). Bounds a check's cost (the workers' time spent recomputing), at the
            price of coverage per check. Rounds whose sequences span several workers
            (partial outputs to merge) are checked whole.

    Attributes:
        checks: rounds checked so far; mismatches: rounds that failed their check;
        errors: checks that could not run (a worker failed the reference call);
        discarded: checks voided because their sequences changed while they ran.
    """

    fraction: float
    pool_dtype: torch.dtype
    metrics: Any = None
    seed: int | None = None
    sequences: int | None = None
    checks: int = 0
    mismatches: int = 0
    errors: int = 0
    discarded: int = 0
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.fraction, bool) or not (
            isinstance(self.fraction, int | float) and 0.0 <= self.fraction <= 1.0
        ):
            raise ValueError(f"fraction must be a number in [0, 1], got {self.fraction!r}")
        if self.sequences is not None and (
            isinstance(self.sequences, bool)
            or not isinstance(self.sequences, int)
            or self.sequences < 1
        ):
            raise ValueError(f"sequences must be a positive int or None, got {self.sequences!r}")
        tolerance_for(self.pool_dtype)
        self._rng = random.Random(self.seed)

    def sample(self) -> bool:
        """Whether to check the next round."""
        return self.fraction > 0 and (self.fraction >= 1 or self._rng.random() < self.fraction)

    async def check(
        self,
        plan: AttentionPlan,
        query: torch.Tensor,
        layer: int,
        clients: Mapping[str, Any],
        epochs: Mapping[str, str],
        served: AttentionResult,
        seq_ids: Sequence[str],
        num_queries: Sequence[int],
        valid: Callable[[], bool] | None = None,
    ) -> CheckOutcome | None:
        """Recompute one round and compare it with what was served.

        Args:
            plan: the round's plan; query: its ``[T, Hq, D]`` rows (pool dtype).
            layer: the layer; clients, epochs: the workers of the plan.
            served: the merged output the callers got (a copy nobody else writes).
            seq_ids, num_queries: the round's sequences and their query rows, in plan
                order (for the log).
            valid: asked once the recomputation is back: False when the blocks read may
                have changed meanwhile (see the module docstring); the result is then
                discarded. None: always valid.

        Returns:
            The outcome, or None when the check could not run (logged) or was discarded;
            never raises.
        """
        start = time.perf_counter()
        outcome: CheckOutcome | None = None
        failure: Exception | None = None
        try:
            outcome = await self._recompute(plan, query, layer, clients, epochs, served)
        except Exception as exc:  # the check reports; it must never fail the call
            failure = exc
        if valid is not None and not valid():  # whatever it read may be another's data
            self.discarded += 1
            if self.metrics is not None:
                self.metrics.add_correctness_check_discarded()
            return None
        if outcome is None:
            self.errors += 1
            log.warning(
                "correctness check could not run: %s",
                failure,
                extra={"layer": layer, "sequences": list(seq_ids)},
            )
            return None
        self.checks += 1
        if self.metrics is not None:
            self.metrics.observe_correctness_check(time.perf_counter() - start)
        if not outcome.ok:
            self._report(outcome, layer, seq_ids, num_queries)
        return outcome

    async def _recompute(
        self,
        plan: AttentionPlan,
        query: torch.Tensor,
        layer: int,
        clients: Mapping[str, Any],
        epochs: Mapping[str, str],
        served: AttentionResult,
    ) -> CheckOutcome:
        want_lse = plan.needs_merge
        if self.sequences is not None and not plan.needs_merge:
            return await self._recompute_some(
                self.sequences, plan, query, layer, clients, epochs, served
            )

        answers = await asyncio.gather(
            *(
                _reference(b, query, layer, clients, epochs, plan.causal, want_lse)
                for b in plan.batches
            )
        )
        partials = {b.worker_id: res for b, (res, _) in zip(plan.batches, answers, strict=True)}
        reference = merge_partials(plan, partials)
        max_err, bad_rows = compare_outputs(served.out, reference.out, self.pool_dtype)

        bad_slots: dict[str, list[tuple[int, int, int, int]]] = {}
        blamed: list[str] = []
        for batch, (_, slots) in zip(plan.batches, answers, strict=True):
            rows = set(batch.rows())
            if slots:
                bad_slots[batch.worker_id] = _slot_report(batch, slots)
            if slots or rows.intersection(bad_rows):
                blamed.append(batch.worker_id)
        return CheckOutcome(max_err, bad_rows, bad_slots, blamed)

    async def _recompute_some(
        self,
        count: int,
        plan: AttentionPlan,
        query: torch.Tensor,
        layer: int,
        clients: Mapping[str, Any],
        epochs: Mapping[str, str],
        served: AttentionResult,
    ) -> CheckOutcome:
        """`_recompute` for `count` of the round's sequences, drawn at random: each of their
        workers recomputes their rows alone (a plan without merges: every sequence is one
        entry of one worker's batch, its rows its own)."""
        entries = [(b.worker_id, e) for b in plan.batches for e in b.entries]
        chosen = self._rng.sample(entries, min(count, len(entries)))
        by_worker: dict[str, list[Any]] = {}
        for worker_id, entry in chosen:
            by_worker.setdefault(worker_id, []).append(entry)
        batches = [WorkerBatch(w, tuple(es)) for w, es in by_worker.items()]

        answers = await asyncio.gather(
            *(_reference(b, query, layer, clients, epochs, plan.causal) for b in batches)
        )
        max_err, bad_rows = 0.0, []
        bad_slots: dict[str, list[tuple[int, int, int, int]]] = {}
        blamed: list[str] = []
        for batch, (result, slots) in zip(batches, answers, strict=True):
            rows = batch.rows()
            err, bad = compare_outputs(served.out[rows], result.out, self.pool_dtype)
            max_err = max(max_err, err)
            bad_rows += [rows[i] for i in bad]
            if slots:
                bad_slots[batch.worker_id] = _slot_report(batch, slots)
            if slots or bad:
                blamed.append(batch.worker_id)
        return CheckOutcome(max_err, sorted(bad_rows), bad_slots, blamed)

    def _report(
        self,
        outcome: CheckOutcome,
        layer: int,
        seq_ids: Sequence[str],
        num_queries: Sequence[int],
    ) -> None:
        self.mismatches += 1
        # Which sequences: those owning a bad row or reading a bad slot.
        row_owner: list[int] = []
        for s, n in enumerate(num_queries):
            row_owner.extend([s] * n)
        involved = {row_owner[r] for r in outcome.bad_rows if r < len(row_owner)}
        involved |= {slot[0] for slots in outcome.bad_slots.values() for slot in slots}
        sequences = sorted({seq_ids[s] for s in involved if s < len(seq_ids)})
        for worker_id in outcome.mismatched_workers:
            if self.metrics is not None:
                self.metrics.add_correctness_mismatch(worker_id, layer)
        log.error(
            "correctness check mismatch on layer %d, sequences %s",
            layer,
            sequences,
            extra={
                "layer": layer,
                "sequences": sequences,
                "workers": outcome.mismatched_workers,
                "max_error": outcome.max_error,
                "bad_rows": outcome.bad_rows[:16],
                "bad_slots": {w: s[:8] for w, s in outcome.bad_slots.items()},
            },
        )


async def _reference(
    batch: WorkerBatch,
    query: torch.Tensor,
    layer: int,
    clients: Mapping[str, Any],
    epochs: Mapping[str, str],
    causal: bool,
    return_lse: bool = False,
) -> tuple[AttentionResult, list[Any]]:
    """`batch`'s worker recomputes its rows of `query` with the torch reference: (its
    result, the slots whose fingerprints no longer match)."""
    q, tables, lens, starts = batch.kernel_args(query)
    return await clients[batch.worker_id].reference_attend(
        epochs[batch.worker_id], layer, q, tables, lens, starts,
        causal=causal, return_lse=return_lse,
    )  # fmt: skip


def _slot_report(batch: WorkerBatch, slots: Sequence[Any]) -> list[tuple[int, int, int, int]]:
    """The changed slots a worker reported, as ``(sequence index in the round, block,
    offset, kind 0=K 1=V)``."""
    return [(batch.entries[s.entry].sequence, s.block, s.offset, s.kind) for s in slots]
