"""Worker rounds: how the parts of calls reach the workers and their results come back.

`Rounds.execute` hands each single-worker part to the batcher of its (layer, worker, query
heads) (`engine.batching`), and runs a part spread over several workers on its own.
`Rounds.run_parts` runs one batch: one attention plan, one call per worker
(`attention_plan.run_attention`), each part's rows set on its future. A worker that fails
the round with a stale epoch or cannot be reached is handed to the coordinator's failure
handling; a round holding non-finite values fails the parts that hold them and runs the
others again. A sampled round starts an online correctness check once its callers have
their answers.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from cache_service.config import CoordinatorConfig
from cache_service.engine.attention_plan import (
    AttentionPlan,
    LayerPages,
    OneWorkerView,
    SequenceViewLike,
    WorkerWrite,
    one_writer_in_order,
    plan_attention,
    run_attention,
)
from cache_service.engine.batching import Batcher, Part
from cache_service.engine.call_origin import current_origin
from cache_service.engine.call_tensors import part_rows
from cache_service.engine.cancel_safety import run_to_completion
from cache_service.engine.correctness_check import CorrectnessChecker
from cache_service.engine.errors import WorkerLost
from cache_service.engine.input_checks import sums_finite
from cache_service.engine.running_checks import RunningCheck, RunningChecks
from cache_service.engine.steps import Step
from cache_service.engine.worker_interface import AttentionResult, WorkerClient
from cache_service.errors import SequenceLost
from workers.errors import NonFiniteInput, StaleEpochError, WorkerUnavailable
from workers.layout import KVLayout

__all__ = ["Rounds"]

BatchKey = tuple[int | None, str, int]
# The coordinator's failure handling: (error, epochs the round used, its sequences) ->
# the WorkerLost to hand the callers.
WorkerFailed = Callable[
    [StaleEpochError | WorkerUnavailable, dict[str, str], list[str]], Awaitable[WorkerLost]
]


class Rounds:
    """The coordinator's round runner: its batchers, the plans of recurring rounds, and the
    worker calls of every per-layer attention.

    Args:
        layout: the workers' KV layout.
        config: batching window, batch size, coalesce_layers, overlap_rounds.
        clients: worker id -> client (the coordinator's dict, shared).
        epochs: worker id -> epoch of every registered worker (the coordinator's dict,
            shared: a lost worker is absent).
        metrics: a `ServiceMetrics` to feed, or None.
        correctness: the online correctness checker, or None when off.
        checks: the running checks of answered rounds.
        background: the coordinator's background tasks (close() cancels them).
        released_before_use: waits for block releases pending on those workers.
        worker_failed: drops a failed worker (see `WorkerFailed`).
    """

    def __init__(
        self,
        layout: KVLayout,
        config: CoordinatorConfig,
        clients: Mapping[str, WorkerClient],
        epochs: Mapping[str, str],
        metrics: Any,
        correctness: CorrectnessChecker | None,
        checks: RunningChecks,
        background: set[asyncio.Task[None]],
        released_before_use: Callable[[Iterable[str]], Awaitable[None]],
        worker_failed: WorkerFailed,
    ) -> None:
        self.layout = layout
        self.config = config
        self.metrics = metrics
        self.correctness = correctness
        self._clients = clients
        self._epochs = epochs
        self._checks = checks
        self._background = background
        self._released_before_use = released_before_use
        self._worker_failed = worker_failed
        self.batchers: dict[BatchKey, Batcher] = {}
        # Plans of rounds that coalesced the same recorded steps (see _round_plan), by the
        # steps' keys (a key names one step: never reused).
        self._round_plans: OrderedDict[tuple[int, ...], AttentionPlan] = OrderedDict()

    async def execute(
        self, layer: int, parts: list[tuple[list[int], Part]], hq: int
    ) -> list[AttentionResult]:
        """Run every part of a call (coalescing single-worker ones) on `layer` with `hq`
        query heads; results in part order."""
        loop = asyncio.get_running_loop()
        waits = []
        origin = current_origin()
        for _, part in parts:
            answered_by_future(part, layer, origin)
            if part.step is not None:  # a recorded step lives on one worker
                workers = {part.step.worker_id}
            else:
                workers = set(part.writes)
                for v in part.views:
                    if type(v) is OneWorkerView:
                        workers.add(v.worker_id)
                    else:
                        workers.update(seg.worker_id for seg in v.segments)
            if len(workers) == 1:
                (worker_id,) = workers
                self.batcher(layer, worker_id, hq).submit(part)
            else:
                task = loop.create_task(self.run_parts((layer, "", hq), [part]))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
            waits.append(part.future)
        # Every part must finish (or fail) before the call returns, even when its deadline
        # passed meanwhile: a write still in flight must not race the next call on the
        # same sequence (cache_service.engine.cancel_safety).
        if len(waits) == 1:  # the usual call: one part, no gather to build
            return [await run_to_completion(waits[0])]
        outcome = await run_to_completion(asyncio.gather(*waits, return_exceptions=True))
        for result in outcome:
            if isinstance(result, BaseException):
                raise result
        return list(outcome)  # type: ignore[arg-type]

    def batcher(self, layer: int, worker_id: str, hq: int) -> Batcher:
        """The batcher of parts on `layer` for `worker_id` with `hq` query heads."""
        # With coalesce_layers one batcher per worker (and head count) takes every layer.
        key = (None if self.config.coalesce_layers else layer, worker_id, hq)
        batcher = self.batchers.get(key)
        if batcher is None:
            batcher = self.batchers[key] = Batcher(
                key,
                self.config.batch_window_ms / 1000.0,
                self.config.max_batch_items,
                self.run_parts,
                overlap=self._overlaps(worker_id),
            )
        return batcher

    def _overlaps(self, worker_id: str) -> bool:
        """Whether the batcher of `worker_id`'s calls lets two groups of callers take
        turns: CoordinatorConfig.overlap_rounds; by default for a worker in another
        process, not for one in this process (its calls hold the event loop: nothing to
        overlap with)."""
        overlap = self.config.overlap_rounds
        if overlap is None:
            client = self._clients.get(worker_id)
            return client is not None and client.out_of_process
        return overlap

    async def run_parts(self, key: BatchKey, parts: list[Part]) -> None:
        """One worker round for several parts: one plan, one call per worker, results split
        back to each part's future."""
        check_on_device = False
        layers = {p.layer for p in parts}
        # One layer (the usual round): per-layer calls. Several (coalesce_layers): one call
        # over pages of every layer.
        layer = parts[0].layer if len(layers) == 1 else None
        # A round of recorded steps plans as it did on their earlier layers, whether its
        # parts are on one layer or on several (over pages): the views are the steps'.
        # (This puts the parts in the steps' one order, before their lists are joined.)
        round_key = _round_steps(parts)
        if len(parts) == 1:  # the lone caller's round: its part's lists as they are
            views, nq, seq_ids = parts[0].views, parts[0].num_queries, parts[0].seq_ids
        else:
            views = [v for p in parts for v in p.views]
            nq = [n for p in parts for n in p.num_queries]
            seq_ids = [s for p in parts for s in p.seq_ids]
        epochs: dict[str, str] = {}
        try:
            plan = self._plan_of(parts, round_key, views, nq)
            query, writes, into, over_layers = _round_tensors(parts, plan, layer)
            check_on_device = _checked_on_device(parts, plan, writes)
            if not check_on_device and not _joined_finite(parts, query, writes.values()):
                # Someone's values are not finite: find whose, fail those, run the rest.
                survivors = _finite_parts(parts)
                if survivors:
                    await self.run_parts(key, survivors)
                return
            workers = {b.worker_id for b in plan.batches} | set(writes)
            await self._released_before_use(workers)
            # Checked after the releases: a failed host tier copy among them drops its worker.
            missing = [w for w in workers if w not in self._epochs]
            if missing:
                raise SequenceLost(
                    f"worker(s) {missing} holding blocks of this call were lost; free the "
                    "sequences and recompute"
                )
            epochs = {w: self._epochs[w] for w in workers}
            t0 = time.perf_counter()
            result = await run_attention(
                plan,
                query,
                layer if not over_layers else self._pages(parts),
                self._clients,
                epochs,
                writes=writes,
                return_lse=any(p.return_lse for p in parts),
                out=into,
                check_finite=check_on_device,
            )
            elapsed = time.perf_counter() - t0
            if self.metrics is not None:
                for w in workers:
                    self.metrics.observe_worker_call(
                        w, len(seq_ids), elapsed, len(parts), layer is None
                    )
            outs, lses = part_rows(parts, result)
        except (StaleEpochError, WorkerUnavailable) as exc:
            _fail_lost(parts, await self._worker_failed(exc, epochs, seq_ids))
            return
        except Exception as exc:  # plan / validation errors: every part fails the same way
            if isinstance(exc, NonFiniteInput) and check_on_device and len(parts) > 1:
                # The worker refused the shared round, nothing written: find whose values
                # are not finite (they fail), run the others' again.
                survivors = _finite_parts(parts)
                if survivors:
                    await self.run_parts(key, survivors)
                return
            for p in parts:
                if not p.future.done():
                    p.future.set_exception(exc)
            return
        if layer is not None and self.correctness is not None and self.correctness.sample():
            await self._start_check(
                self.correctness, plan, query, layer, epochs, result, seq_ids, nq
            )
        _answer(parts, outs, lses)

    def _plan_of(
        self,
        parts: list[Part],
        round_key: tuple[Step, ...] | None,
        views: list[SequenceViewLike],
        nq: list[int],
    ) -> AttentionPlan:
        """The attention plan of a round: a lone part's own (a recorded step's, or made now
        and kept on it), the kept plan of a round of recorded steps (`round_key`), else a
        new one."""
        if len(parts) == 1 and parts[0].plan is not None:
            return parts[0].plan
        if round_key is not None:
            return self._round_plan(round_key, views, nq)
        if len(parts) == 1:
            # A recorded step's plan carries the step's key down to the worker.
            step = parts[0].step
            key = None if step is None else step.key
            plan = parts[0].plan = plan_attention(views, nq, self.layout.block_size, key=key)
            return plan
        return plan_attention(views, nq, self.layout.block_size)

    def _pages(self, parts: list[Part]) -> LayerPages:
        """Where a round over layers reads and writes: each sequence's layer, in order."""
        return LayerPages(
            np.repeat(
                np.array([p.layer for p in parts], dtype=np.int64),
                [len(p.seq_ids) for p in parts],
            )
        )

    async def _start_check(
        self,
        checker: CorrectnessChecker,
        plan: AttentionPlan,
        query: torch.Tensor | list[torch.Tensor],
        layer: int,
        epochs: dict[str, str],
        result: AttentionResult,
        seq_ids: list[str],
        nq: list[int],
    ) -> None:
        """Check a round beside the traffic once its callers are answered (see
        running_checks): registered now, while the callers still hold their sequences, on
        copies of its query and output (the callers' buffers are theirs to reuse)."""
        blocks = {
            b.worker_id: frozenset(int(i) for e in b.entries for i in e.block_indices)
            for b in plan.batches
        }
        check = RunningCheck(frozenset(seq_ids), blocks)
        # Copies (of the parts, joined, for a round given in parts).
        query = torch.cat(query) if isinstance(query, list) else query.clone()
        got = result.out
        served = AttentionResult(
            torch.cat(got) if isinstance(got, list) else got.clone(),
            None if result.lse is None else result.lse.clone(),
        )

        def run() -> Awaitable[object]:
            return checker.check(
                plan, query, layer, self._clients, epochs, served, seq_ids, nq, check.valid
            )

        task = await self._checks.start(check, run)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _round_plan(
        self, steps: tuple[Step, ...], views: list[SequenceViewLike], nq: list[int]
    ) -> AttentionPlan:
        """The plan of a round coalescing exactly these recorded steps (in this order),
        made once: concurrent clients in step with each other meet again on the next layer,
        and their steps' views do not change between layers (engine.steps). Kept for the
        most recent `_MAX_ROUND_PLANS` sets, by the steps' keys; a new step has a new key,
        so a stale plan is never found again."""
        key = tuple(s.key for s in steps)
        kept = self._round_plans.get(key)
        if kept is not None:
            self._round_plans.move_to_end(key)
            return kept
        plan = plan_attention(views, nq, self.layout.block_size)
        self._round_plans[key] = plan
        while len(self._round_plans) > _MAX_ROUND_PLANS:
            self._round_plans.popitem(last=False)
        return plan


def answered_by_future(part: Part, layer: int, origin: int | None) -> None:
    """Ready `part` for a round: the future that answers it, its layer, and the caller's
    connection (`call_origin`) the batcher groups callers by."""
    part.future = asyncio.get_running_loop().create_future()
    part.layer = layer
    part.origin = origin


def _round_tensors(
    parts: list[Part], plan: AttentionPlan, layer: int | None
) -> tuple[
    torch.Tensor | list[torch.Tensor],
    dict[str, WorkerWrite],
    torch.Tensor | list[torch.Tensor] | None,
    bool,
]:
    """What a round hands the workers: (query rows, worker -> its writes, where the output
    goes or None, whether the round goes over layers rather than to one layer).

    A round of several callers that one worker writes and computes in order goes to it in
    parts, as a round over layers (one layer or several): each caller's query, keys and
    values where the caller put them, each output part into the caller's slot
    (run_attention; the event loop copies nothing), one graph per round shape on the worker
    whichever layers. Other rounds join them here, and a round over several layers
    (`layer` None) that is not one worker's goes over pages.
    """
    merged: dict[str, list[tuple[list[int], torch.Tensor, torch.Tensor]]] = {}
    for p in parts:
        for worker_id, w in p.writes.items():
            merged.setdefault(worker_id, []).append(w)
    in_parts = len(parts) > 1 and (layer is None or one_writer_in_order(plan, merged))
    over_layers = layer is None or in_parts
    slot_layers: dict[str, list[int]] = {}  # over layers: each new token's layer
    if over_layers:
        for p in parts:
            for worker_id, w in p.writes.items():
                slot_layers.setdefault(worker_id, []).extend([p.layer] * len(w[0]))
    query: torch.Tensor | list[torch.Tensor]
    if in_parts:
        query = [p.query for p in parts]
    else:
        query = torch.cat([p.query for p in parts]) if len(parts) > 1 else parts[0].query
    join = list if in_parts else torch.cat
    writes = {
        w: WorkerWrite(*ws[0], slot_layers=slot_layers.get(w))
        if len(ws) == 1
        else WorkerWrite(
            [s for slots, _, _ in ws for s in slots],
            join([k for _, k, _ in ws]),
            join([v for _, _, v in ws]),
            slot_layers.get(w),
        )
        for w, ws in merged.items()
    }
    into: torch.Tensor | list[torch.Tensor] | None = parts[0].out if len(parts) == 1 else None
    if in_parts and all(p.out is not None for p in parts):
        into = [p.out for p in parts]  # type: ignore[misc]
    return query, writes, into, over_layers


def _answer(
    parts: list[Part],
    outs: Sequence[torch.Tensor],
    lses: Sequence[torch.Tensor | None],
) -> None:
    """Set each part's rows of its round (`part_rows`) on its future, in the part's output
    slot where it has one."""
    for p, out, lse in zip(parts, outs, lses, strict=True):
        if p.future.done():
            continue
        target = p.out
        if (
            target is not None
            and target.data_ptr() != out.data_ptr()  # not produced there already
            and target.shape == out.shape
            and target.dtype == out.dtype
        ):
            # Rows of a shared round: copied into the caller's output slot here, where a
            # torch copy costs less than the reply's write of a slice (which skips an
            # output already in place).
            target.copy_(out)
            out = target
        p.future.set_result(AttentionResult(out, lse))


def _fail_lost(parts: list[Part], error: WorkerLost) -> None:
    """Fail a round's parts with the loss of a worker: each caller hears of its own
    sequences only (parts of one round may belong to other tenants' calls)."""
    for p in parts:
        if not p.future.done():
            own = list(dict.fromkeys(p.seq_ids))
            p.future.set_exception(WorkerLost(error.worker_id, own, error.reason))


# Round plans kept (Rounds._round_plan): a few per concurrent client is plenty.
_MAX_ROUND_PLANS = 64


def _round_steps(parts: list[Part]) -> tuple[Step, ...] | None:
    """The recorded steps of a round of several parts, each part repeating a different
    one, with `parts` put in the one order of that set of steps (so the round's plan, and
    with it the worker's metadata key and graphs, is the same every layer they coalesce
    again); None, `parts` untouched, for anything else (a lone part, one without a step)."""
    if len(parts) < 2 or any(p.step is None for p in parts):
        return None
    if len({p.step.key for p in parts}) != len(parts):  # type: ignore[union-attr]
        return None
    parts.sort(key=lambda p: p.step.key)  # type: ignore[union-attr]
    return tuple(p.step for p in parts)  # type: ignore[misc]


def _checked_on_device(
    parts: list[Part], plan: AttentionPlan, writes: Mapping[str, WorkerWrite]
) -> bool:
    """Whether the worker checks this round's values for NaN and infinities on its device
    (the round's check_finite: KVPool.run_round; for free where the data goes anyway): a round with a part nobody
    checked yet (`Part.finite_checked` False), one worker writing and reading every row.

    A lone part's refusal is its own (the short path then takes the full path, which
    names the culprit). A shared round the worker refuses wrote nothing; `Rounds.run_parts` then
    looks part by part (`_finite_parts`) and runs the finite ones again, so one caller's
    bad values fail only that caller. Any other round is checked here (`_joined_finite`,
    then `_finite_parts`).
    """
    return (
        not all(p.finite_checked for p in parts)
        and len(plan.batches) == 1
        and set(writes) == {plan.batches[0].worker_id}
    )


def _joined_finite(
    parts: list[Part], query: torch.Tensor | list[torch.Tensor], writes: Iterable[WorkerWrite]
) -> bool:
    """Whether every part of a round is known to hold finite values: checked before, or
    (one pass over the round's joined query, keys and values instead of three per part)
    all of the round's values sum to a finite number. False: look part by part."""
    if all(p.finite_checked for p in parts):
        return True
    given = [query, *(t for w in writes for t in (w.key, w.value))]
    joined = [t for g in given for t in (g if isinstance(g, list) else (g,))]  # parts too
    if not sums_finite([t.reshape(-1) for t in joined]):
        return False
    for p in parts:
        p.finite_checked = True
    return True


def _finite_parts(parts: list[Part]) -> list[Part]:
    """The parts of a round whose values are finite, each checked on its own; the others
    get NonFiniteInput on their futures (the short path then takes the full path, which
    names the culprit)."""
    for part in parts:
        if part.finite_checked:
            continue
        tensors = [part.query] + [t for _, k, v in part.writes.values() for t in (k, v)]
        if sums_finite([t.reshape(-1) for t in tensors]):
            part.finite_checked = True
        elif not part.future.done():
            part.future.set_exception(
                NonFiniteInput("a key, value or query holds NaN or infinite values")
            )
    return [p for p in parts if p.finite_checked]
