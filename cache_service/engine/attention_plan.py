"""Attention for sequences whose blocks span several workers.

A sequence's block table is a list of segments, each a contiguous run of logical blocks on
one worker (``SequenceView``/``Segment`` of ``cache_service.control.block_manager``). Each worker
attends over its own keys only and returns output + log-sum-exp; the partials merge exactly
(``workers.partials.merge_states``), as a split-KV kernel merges its partitions.

Causality decides what each query sees of a segment holding keys ``[a, b)``. A query at
absolute position ``p``

* ``p < a`` sees nothing of it (no entry; its LSE counts as -inf);
* ``a <= p < b`` sees keys ``a..p``: a run of such queries is one kernel entry whose blocks
  start at ``a`` (a block boundary), with ``seq_len = p_last - a + 1`` and those queries as
  its last rows - positions relative to ``a`` keep the causal mask right;
* ``p >= b`` sees the whole segment: a one-query entry with ``seq_len = b - a`` (its only
  query sits at the last position, so a causal launch shows it every key).

Without ``causal`` every query sees the whole segment: its queries go in chunks of at most
``b - a`` rows (the kernel needs rows <= seq_len per entry). A sequence on one worker stays
one entry and needs no merge. Every worker gets one batch, i.e. one kernel launch per layer.

Planning (:func:`plan_attention`) is pure; :meth:`WorkerBatch.kernel_args`
(``engine.worker_batch``) and :func:`merge_partials` build and combine tensors;
:func:`run_attention` drives the workers.

The hot path (a decode step: every sequence on one worker) passes :class:`OneWorkerView`
views, whose block ids are one int32 array each (kept across calls by the block manager):
planning then does no per-block Python work, and the kernel's block table is assembled from
those arrays with a few numpy calls.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import torch

from cache_service.control.types import Segment
from cache_service.engine.worker_batch import AttentionPlanError, KernelEntry, WorkerBatch
from cache_service.engine.worker_interface import AttentionResult, WorkerClient
from workers.checks import AttendOptions
from workers.partials import merge_states
from workers.parts import joined
from workers.round import Round

__all__ = [
    "AttentionPlan",
    "AttentionPlanError",
    "KernelEntry",
    "LayerPages",
    "OneWorkerView",
    "SegmentLike",
    "SequenceViewLike",
    "WorkerBatch",
    "WorkerWrite",
    "merge_partials",
    "plan_attention",
    "run_attention",
]


class SegmentLike(Protocol):
    """A contiguous run of a block table on one worker."""

    @property
    def worker_id(self) -> str: ...

    @property
    def start_token(self) -> int: ...

    @property
    def block_indices(self) -> Sequence[int]: ...


class SequenceViewLike(Protocol):
    """One sequence's written length and its segments, in logical order."""

    @property
    def seq_len(self) -> int: ...

    @property
    def segments(self) -> Sequence[SegmentLike]: ...


class OneWorkerView:
    """A :class:`SequenceViewLike` whose keys all live on one worker, its block ids as one
    int32 array (``BlockManager.block_ids``): planned without per-block Python work.

    Args:
        seq_len: keys written (the kernel's seq_len), >= 0.
        worker_id: the worker holding every block.
        block_ids: int32 ``[n]`` physical block indices in logical order, covering at
            least ``seq_len`` tokens; read only (it is not copied). Negative ids are refused
            when the kernel's block table is built (:meth:`WorkerBatch.kernel_args`).

    Raises:
        AttentionPlanError: block_ids is not a 1-D int32 array.
    """

    __slots__ = ("block_ids", "seq_len", "worker_id")

    def __init__(self, seq_len: int, worker_id: str, block_ids: np.ndarray) -> None:
        if type(block_ids) is not np.ndarray or block_ids.dtype != np.int32 or block_ids.ndim != 1:
            _fail("OneWorkerView.block_ids must be a 1-D int32 numpy array")
        self.seq_len = seq_len
        self.worker_id = worker_id
        self.block_ids = block_ids

    @property
    def segments(self) -> tuple[Segment, ...]:
        """The generic form: one segment (block ids as a tuple of ints; slow, O(blocks))."""
        if not len(self.block_ids):
            return ()
        return (Segment(self.worker_id, 0, tuple(self.block_ids.tolist())),)

    def __repr__(self) -> str:
        return (
            f"OneWorkerView(seq_len={self.seq_len}, worker_id={self.worker_id!r}, "
            f"blocks={len(self.block_ids)})"
        )


@dataclass(frozen=True)
class AttentionPlan:
    """Per-worker kernel batches of one attention call over one layer.

    Attributes:
        num_rows: query rows of the call (T); sequence s owns the ``num_queries[s]`` rows
            after those of sequences ``0..s-1``.
        num_parts: most partials any row gets (1: no merge, no LSE needed).
        causal: the causal flag every worker launch uses.
        batches: one per worker, in order of first use.
    """

    num_rows: int
    num_parts: int
    causal: bool
    batches: tuple[WorkerBatch, ...]

    @property
    def needs_merge(self) -> bool:
        return self.num_parts > 1


def _fail(message: str) -> None:
    raise AttentionPlanError(message)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _block_ids_ok(blocks: tuple[object, ...]) -> bool:
    """Every entry an int >= 0 (not a bool); plain ints, the usual case, at C speed."""
    if set(map(type, blocks)) == {int}:
        return min(blocks) >= 0  # type: ignore[type-var]
    return all(_is_int(b) and b >= 0 for b in blocks)  # type: ignore[operator]


def _effective_segments(
    s: int, view: SequenceViewLike, block_size: int
) -> list[tuple[str, int, int, tuple[int, ...] | np.ndarray]]:
    """``(worker_id, a, b, blocks)`` for each segment holding keys ``[a, b)`` of the
    sequence, ``b <= seq_len``, blocks trimmed to those keys; validates the view."""
    seq_len = view.seq_len
    if not _is_int(seq_len) or seq_len < 0:
        _fail(f"views[{s}].seq_len must be an int >= 0, got {seq_len!r}")
    if type(view) is OneWorkerView:
        ids = view.block_ids
        needed = -(-seq_len // block_size)
        if len(ids) < needed:
            _fail(
                f"views[{s}] covers {len(ids) * block_size} tokens with its blocks but seq_len "
                f"is {seq_len}"
            )
        return [(view.worker_id, 0, seq_len, ids[:needed])] if seq_len else []
    out = []
    expected_start = 0
    for j, seg in enumerate(view.segments):
        where = f"views[{s}].segments[{j}]"
        blocks = tuple(seg.block_indices)
        if seg.start_token != expected_start:
            _fail(
                f"{where}.start_token is {seg.start_token}, expected {expected_start} (segments "
                "must be contiguous runs in logical order)"
            )
        if not blocks:
            _fail(f"{where} holds no block")
        if not _block_ids_ok(blocks):
            _fail(f"{where}.block_indices must be ints >= 0, got {list(blocks)}")
        a = expected_start
        expected_start += len(blocks) * block_size
        if a >= seq_len:
            continue  # reserved ahead of this layer's written length: no key there yet
        b = min(expected_start, seq_len)
        out.append((seg.worker_id, a, b, blocks[: -(-(b - a) // block_size)]))
    if expected_start < seq_len:
        _fail(f"views[{s}] covers {expected_start} tokens with its blocks but seq_len is {seq_len}")
    return out


def plan_attention(
    views: Sequence[SequenceViewLike],
    num_queries: Sequence[int],
    block_size: int,
    *,
    causal: bool = True,
    sliding_window: int | None = None,
    key: int | None = None,
) -> AttentionPlan:
    """Split a batch of sequences' attention into one kernel batch per worker.

    Args:
        views: each sequence's seq_len (KV tokens, the new ones included) and segments.
        num_queries: query rows of each sequence; its rows are its last positions
            ``seq_len - n .. seq_len - 1``; ``0 <= n <= seq_len``.
        block_size: tokens per block.
        causal: causal attention (else every query sees every key of its sequence).
        sliding_window: the window the kernels will apply; only allowed for sequences on
            one worker (a window does not survive the re-basing of whole-segment entries).
        key: the key of a plan of one batch (a recorded step's: `engine.steps.Step.key`);
            None, or a plan of several batches: each batch mints its own.

    Raises:
        AttentionPlanError: an inconsistent view or query count (named in the message).
    """
    if not _is_int(block_size) or block_size < 1:
        _fail(f"block_size must be a positive int, got {block_size!r}")
    if len(num_queries) != len(views):
        _fail(f"num_queries has {len(num_queries)} entries for {len(views)} views")
    per_worker: dict[str, list[KernelEntry]] = {}
    num_parts = 1
    row = 0
    for s, (view, n) in enumerate(zip(views, num_queries, strict=True)):
        if type(view) is OneWorkerView and causal:
            # The hot path (decode, prefill on one worker): one segment holding every key,
            # so one entry with all the sequence's queries as its last rows - what the
            # general code below computes, without its per-segment work. Anything unusual
            # (bad values, no queries) takes the general code and its checks.
            seq_len = view.seq_len
            if type(seq_len) is int and type(n) is int and 0 < n <= seq_len:
                needed = -(-seq_len // block_size)
                ids = view.block_ids
                if len(ids) >= needed:
                    entries = per_worker.get(view.worker_id)
                    if entries is None:
                        entries = per_worker[view.worker_id] = []
                    entries.append(KernelEntry(s, ids[:needed], seq_len, row, n, 0))
                    row += n
                    continue
        segments = _effective_segments(s, view, block_size)
        if not _is_int(n) or not 0 <= n <= view.seq_len:
            _fail(f"num_queries[{s}] must be an int in [0, seq_len={view.seq_len}], got {n!r}")
        if n == 0:
            continue
        if sliding_window is not None and len(segments) > 1:
            _fail(
                f"sequence {s} spans {len(segments)} worker segments; sliding_window is only "
                "supported for sequences on one worker"
            )
        num_parts = max(num_parts, len(segments))
        first_pos = view.seq_len - n  # absolute position of the sequence's first query
        for part, (worker, a, b, blocks) in enumerate(segments):
            entries = per_worker.setdefault(worker, [])
            _add_segment_entries(
                entries, s, part, a, b, blocks, first_pos, n, row, causal, block_size
            )
        row += n
    batches = tuple(WorkerBatch(w, tuple(e)) for w, e in per_worker.items() if e)
    if key is not None and len(batches) == 1:
        batches = (WorkerBatch(batches[0].worker_id, batches[0].entries, key),)
    return AttentionPlan(num_rows=row, num_parts=num_parts, causal=causal, batches=batches)


def _add_segment_entries(
    entries: list[KernelEntry],
    s: int,
    part: int,
    a: int,
    b: int,
    blocks: tuple[int, ...] | np.ndarray,
    first_pos: int,
    n: int,
    row: int,
    causal: bool,
    block_size: int,
) -> None:
    """Append the entries of sequence `s`'s segment holding keys ``[a, b)`` (merge slot
    `part`, `blocks` its blocks) for its `n` queries at positions ``first_pos ..`` (call
    rows ``row ..``): the cases of the module docstring."""
    if not causal:
        width = b - a
        for i0 in range(0, n, width):
            m = min(width, n - i0)
            entries.append(KernelEntry(s, blocks, b - a, row + i0, m, part))
        return
    # Queries i with a <= first_pos + i < b see keys a..p: one entry.
    i_lo = max(0, a - first_pos)
    i_hi = min(n, b - first_pos)
    if i_lo < i_hi:
        p_last = first_pos + i_hi - 1
        length = p_last - a + 1
        entries.append(
            KernelEntry(
                s, blocks[: -(-length // block_size)], length, row + i_lo, i_hi - i_lo, part
            )
        )
    # Queries at or past b see the whole segment: one single-query entry each.
    for i in range(max(0, b - first_pos), n):
        entries.append(KernelEntry(s, blocks, b - a, row + i, 1, part))


def merge_partials(plan: AttentionPlan, results: Mapping[str, AttentionResult]) -> AttentionResult:
    """Combine the workers' outputs into the call's ``(out [T, Hq, D], lse [T, Hq] | None)``.

    Args:
        plan: the plan the workers ran.
        results: each batch's worker's result, rows in the batch's order; LSEs are needed
            when ``plan.needs_merge``.

    Returns:
        The merged output in the workers' dtype; lse when every worker returned one (always
        after a merge).

    Raises:
        AttentionPlanError: a worker's result is missing or has the wrong number of rows.
    """
    if not plan.batches:
        _fail("the plan has no query rows; nothing to merge")
    for batch in plan.batches:
        res = results.get(batch.worker_id)
        if res is None:
            _fail(f"no result from worker {batch.worker_id!r}")
        if res.out.shape[0] != batch.num_rows:
            _fail(
                f"worker {batch.worker_id!r} returned {res.out.shape[0]} rows, the plan has "
                f"{batch.num_rows}"
            )
        if plan.needs_merge and res.lse is None:
            _fail(f"worker {batch.worker_id!r} returned no LSE but the plan needs a merge")
    first = results[plan.batches[0].worker_id].out
    _, num_heads, head_dim = first.shape
    if not plan.needs_merge:
        if len(plan.batches) == 1 and plan.batches[0].covers_in_order(plan.num_rows):
            return results[plan.batches[0].worker_id]  # the common case: one worker, in order
        out = first.new_empty((plan.num_rows, num_heads, head_dim))
        with_lse = all(results[b.worker_id].lse is not None for b in plan.batches)
        lse = torch.empty((plan.num_rows, num_heads), dtype=torch.float32) if with_lse else None
        for batch in plan.batches:
            res = results[batch.worker_id]
            rows = torch.tensor(batch.rows(), dtype=torch.long, device=out.device)
            out[rows] = res.out
            if lse is not None:
                lse[rows] = res.lse
        return AttentionResult(out, lse)
    outs = first.new_zeros((plan.num_parts, plan.num_rows, num_heads, head_dim))
    lses = torch.full(
        (plan.num_parts, plan.num_rows, num_heads), float("-inf"), dtype=torch.float32
    )
    for batch in plan.batches:
        res = results[batch.worker_id]
        rows = torch.tensor(batch.rows(), dtype=torch.long)
        parts = torch.tensor(
            [e.part for e in batch.entries for _ in range(e.num_rows)], dtype=torch.long
        )
        outs[parts, rows] = res.out.to(outs.device)
        lses[parts, rows] = res.lse.to(lses.device)  # type: ignore[union-attr]
    out, lse = merge_states(outs, lses)
    return AttentionResult(out, lse)


@dataclass(frozen=True)
class WorkerWrite:
    """New tokens for one worker, written before its attention in the same call.

    Attributes:
        slot_mapping: int ``[n]`` flat slots on that worker (negative: skip).
        key, value: ``[n, Hkv, D]`` in the pool dtype, or given in parts (lists of
            ``[n_i, Hkv, D]``, a round's callers' rows: see :func:`run_attention`).
        slot_layers: for a round over several layers (`LayerPages`), each new token's
            layer (``[n]``; the slots are per layer); None otherwise.
    """

    slot_mapping: torch.Tensor | Sequence[int]
    key: torch.Tensor | list[torch.Tensor]
    value: torch.Tensor | list[torch.Tensor]
    slot_layers: list[int] | None = None

    def joined(self) -> WorkerWrite:
        """This write with key and value each one tensor (parts concatenated)."""
        if isinstance(self.key, torch.Tensor) and isinstance(self.value, torch.Tensor):
            return self
        return replace(self, key=joined(self.key), value=joined(self.value))


@dataclass(frozen=True)
class LayerPages:
    """A round whose sequences are on several layers: each planned sequence's layer. The
    worker addresses its pool as pages of every layer for it (workers.pages).

    Attributes:
        seq_layers: int64 ``[num sequences]``, the layer of each planned sequence.
    """

    seq_layers: np.ndarray

    def layers_of(self, batch: WorkerBatch) -> list[int]:
        """The layer of each of `batch`'s sequences (`Round.layers`)."""
        return self.seq_layers[batch.sequences].tolist()


@functools.lru_cache(maxsize=64)
def round_options(
    causal: bool,
    return_lse: bool,
    scale: float | None,
    sliding_window: int | None,
    softcap: float | None,
) -> AttendOptions:
    """The attention options of a round, validated once per distinct set (a decode step's
    rounds all share one).

    Raises:
        InvalidWorkerRequest: a malformed option.
    """
    return AttendOptions(causal, return_lse, scale, sliding_window, softcap)


async def run_attention(
    plan: AttentionPlan,
    query: torch.Tensor | list[torch.Tensor],
    layer: int | LayerPages,
    clients: Mapping[str, WorkerClient],
    epochs: Mapping[str, str],
    *,
    writes: Mapping[str, WorkerWrite] | None = None,
    return_lse: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
    sliding_window: int | None = None,
    out: torch.Tensor | list[torch.Tensor] | None = None,
    check_finite: bool = False,
) -> AttentionResult:
    """Run one round on every worker concurrently, then merge: one ``run_round`` per
    worker of the plan (its writes, then its attention, under the batch's key), a
    ``write`` for a worker that writes but does not attend.

    Args:
        plan: from :func:`plan_attention`.
        query: ``[plan.num_rows, Hq, D]`` in the pool dtype (host); or in parts (a list:
            a round's callers' rows), the writes' K/V in parts too and `out` one part per
            query part (or None); kept as they are where one worker writes and computes
            every row in order, joined otherwise.
        layer: layer index, or the layers of a round over several (each write then names
            its new tokens' layers, `WorkerWrite.slot_layers`).
        clients, epochs: every worker of the plan and of ``writes``, with the epoch expected.
        writes: new tokens per worker, written before that worker attends.
        return_lse: also return the merged LSE (asks every worker for it).
        scale, softcap, sliding_window: as in ``kernels.paged_attention``.
        out: host memory ``[plan.num_rows, Hq, D]`` (the query's dtype) for the output,
            used where one worker writes and computes every row in order (a worker that
            delivers there makes it the result's ``out``); a list for a query in parts.
        check_finite: the writing workers' rounds refuse non-finite inputs
            (workers.errors.NonFiniteInput); for plans where every row is written and read
            by one worker (the caller checks that).

    Raises:
        AttentionPlanError: a worker has no client or epoch, ``query`` has the wrong
            number of rows, or (LayerPages) a worker only writes; nothing was sent.
        WorkerError: a worker failed (StaleEpochError, InvalidWorkerRequest, ...). Workers
            that did not fail may have written their tokens.
    """
    writes = writes or {}
    pages = layer if isinstance(layer, LayerPages) else None
    want_lse = return_lse or plan.needs_merge
    options = round_options(plan.causal, want_lse, scale, sliding_window, softcap)
    if not isinstance(query, torch.Tensor):
        if pages is not None and one_writer_in_order(plan, writes):
            parts_out = out if isinstance(out, list) else None
            return await _run_in_parts(
                plan, query, pages, clients, epochs, writes, options, parts_out, check_finite
            )
        query, writes = joined(query), {w: wr.joined() for w, wr in writes.items()}
    attending = {b.worker_id for b in plan.batches}
    _check_call(plan, query, writes, clients, epochs, pages, attending)
    direct = _direct_out(plan, query, writes, out)
    # Built before anything is sent: one that cannot be built fails the call unsent.
    args = [batch.kernel_args(query) for batch in plan.batches]
    rounds = [
        _round_of(b, a, layer, pages, epochs, writes, options, direct, check_finite)
        for b, a in zip(plan.batches, args, strict=True)
    ]
    write_only = [
        clients[w].write(epochs[w], layer, wr.slot_mapping, wr.key, wr.value)
        for w, wr in writes.items()
        if w not in attending
    ]
    if len(rounds) == 1 and not write_only:  # one worker: awaited directly, no task
        outcome = [await clients[rounds[0][0]].run_round(rounds[0][1])]
    else:
        outcome = await asyncio.gather(*(clients[w].run_round(r) for w, r in rounds), *write_only)
    results = {b.worker_id: r for b, r in zip(plan.batches, outcome, strict=False)}
    if not plan.batches:
        return _empty_result(query, return_lse)
    return merge_partials(plan, results)


def _empty_result(query: torch.Tensor, return_lse: bool) -> AttentionResult:
    """The result of a call without query rows: out ``[0, Hq, D]``, lse float32 ``[0, Hq]``."""
    return AttentionResult(
        query.new_empty((0, *query.shape[1:])),
        torch.empty((0, query.shape[1]), dtype=torch.float32) if return_lse else None,
    )


def _round_of(
    batch: WorkerBatch,
    batch_args: tuple[torch.Tensor, ...],
    layer: int | LayerPages,
    pages: LayerPages | None,
    epochs: Mapping[str, str],
    writes: Mapping[str, WorkerWrite],
    options: AttendOptions,
    out: torch.Tensor | None,
    check_finite: bool,
) -> tuple[str, Round]:
    """One worker's round of `run_attention`: ``(worker id, round)``, its writes (if any)
    then its attention; over several layers (`pages`) each sequence's layer named."""
    w = batch.worker_id
    q, tables, lens, starts = batch_args
    if pages is None:
        rnd = Round(epochs[w], layer, q, tables, lens, starts, options=options, step_key=batch.key)  # type: ignore[arg-type]
    else:
        # A joined round over layers (parts spread over workers): planned for this call only.
        rnd = Round(epochs[w], pages.layers_of(batch), q, tables, lens, starts, options=options)
    wr = writes.get(w)
    if wr is not None:
        rnd.slot_mapping, rnd.key, rnd.value = wr.slot_mapping, wr.key, wr.value
        rnd.slot_layers = wr.slot_layers
        rnd.check_finite = check_finite
        if pages is None:
            rnd.out = out
    return w, rnd


def _check_call(
    plan: AttentionPlan,
    query: torch.Tensor,
    writes: Mapping[str, WorkerWrite],
    clients: Mapping[str, WorkerClient],
    epochs: Mapping[str, str],
    pages: LayerPages | None,
    attending: set[str],
) -> None:
    """Refuse a call `run_attention` cannot send: wrong query rows, a worker without a
    client or epoch, or (over several layers) a worker that writes but does not attend
    (`attending`: the plan's workers)."""
    if query.shape[0] != plan.num_rows:
        _fail(f"query has {query.shape[0]} rows, the plan has {plan.num_rows}")
    workers = [b.worker_id for b in plan.batches]
    workers += [w for w in writes if w not in workers]
    for w in workers:
        if w not in clients or w not in epochs:
            _fail(f"worker {w!r} of the plan has no client or no epoch")
    if pages is not None and set(writes) - attending:
        _fail(f"worker(s) {sorted(set(writes) - attending)} have writes but no attention")
    if pages is not None and any(wr.slot_layers is None for wr in writes.values()):
        _fail("a write of a round over several layers names no layer for its slots")


def _direct_out(
    plan: AttentionPlan,
    query: torch.Tensor,
    writes: Mapping[str, WorkerWrite],
    out: torch.Tensor | list[torch.Tensor] | None,
) -> torch.Tensor | None:
    """`out` where the plan's one worker writes and computes every row in order (it can
    deliver its output there), else None."""
    if not isinstance(out, torch.Tensor):
        return None
    if (
        len(plan.batches) == 1
        and not plan.needs_merge
        and plan.batches[0].covers_in_order(plan.num_rows)
        and plan.batches[0].worker_id in writes
        and out.shape == query.shape
        and out.dtype == query.dtype
    ):
        return out
    return None


def one_writer_in_order(plan: AttentionPlan, writes: Mapping[str, object]) -> bool:
    """Whether one worker computes every row of `plan` in order (nothing to merge) and is
    the only one writing (`writes`: by worker): a round's parts can then go to it as they
    are (:func:`run_attention`)."""
    return (
        len(plan.batches) == 1
        and not plan.needs_merge
        and plan.batches[0].covers_in_order(plan.num_rows)
        and set(writes) == {plan.batches[0].worker_id}
    )


async def _run_in_parts(
    plan: AttentionPlan,
    query: list[torch.Tensor],
    pages: LayerPages,
    clients: Mapping[str, WorkerClient],
    epochs: Mapping[str, str],
    writes: Mapping[str, WorkerWrite],
    options: AttendOptions,
    out: list[torch.Tensor] | None,
    check_finite: bool,
) -> AttentionResult:
    """`run_attention` of a round given in parts, for a plan that one worker writes and
    computes in order (`one_writer_in_order`): one round with the parts as they are, the
    batch's metadata under its key (a round of the same steps repeats it, whichever
    layers) and each sequence's and new token's layer."""
    rows = sum(q.shape[0] for q in query)
    if rows != plan.num_rows:
        _fail(f"query has {rows} rows, the plan has {plan.num_rows}")
    if out is not None and not (
        len(out) == len(query)
        and all(o.shape == q.shape and o.dtype == q.dtype for o, q in zip(out, query, strict=True))
    ):
        out = None
    (batch,) = plan.batches
    w = batch.worker_id
    if w not in clients or w not in epochs:
        _fail(f"worker {w!r} of the plan has no client or no epoch")
    wr = writes[w]
    if wr.slot_layers is None:
        _fail("a write of a round over several layers names no layer for its slots")
    rnd = Round(
        epochs[w], pages.layers_of(batch), query, *batch.metadata_args(),
        slot_mapping=wr.slot_mapping, key=wr.key, value=wr.value, slot_layers=wr.slot_layers,
        options=options, check_finite=check_finite, step_key=batch.key, out=out,
    )  # fmt: skip
    result = await clients[w].run_round(rnd)
    got = result.out
    if isinstance(got, list):
        if out is None or len(got) != len(out):
            _fail(f"worker {w!r} returned {len(got)} output parts for {len(query)} query parts")
    elif got.shape[0] != rows:
        _fail(f"worker {w!r} returned {got.shape[0]} rows, the plan has {rows}")
    return result
