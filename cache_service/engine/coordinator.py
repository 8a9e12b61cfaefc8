"""The coordinator: owns the control plane (BlockManager) and drives the workers.

Request path of one append-and-attend (one layer, a batch of sequences):

1. validate every item against the layout (shapes, dtypes, token counts, duplicates) and
   resolve every sequence (unknown / lost / token ids that differ from reserved ones), all
   before any state changes;
2. lock the call's sequences (a sequence serves one call at a time; free waits too);
3. `prepare_write` each item (slots, copy-on-write copies), run the copies;
4. hand each worker's part to that (layer, worker) batcher: parts of concurrent calls that
   arrive within `batch_window_ms` go to the worker as one round (`run_round`), i.e. one
   KV-write launch and one attention launch for all of them; a lone caller (no recent
   concurrent traffic on that batcher, nothing in flight) goes at once, without the window;
5. when every part of the call has its output, check the call's commit deadline
   (`call_deadline`: past it, cancel every reservation and answer DEADLINE_EXCEEDED), then
   `commit_write` each item and answer.

A sequence spread over several workers (a prefix cached on another GPU, a sequence larger
than a pool) is computed by every worker holding keys and merged by log-sum-exp
(`attention_plan.run_attention`); such parts are not coalesced.

A worker that fails a call with a stale epoch (it restarted: empty pool) or cannot be
reached is removed from the control plane (`lose_worker`): the sequences with blocks on it
fail with DATA_LOSS from then on, the others keep being served. A background task adds it
back, empty, as soon as it answers again.

Concurrency: everything that touches the BlockManager runs on one asyncio event loop, so
each control-plane step is atomic; worker calls are awaited without holding the loop.

The coordinator checks, locks, plans and commits; it owns small collaborators for the
rest: `rounds.Rounds` (batchers and worker rounds, with `batching`), `step_repeats` (a
decode step's other layers), `membership` (workers lost and revived), `block_releases`
(release_blocks ordered before reuse) and `worker_calls` (copies, writes, exports).
Argument checks are in `input_checks`, the tensors' way into parts and back in
`call_parts` and `call_tensors`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from cache_service.config import CoordinatorConfig
from cache_service.control.block_manager import BlockManager, BlockManagerConfig
from cache_service.control.types import (
    CreatedSequence,
    TenantQuota,
    WritePlan,
)
from cache_service.engine.attention_plan import OneWorkerView, plan_attention
from cache_service.engine.batching import Part
from cache_service.engine.block_releases import BlockReleases
from cache_service.engine.call_deadline import check_deadline
from cache_service.engine.call_parts import split_parts, view_after_write, view_of
from cache_service.engine.call_tensors import (
    Spans,
    blocks_to_tokens,
    reassemble,
    stacked_result,
)
from cache_service.engine.cancel_safety import run_to_completion
from cache_service.engine.correctness_check import CorrectnessChecker
from cache_service.engine.errors import ServiceUnavailable
from cache_service.engine.input_checks import (
    block_shape,
    check_append_attend,
    check_finite,
    check_layer,
    check_new_rows,
    check_not_empty,
    check_queries,
    check_reserved,
    check_tensor,
)
from cache_service.engine.kv_event_feed import KvEventFeed
from cache_service.engine.leases import LeaseGrant, Leases
from cache_service.engine.membership import Membership
from cache_service.engine.request_ids import request_seq_id
from cache_service.engine.rounds import Rounds
from cache_service.engine.running_checks import RunningChecks
from cache_service.engine.sequence_locks import SequenceLocks
from cache_service.engine.step_repeats import StepRepeats
from cache_service.engine.steps import Step, StepCache
from cache_service.engine.store import MetadataStore, StoreError
from cache_service.engine.values import (
    AppendAttendItem,
    AttendItem,
    ExportedSequence,
    ImportedSequence,
    JoinedFields,
    StackedAppendAttend,
    WorkerState,
)
from cache_service.engine.worker_calls import WorkerCalls
from cache_service.engine.worker_interface import AttentionResult, WorkerClient
from cache_service.errors import (
    CacheError,
    InvalidRequest,
    LayerNotWritten,
    PoolExhausted,
    QuotaExceeded,
    SequenceLost,
    SequenceNotFound,
)
from workers.layout import KVLayout

__all__ = [
    "MAX_BATCH_ITEMS",
    "AppendAttendItem",
    "AttendItem",
    "Coordinator",
    "ExportedSequence",
    "ImportedSequence",
    "JoinedFields",
    "StackedAppendAttend",
    "WorkerState",
]

log = logging.getLogger("kvcache.coordinator")


# ------------------------------------------------------------------------------ coordinator


class Coordinator:
    """Owns the BlockManager and the WorkerClients; every public method is a coroutine
    run on the coordinator's event loop.

    Args:
        layout: the KV layout every worker must have.
        workers: the worker clients (ids must be distinct).
        config: batching window and limits.
        metrics: a `cache_service.obs.metrics.ServiceMetrics` to feed (optional).

    Tenants are plain names; the server passes the authenticated one ("default" without
    authentication). Errors: the control plane's (`cache_service.errors`),
    `engine.errors.ServiceUnavailable` / `WorkerLost`, and `InvalidRequest` for arguments
    that do not fit the layout; all leave the state unchanged unless documented.
    """

    def __init__(
        self,
        layout: KVLayout,
        workers: Sequence[WorkerClient],
        config: CoordinatorConfig | None = None,
        metrics: Any = None,
        store: MetadataStore | None = None,
    ) -> None:
        ids = [w.worker_id for w in workers]
        if len(set(ids)) != len(ids):
            raise ValueError(f"worker ids must be distinct, got {ids}")
        self.layout = layout
        self.config = config or CoordinatorConfig()
        self.metrics = metrics
        self._clients: dict[str, WorkerClient] = {w.worker_id: w for w in workers}
        self._states: dict[str, WorkerState] = {}
        self._epochs: dict[str, str] = {}
        self.block_manager = BlockManager(_block_manager_config(layout, self.config))
        self._pool_dtype = layout.torch_dtype()
        self._locks = SequenceLocks()
        # Per client batch, what its latest append-and-attend planned (engine.steps).
        self._steps = StepCache()
        self._background: set[asyncio.Task[None]] = set()
        # Workers whose pools poison released blocks (debug pools): only they are told.
        self._debug_workers: set[str] = set()
        # The write-ahead metadata store: start() recovers from it and from then on every
        # control-plane mutation is logged before it returns (cache_service.engine.recovery).
        self._store = store
        self.generation: int | None = None
        # Subscriptions to the prefix index's events; start() makes it (after recovery).
        self.kv_events: KvEventFeed | None = None
        correctness = _correctness_checker(self.config, self._pool_dtype, metrics)
        # Checks of rounds already answered, and what would void them (running_checks).
        self._checks = RunningChecks()
        # The release_blocks calls, ordered before any reuse (engine.block_releases).
        # Registration, loss and return of the workers (engine.membership).
        self._membership = Membership(
            self,
            self._clients,
            self._states,
            self._epochs,
            self._debug_workers,
            self._background,
            lambda: self._released.flush(),
            durable=store is not None,
        )
        self._released = BlockReleases(
            self,
            self._clients,
            self._epochs,
            self._debug_workers,
            self._checks,
            self._background,
            self._membership.worker_failed,
        )
        # Copies, writes and exports: worker calls outside rounds (engine.worker_calls).
        self._calls = WorkerCalls(
            self._clients,
            self._epochs,
            metrics,
            self._released.released_before_use,
            self._membership.worker_failed,
        )
        # Batching and the worker calls of every per-layer attention (engine.rounds).
        self._rounds = Rounds(
            layout,
            self.config,
            self._clients,
            self._epochs,
            metrics,
            correctness,
            self._checks,
            self._background,
            self._released.released_before_use,
            self._membership.worker_failed,
        )
        # A decode step's other layers: recorded steps and the short path (step_repeats).
        self._repeats = StepRepeats(
            self, self._locks, self._steps, self._epochs, self._rounds, self._cancel_writes
        )
        # A step's other layers handed to a co-located client (engine.leases).
        self._leases = Leases(
            self,
            self._locks,
            self._steps,
            self._clients,
            self._epochs,
            self.config.step_lease_timeout_s,
            self._cancel_writes,
        )

    @property
    def correctness(self) -> CorrectnessChecker | None:
        """The online correctness check (cache_service.engine.correctness_check); None when
        off (CoordinatorConfig.correctness_check_fraction 0)."""
        return self._rounds.correctness

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Describe every worker, check its layout and register its pool.

        Raises:
            ValueError: a worker's layout differs from the coordinator's.
            WorkerError: a worker cannot be reached.
        """
        descriptions = await asyncio.gather(*(c.describe() for c in self._clients.values()))
        for desc in descriptions:
            if desc.layout != self.layout:
                raise ValueError(
                    f"worker {desc.worker_id!r} has layout {desc.layout}, the service "
                    f"expects {self.layout}"
                )
        kept: set[str] = set()
        if self._store is not None:
            kept = self._recover(self._store, descriptions)
            # Fence older coordinators off these workers before serving (generation fence).
            await asyncio.gather(*(self._membership.claim(c) for c in self._clients.values()))
        for client, desc in zip(self._clients.values(), descriptions, strict=True):
            self._membership.register(client.worker_id, desc, known=client.worker_id in kept)
        self._released.flush()  # blocks recovery freed (cancelled in-flight reservations)
        self.block_manager.events.set_capacity(self.config.kv_event_ring)
        self.kv_events = KvEventFeed(self.block_manager.events, self.metrics)

    def _recover(self, store: MetadataStore, descriptions: Sequence[Any]) -> set[str]:
        """Rebuild the control plane from the store; returns the workers whose blocks
        survived (same epoch and size). Sequences on the others fail with DATA_LOSS."""
        from cache_service.engine.recovery import recover_control_plane

        live = {d.worker_id: (d.epoch, d.num_blocks) for d in descriptions}
        durable, self.generation, kept = recover_control_plane(
            store, self.block_manager.config, live, self.metrics
        )
        self.block_manager = durable  # type: ignore[assignment]
        return kept

    async def close(self) -> None:
        """Stop background tasks (call after the server drained its calls)."""
        self._membership.closed = True
        await self._leases.end_all()
        if self.kv_events is not None:
            self.kv_events.close()
        for task in list(self._background):
            task.cancel()
        for task in list(self._background):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._store is not None:
            self._store.close()

    # -- read-only -------------------------------------------------------------------------

    def workers(self) -> list[WorkerState]:
        """Every known worker, in registration order."""
        return list(self._states.values())

    def data_path(self, worker_id: str) -> str:
        """How per-layer calls reach the worker ("in_process"; for a Ray worker the last
        call's "channel_unix", "channel_tcp" or "ray"; "" before the first, or where its
        client does not say)."""
        client = self._clients.get(worker_id)
        return str(getattr(client, "data_path", "")) if client is not None else ""

    def stats(self) -> Any:
        """The control plane's `CacheStats` snapshot."""
        return self.block_manager.stats()

    async def lookup(self, tenant: str, token_ids: Sequence[int], namespace: str = "") -> int:
        """Cached leading tokens of a prompt in a namespace (no side effects)."""
        return self.block_manager.lookup(tenant, token_ids, namespace)

    # -- workers and checks ----------------------------------------------------------------

    async def check_workers(self) -> None:
        """Probe every registered worker's epoch once; a changed epoch (a restart nobody
        noticed yet) or no answer removes it like a failed call would."""
        await self._membership.check()

    async def checks_finished(self) -> None:
        """Wait for the online correctness checks started so far (they run after their
        rounds answered): their counts and metrics are then final."""
        await self._checks.wait()

    # -- sequences -------------------------------------------------------------------------

    async def create_sequence(
        self,
        tenant: str,
        prompt_token_ids: Sequence[int] | None = None,
        namespace: str = "",
        request_id: str = "",
    ) -> CreatedSequence:
        """Start a sequence in a prefix-cache namespace ("" = the default), adopting the
        longest prefix of its prompt cached in that namespace.

        request_id: makes the create idempotent: the sequence's id is derived from
        (tenant, request_id) (`request_seq_id`), so a retry answers the sequence the first
        call made (num_cached_tokens: tokens written on every layer of it now), also after
        a restart that recovered it from the write-ahead log.
        """
        self._require_workers()
        seq_id = None
        if request_id:
            seq_id = request_seq_id(tenant, request_id)
            existing = self._existing(tenant, seq_id)
            if existing is not None:
                return existing
        check_deadline()
        created = self.block_manager.create_sequence(
            tenant, prompt_token_ids, seq_id=seq_id, namespace=namespace
        )
        # Host tier blocks it restored (and blocks evicted for them): their copies start
        # now, and every later call on those workers waits for them (block_releases).
        self._released.flush()
        return created

    async def fork(self, tenant: str, seq_id: str, request_id: str = "") -> CreatedSequence:
        """A sequence sharing every block of `seq_id`; num_cached_tokens = tokens written
        on every layer of the source. request_id: as in `create_sequence`."""
        new_seq_id = request_seq_id(tenant, request_id) if request_id else None
        async with self._locked([seq_id]):
            if new_seq_id is not None:
                existing = self._existing(tenant, new_seq_id)
                if existing is not None:
                    return existing
            check_deadline()
            new_id = self.block_manager.fork(tenant, seq_id, new_seq_id=new_seq_id)
            info = self.block_manager.sequence_info(tenant, new_id)
            return CreatedSequence(new_id, min(info.written))

    async def create_sequences(
        self, tenant: str, items: Sequence[tuple[Sequence[int] | None, str, str]]
    ) -> list[CreatedSequence]:
        """`create_sequence` of each (prompt token ids or None, namespace, request id), in
        order, all or nothing: when one fails, the sequences this call created (or found,
        for a request id an earlier attempt used) are freed again and its error is raised,
        its message naming the item (``sequences[i]``).

        Raises:
            InvalidRequest: no items, more than `MAX_BATCH_ITEMS`, or two with one request
            id; what `create_sequence` raises for an item.
        """
        if not items or len(items) > MAX_BATCH_ITEMS:
            raise InvalidRequest(
                f"a batch creates 1 to {MAX_BATCH_ITEMS} sequences, got {len(items)}"
            )
        given = [request_id for _, _, request_id in items if request_id]
        if len(set(given)) != len(given):
            raise InvalidRequest("two items of the batch share a request_id")
        created: list[CreatedSequence] = []
        try:
            for i, (prompt, namespace, request_id) in enumerate(items):
                try:
                    created.append(
                        await self.create_sequence(tenant, prompt, namespace, request_id)
                    )
                except CacheError as exc:
                    raise _item_error(exc, f"sequences[{i}]") from exc
        except BaseException:
            for done in created:
                with contextlib.suppress(CacheError):
                    await self.free(tenant, done.seq_id)
            raise
        return created

    async def free_sequences(self, tenant: str, seq_ids: Sequence[str]) -> None:
        """`free` of each sequence (live or lost), all or nothing: an id that names none
        of the tenant's sequences raises SequenceNotFound naming it, and nothing is freed.

        Raises:
            InvalidRequest: no ids, more than `MAX_BATCH_ITEMS`, or one twice.
            SequenceNotFound: an unknown id (nothing freed).
        """
        ids = list(seq_ids)
        if not ids or len(ids) > MAX_BATCH_ITEMS:
            raise InvalidRequest(f"a batch frees 1 to {MAX_BATCH_ITEMS} sequences, got {len(ids)}")
        if len(set(ids)) != len(ids):
            raise InvalidRequest("seq_ids names a sequence more than once")
        async with self._locked(ids):
            for i, seq_id in enumerate(ids):
                try:
                    self.block_manager.written_lengths(tenant, seq_id)
                except SequenceLost:
                    pass  # freeing a lost sequence clears its record
                except SequenceNotFound as exc:
                    raise _item_error(exc, f"seq_ids[{i}]") from exc
            self._release(tenant, ids)

    def _existing(self, tenant: str, seq_id: str) -> CreatedSequence | None:
        """The sequence `seq_id` of `tenant` as a create's answer, or None if there is none
        (a lost one raises SequenceLost: DATA_LOSS, as any call on it would)."""
        try:
            written = self.block_manager.written_lengths(tenant, seq_id)
        except SequenceNotFound:
            return None
        return CreatedSequence(seq_id, min(written))

    def list_sequences(self, tenant: str, after: str = "", limit: int = 100) -> Any:
        """A page of the tenant's sequences (`BlockManager.list_sequences`)."""
        return self.block_manager.list_sequences(tenant, after, limit)

    async def free(self, tenant: str, seq_id: str) -> None:
        """Release a sequence (waits for a call in flight on it)."""
        async with self._locked([seq_id]):
            self._release(tenant, [seq_id])

    def _release(self, tenant: str, seq_ids: list[str]) -> None:
        """Free sequences whose locks the caller holds, and forget their recorded steps.

        Raises:
            SequenceNotFound: an unknown one (those before it are freed already).
        """
        for seq_id in seq_ids:
            self.block_manager.free(tenant, seq_id)
            self._steps.forget_sequence(seq_id)
        self._released.flush()

    async def pin(self, tenant: str, token_ids: Sequence[int], namespace: str = "") -> int:
        """Pin the cached blocks of a prefix in a namespace; returns the tokens pinned."""
        return self.block_manager.pin(tenant, token_ids, namespace)

    async def unpin(self, tenant: str, token_ids: Sequence[int], namespace: str = "") -> None:
        """Undo one pin of this prefix in a namespace."""
        self.block_manager.unpin(tenant, token_ids, namespace)
        self._released.flush()

    async def publish_public(self, tenant: str, seq_id: str) -> int:
        """Make the sequence's full written blocks findable by every tenant."""
        async with self._locked([seq_id]):
            return self.block_manager.publish_public(tenant, seq_id)

    def set_tenant_quotas(self, quotas: Mapping[str, TenantQuota]) -> None:
        """Make `quotas` the per-tenant limits (e.g. from the token file); tenants not in it
        fall back to the coordinator-wide default. Only changes reach the control plane
        (and its log), so a restart with the same file records nothing."""
        current = self.block_manager.tenant_quotas()
        for tenant in current:
            if tenant not in quotas:
                self.block_manager.set_tenant_quota(tenant)
        for tenant, quota in quotas.items():
            if current.get(tenant, TenantQuota()) != quota:
                self.block_manager.set_tenant_quota(tenant, quota.max_blocks, quota.max_sequences)

    # -- data ------------------------------------------------------------------------------

    async def append(
        self,
        tenant: str,
        seq_id: str,
        layer: int | None,
        token_ids: Sequence[int],
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> int:
        """Write new tokens' K/V (one layer, or all when layer is None); returns the first
        position written.

        key/value: ``[n, Hkv, D]``, or ``[L, n, Hkv, D]`` for layer None.
        """
        n = len(token_ids)
        if layer is None:
            want = (self.layout.num_layers, n, self.layout.num_kv_heads, self.layout.head_dim)
        else:
            check_layer(self.layout, layer)
            want = (n, self.layout.num_kv_heads, self.layout.head_dim)
        if n == 0:
            raise InvalidRequest("token_ids is empty: an append writes at least one token")
        check_new_rows("", n, key, value, want)
        check_tensor("key", key, want)
        check_tensor("value", value, want)
        async with self._locked([seq_id]):
            try:
                # Refuses an unknown / lost sequence before changing anything.
                plan = self.block_manager.prepare_write(tenant, seq_id, layer, token_ids)
            except PoolExhausted:
                self._require_workers()  # no worker at all: UNAVAILABLE, not RESOURCE_EXHAUSTED
                raise
            self._released.flush()  # blocks evicted for this write: poisoned first
            key = key.to(self._pool_dtype)
            value = value.to(self._pool_dtype)
            try:
                # A deadline passing now must not release the lock under calls in flight.
                await run_to_completion(self._calls.write_planned(plan, layer, key, value, seq_id))
                check_deadline()
                self.block_manager.commit_write(tenant, seq_id, layer, n)
            except BaseException:
                self._cancel_writes(tenant, [seq_id])
                raise
        if self.metrics is not None:
            self.metrics.add_tokens_appended(n * (self.layout.num_layers if layer is None else 1))
        return plan.start

    async def attend(
        self,
        tenant: str,
        layer: int,
        items: Sequence[AttendItem],
        return_lse: bool = False,
        *,
        stacked: bool = False,
    ) -> list[AttentionResult]:
        """Attention over `layer` for a batch of sequences; per item (out ``[m, Hq, D]`` in
        the query's dtype, lse float32 ``[m, Hq]`` or None).

        stacked: the items' queries share one dtype; return one result holding every
        item's rows in item order (out ``[sum m, Hq, D]``) instead of one per item.
        """
        check_layer(self.layout, layer)
        check_not_empty(items, "attend")
        queries = [it.query for it in items]
        hq = check_queries(self.layout, queries)
        check_finite(queries, lambda: ((f"items[{i}].query", q) for i, q in enumerate(queries)))
        seq_ids = [it.seq_id for it in items]
        async with self._locked(seq_ids):
            views = []
            for i, it in enumerate(items):
                view = view_of(self.block_manager, self.layout.block_size, tenant, it.seq_id, layer)
                m = it.query.shape[0]
                if m > view.seq_len:
                    raise LayerNotWritten(
                        f"items[{i}]: {m} query rows but layer {layer} of sequence "
                        f"{it.seq_id!r} has only {view.seq_len} written tokens"
                    )
                views.append(view)
            parts = split_parts(self._pool_dtype, views, queries, seq_ids, return_lse)
            outputs = await self._rounds.execute(layer, parts, hq)
        if self.metrics is not None:
            self.metrics.add_attention_tokens(sum(q.shape[0] for q in queries))
        if stacked:
            return [stacked_result(len(items), parts, outputs, queries[0].dtype, return_lse)]
        return reassemble(len(items), parts, outputs, [q.dtype for q in queries])

    async def append_attend(
        self,
        tenant: str,
        layer: int,
        items: Sequence[AppendAttendItem],
        return_lse: bool = False,
        *,
        joined: JoinedFields | None = None,
        stacked: bool = False,
    ) -> list[AttentionResult]:
        """Write each item's new K/V on `layer`, then attend with its queries; one round of
        worker calls for the whole batch (coalesced with concurrent calls).

        joined: what the servicer knows from decoding (see `JoinedFields`): saves finding
        out whether the items' tensors lie back to back. Only a speed-up; results and
        errors are the same without it.
        stacked: as in `attend`.
        """
        queries, hq, seq_ids, keys, values, spans = check_append_attend(
            self.layout, layer, items, joined
        )
        async with self._locked(seq_ids):
            # The step's other layers reuse what its first layer planned (engine.steps).
            step = self._repeats.reusable_step(tenant, layer, seq_ids, items)
            if step is None:
                plans = self._prepare_append(tenant, layer, items)
            committed = False
            try:
                if step is None:
                    if any(plan.copies for plan in plans):
                        # Copy-on-write copies run to the end even if the call's deadline
                        # passes: the tables already point at the copies.
                        await run_to_completion(self._calls.run_copies_of(plans, seq_ids))
                    parts = self._planned_parts(
                        tenant, layer, plans, queries, keys, values, seq_ids, spans, return_lse
                    )
                else:
                    parts = self._repeats.step_parts(step, queries, keys, values, spans, return_lse)
                outputs = await self._rounds.execute(layer, parts, hq)
                # The answer before the commit: a failure making it (a dtype cast out of
                # memory) then keeps nothing, as a failed call must.
                if stacked:
                    answer = [
                        stacked_result(len(items), parts, outputs, queries[0].dtype, return_lse)
                    ]
                else:
                    answer = reassemble(len(items), parts, outputs, [q.dtype for q in queries])
                check_deadline()
                # All or nothing: every write is checked before any is committed.
                self.block_manager.commit_writes(
                    tenant, layer, [(it.seq_id, len(it.token_ids)) for it in items]
                )
                committed = True
                if step is None:
                    self._repeats.remember_step(tenant, seq_ids, plans, parts)
                else:
                    step.plan = parts[0][1].plan
            except BaseException:
                # A failed call keeps none of what it reserved (its writes, if they landed,
                # sit in slots nobody reads and go back to the pool).
                if not committed:
                    self._cancel_writes(tenant, seq_ids)
                raise
        if self.metrics is not None:
            self.metrics.add_tokens_appended(sum(len(it.token_ids) for it in items))
            self.metrics.add_attention_tokens(sum(q.shape[0] for q in queries))
        return answer

    async def append_attend_stacked(
        self,
        tenant: str,
        layer: int,
        batch: StackedAppendAttend,
        return_lse: bool = False,
        out: torch.Tensor | None = None,
        rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        *,
        short_path: bool = True,
    ) -> AttentionResult:
        """`append_attend` of a stacked batch, as one result: out ``[b * m, Hq, D]`` in the
        query's dtype (lse ``[b * m, Hq]`` float32), sequence by sequence.

        out: host memory ``[b * m, Hq, D]`` (the query's dtype) the result may be written
        to directly (a worker in this process writes it there on the short path below;
        the result is then `out`); it may hold partial output if the call fails.
        rows: the batch's query, key and value flattened to rows (``[b * m, Hq, D]``,
        ``[b * n, Hkv, D]``, ``[b * n, Hkv, D]``), views of those very tensors, when the
        caller keeps them across a step's layers (`DecodedBatch.rows`); else made here.
        short_path: False to go the full way at once (`repeat_now`'s worker refused the
        batch's values: the full path says whose).

        The other layers of a decode step (see engine.steps) take a short path: with the
        batch's tensors already stacked, the shape checks are a few comparisons instead of
        three per sequence, and nothing is split into per-sequence items. Anything the
        short path does not accept (another batch, other tokens, a non-finite value, an
        unusual shape) goes the full way, which raises the precise error.
        """
        step = self._repeats.stacked_step(tenant, layer, batch) if short_path else None
        if step is not None:
            result = await self._repeats.repeat_step(
                tenant, layer, step, batch, return_lse, out, rows
            )
            if result is not None:
                return result
        (result,) = await self.append_attend(
            tenant, layer, batch.items(), return_lse, joined=batch.joined(), stacked=True
        )
        return result

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
        """`append_attend_stacked`'s short path without a task: for a caller that answers
        from a callback (a local session), a repeated layer's call submitted now and
        finished from its round's callback. True: taken; `finished` is called once, later,
        with the result, with the exception the call failed with (its writes cancelled),
        or with None when the round refused non-finite values (nothing written: call
        `append_attend_stacked`, whose full path names them). False: nothing changed
        (another step, a sequence's lock held, not repeatable): call
        `append_attend_stacked`.

        origin: the caller's connection (`call_origin`) for the batcher; out, rows: as in
        `append_attend_stacked`.
        """
        return self._repeats.repeat_now(
            tenant, layer, batch, return_lse, out, rows, origin, finished
        )

    async def lease_step(
        self,
        tenant: str,
        seq_ids: Sequence[str],
        num_q_heads: int,
        token_ids: Sequence[Sequence[int]] | None = None,
        connections: Mapping[str, bytes] | None = None,
        steps: int = 1,
    ) -> LeaseGrant:
        """A step lease (engine.leases): the step's layers go from the client to the worker
        directly. Without `token_ids`, on the step the batch's last append-and-attend
        planned (its unwritten layers); with them (per sequence its new tokens, at least
        one), on a step planned here for those tokens, every layer (the queries are the
        new tokens' own). Or the reason there is none (`LeaseGrant.reason`).
        `connections`: the client's lease connections (worker socket -> token): the
        lease opens at the grant for the one to its worker, and the grant carries the
        plan. `steps` (with token ids, one per sequence): decode steps the lease covers,
        at most `max_lease_steps` (the grant says how many): the positions of the later
        steps are reserved now, their tokens named by the client's report; fewer when
        the pool or quota has no room for them all.

        Raises:
            InvalidRequest: malformed arguments, or token ids other than those reserved;
            SequenceNotFound, SequenceLost, PoolExhausted, QuotaExceeded: as a write's;
            WorkerError: the worker refused the grant. Nothing is held or reserved then.
        """
        check_not_empty(seq_ids, "lease_step")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise InvalidRequest(f"steps must be a positive int, got {steps!r}")
        if (
            isinstance(num_q_heads, bool)
            or not isinstance(num_q_heads, int)
            or num_q_heads < 1
            or num_q_heads % self.layout.num_kv_heads
        ):
            raise InvalidRequest(
                f"num_q_heads must be a positive multiple of {self.layout.num_kv_heads}, "
                f"got {num_q_heads!r}"
            )
        if self.config.step_lease_timeout_s <= 0:
            return LeaseGrant("step leases are off (coordinator.step_lease_timeout_s is 0)")
        if token_ids is None:
            return await self._leases.grant(tenant, list(seq_ids), num_q_heads, connections)
        ids = list(seq_ids)
        rows = [list(t) for t in token_ids]
        if len(set(ids)) != len(ids) or len(rows) != len(ids):
            raise InvalidRequest(
                f"a planned step needs distinct sequences and token ids for each: "
                f"{len(ids)} sequence ids ({len(set(ids))} distinct), {len(rows)} token rows"
            )
        if any(len(r) < 1 for r in rows):
            raise InvalidRequest(
                f"a planned step sends at least one new token for every sequence, got "
                f"{[len(r) for r in rows]}"
            )
        if steps > 1 and any(len(r) != 1 for r in rows):
            raise InvalidRequest(
                f"a lease of {steps} steps sends one new token per sequence a step, got "
                f"{[len(r) for r in rows]}"
            )
        steps = min(steps, self.config.max_lease_steps)
        lock_order = sorted(ids)
        await self._locks.acquire(lock_order)
        try:
            try:
                step = await self._plan_step(tenant, ids, rows, steps)
            except (PoolExhausted, QuotaExceeded, InvalidRequest):
                if steps == 1:
                    raise
                # No room for every step's positions (the pool, the quota, the longest
                # sequence): the one step still may fit. A refusal of the step itself
                # comes again, as it would have.
                step = await self._plan_step(tenant, ids, rows, 1)
        except BaseException:
            self._locks.release(lock_order)
            raise
        if isinstance(step, str):
            self._locks.release(lock_order)
            return LeaseGrant(step)
        grant = await self._leases.grant_held(step, num_q_heads, connections)
        if not grant.granted:
            self._cancel_writes(tenant, ids)
        return grant

    async def _plan_step(
        self, tenant: str, seq_ids: list[str], rows: list[list[int]], steps: int
    ) -> Step | str:
        """Under the batch's locks: reserve the step's positions, and those of its
        `steps - 1` later decode steps (running any copy-on-write copies), and record it
        as a `Step` planned for a lease; or the reason it cannot be leased, with nothing
        reserved."""
        plans = self._reserve_step(tenant, seq_ids, rows, steps - 1)
        self._released.flush()
        try:
            if any(plan.copies for plan in plans):
                await run_to_completion(self._calls.run_copies_of(plans, seq_ids))
                plans = [WritePlan(p.start, p.slots, []) for p in plans]
            bs = self.layout.block_size
            views = [
                view_after_write(self.block_manager, bs, tenant, s, 0, plan)
                for s, plan in zip(seq_ids, plans, strict=True)
            ]
            worker_ids = {v.worker_id for v in views if type(v) is OneWorkerView}
            slot_workers = {w for plan in plans for w, _ in plan.slots}
            snapshot = self.block_manager.snapshot_writes(tenant, seq_ids, plans, ragged=True)
        except BaseException:
            self._cancel_writes(tenant, seq_ids)
            raise
        if (
            len(worker_ids) != 1
            or slot_workers != worker_ids
            or any(type(v) is not OneWorkerView for v in views)
            or snapshot is None
        ):
            self._cancel_writes(tenant, seq_ids)
            return "the step's sequences are not all on one worker: send its layers by call"
        (worker_id,) = worker_ids
        counts = [len(r) for r in rows]
        # With several steps: the last step's views, so that the tables hold every
        # step's blocks (the grant gives the first step's lengths).
        plan = plan_attention(views, counts, bs)
        if steps == 1:
            slots = [slot for p in plans for _, slot in p.slots]
        else:  # step by step: each step's slot of every sequence
            slots = [p.slots[i][1] for i in range(steps) for p in plans]
        step = Step(snapshot, worker_id, counts, views, slots, plan, planned_only=True, steps=steps)  # type: ignore[arg-type]
        if steps == 1:
            # A lease of several steps is never repeated by calls: its snapshot spans them.
            self._steps.put(step)
        return step

    def _reserve_step(
        self, tenant: str, seq_ids: list[str], rows: list[list[int]], ahead: int = 0
    ) -> list[WritePlan]:
        """Reserve a planned step's positions on layer 0, all or nothing.

        `prepare_writes` itself refuses token ids that differ from those another layer
        reserved (naming the position only), and reserves nothing when it refuses. So the
        items are looked up one by one (`check_reserved`) only after a refusal: the error
        is then the one a check of every item before reserving gives (it names the item,
        and comes before a full pool, say), and a step that is accepted, every decode
        step, skips a lookup per sequence that repeats what `prepare_writes` checks.
        """
        try:
            self._require_workers()
            return self.block_manager.prepare_writes(
                tenant, 0, list(zip(seq_ids, rows, strict=True)), ahead
            )
        except Exception as exc:
            refused = exc
        for i, (seq_id, tokens) in enumerate(zip(seq_ids, rows, strict=True)):
            check_reserved(i, self.block_manager.write_cursor(tenant, seq_id, 0), tokens, 0)
        raise refused

    def _planned_parts(
        self,
        tenant: str,
        layer: int,
        plans: list[WritePlan],
        queries: list[torch.Tensor],
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        seq_ids: list[str],
        spans: Spans,
        return_lse: bool,
    ) -> list[tuple[list[int], Part]]:
        """The parts of an append-and-attend whose writes were just planned: each item's
        view as it will be after its write, grouped by worker (`split_parts`)."""
        block_size = self.layout.block_size
        views = [
            view_after_write(self.block_manager, block_size, tenant, s, layer, plan)
            for s, plan in zip(seq_ids, plans, strict=True)
        ]
        return split_parts(
            self._pool_dtype, views, queries, seq_ids, return_lse, (plans, keys, values), spans
        )

    def _prepare_append(
        self, tenant: str, layer: int, items: Sequence[AppendAttendItem]
    ) -> list[WritePlan]:
        """Check every item, then reserve the positions and slots of all (all or nothing)."""
        # Per-item messages first (unknown / lost sequence, wrong token ids, too many query
        # rows); write_cursor costs O(positions reserved ahead), not O(sequence length).
        for i, it in enumerate(items):
            cursor = self.block_manager.write_cursor(tenant, it.seq_id, layer)
            check_reserved(i, cursor, it.token_ids, layer)
            if it.query.shape[0] > cursor.start + len(it.token_ids):
                raise InvalidRequest(
                    f"items[{i}]: {it.query.shape[0]} query rows but the sequence will "
                    f"hold {cursor.start + len(it.token_ids)} tokens on layer {layer}"
                )
        self._require_workers()
        # All or nothing: an item that does not fit (pool, quota) puts the earlier ones
        # back exactly as they were.
        plans = self.block_manager.prepare_writes(
            tenant, layer, [(it.seq_id, it.token_ids) for it in items]
        )
        self._released.flush()  # blocks evicted for these writes: poisoned first
        return plans

    # -- export / import -------------------------------------------------------------------

    async def export(self, tenant: str, seq_id: str) -> ExportedSequence:
        """The positions written on every layer, as whole blocks."""
        async with self._locked([seq_id]):
            info = self.block_manager.sequence_info(tenant, seq_id)
            n = min(info.written)
            bs = self.layout.block_size
            if n == 0:
                empty = torch.empty((0, *block_shape(self.layout)), dtype=self._pool_dtype)
                return ExportedSequence([], 0, empty)
            layer = info.written.index(n)
            view = self.block_manager.attention_view(tenant, seq_id, layer)
            pieces = await asyncio.gather(
                *(
                    self._calls.guarded(
                        seg.worker_id,
                        [seq_id],
                        lambda c, e, seg=seg: c.export_blocks(e, list(seg.block_indices)),
                    )
                    for seg in view.segments
                )
            )
            blocks = torch.cat(pieces, 0) if len(pieces) > 1 else pieces[0]
            expect = -(-n // bs)
            if blocks.shape[0] != expect:  # pragma: no cover - a control-plane bug
                raise RuntimeError(f"export gathered {blocks.shape[0]} blocks, expected {expect}")
            return ExportedSequence(list(info.token_ids[:n]), n, blocks)

    async def import_(
        self, tenant: str, token_ids: Sequence[int], blocks: torch.Tensor
    ) -> ImportedSequence:
        """A new sequence holding `token_ids` on every layer, K/V taken from `blocks`
        ``[ceil(n / block_size), L, 2, Hkv, block_size, D]``. Cached leading blocks are shared
        instead of written. On failure the new sequence is freed again."""
        n = len(token_ids)
        bs = self.layout.block_size
        check_tensor("blocks", blocks, (-(-n // bs), *block_shape(self.layout)))
        self._require_workers()
        created = self.block_manager.create_sequence(tenant, token_ids)
        try:
            cached = created.num_cached_tokens
            if n > cached:
                tail = list(token_ids[cached:])
                async with self._locked([created.seq_id]):
                    key, value = blocks_to_tokens(blocks, n)
                    key = key[:, cached:n].to(self._pool_dtype)
                    value = value[:, cached:n].to(self._pool_dtype)
                    plan = self.block_manager.prepare_write(tenant, created.seq_id, None, tail)
                    self._released.flush()  # blocks evicted for this write: poisoned first
                    await run_to_completion(
                        self._calls.write_planned(plan, None, key, value, created.seq_id)
                    )
                    self.block_manager.commit_write(tenant, created.seq_id, None, len(tail))
        except BaseException:
            with contextlib.suppress(Exception):
                self.block_manager.free(tenant, created.seq_id)
                self._released.flush()
            raise
        if self.metrics is not None and n > cached:
            self.metrics.add_tokens_appended((n - cached) * self.layout.num_layers)
        return ImportedSequence(created.seq_id, cached, n)

    # -- internals: validation -------------------------------------------------------------

    def _require_workers(self) -> None:
        """Refuse with UNAVAILABLE while no worker is serving."""
        if not self.block_manager.workers():
            known = len(self._states)
            raise ServiceUnavailable(
                f"no worker is serving ({known} known, none up): retry when they are back"
            )

    # -- internals: locking ----------------------------------------------------------------

    def _locked(self, seq_ids: Sequence[str]) -> contextlib.AbstractAsyncContextManager[None]:
        # Sorted, so two calls locking overlapping sets cannot deadlock.
        return self._locks.holding(sorted(set(seq_ids)))

    def _cancel_writes(self, tenant: str, seq_ids: Sequence[str]) -> None:
        """Release what a failed call reserved on these sequences and not committed.

        Last item first: the blocks go back to the free lists in the reverse order of their
        allocation, so (barring copy-on-write copies and evictions, which cannot be undone
        once they ran) the next allocations are the ones the failed call never happened to.
        """
        self._checks.writes_cancelled(seq_ids)
        for seq_id in reversed(seq_ids):
            try:
                self.block_manager.cancel_write(tenant, seq_id)
            except (CacheError, StoreError):
                # Lost with its worker (nothing left to release), or the store failed
                # (the coordinator must restart; recovery cancels it then).
                continue
        self._released.flush()


# ------------------------------------------------------------------------------ helpers


def _block_manager_config(layout: KVLayout, config: CoordinatorConfig) -> BlockManagerConfig:
    """The control plane's configuration for workers of `layout`."""
    return BlockManagerConfig(
        block_size=layout.block_size,
        num_layers=layout.num_layers,
        layout_fingerprint=layout.fingerprint(),
        tenant_quota_blocks=config.tenant_quota_blocks,
        eviction_policy=config.eviction_policy,
    )


def _correctness_checker(
    config: CoordinatorConfig, pool_dtype: torch.dtype, metrics: Any
) -> CorrectnessChecker | None:
    """The online correctness check the config asks for; None when off (fraction 0)."""
    fraction = config.correctness_check_fraction
    if fraction <= 0:
        return None
    return CorrectnessChecker(
        fraction, pool_dtype, metrics, sequences=config.correctness_check_sequences
    )


# The most sequences one CreateSequences / FreeSequences call names.
MAX_BATCH_ITEMS = 4096


def _item_error(exc: CacheError, item: str) -> CacheError:
    """`exc` again, its message prefixed with the batch item it is about (its class, so
    its status, unchanged)."""
    try:
        return type(exc)(f"{item}: {exc}")
    except TypeError:  # a class whose constructor takes more than the message
        return exc
