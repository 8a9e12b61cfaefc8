"""Step leases, the coordinator's side: a planned step handed to a co-located client.

A co-located client's step goes through the coordinator once: the coordinator plans it
(`steps.Step`), either for the new token ids the client names (`Coordinator.lease_step`
reserves their positions, as a first layer's call would) or as the batch's last
append-and-attend planned it (`Leases.grant`). It takes the step's sequences' locks,
grants the worker's lease on the step's unwritten layers under a fresh random id
(`workers.step_leases`), and answers with the id and the worker's lease socket, and with
the step's plan when the request named the client's connection to that socket (the
worker opened the lease for it at the grant). The client, which has mapped the worker's
pool, runs those layers itself (`workers.lease_client`), without this process.

A lease may cover several decode steps (`Coordinator.lease_step`'s `steps`: one new token
per sequence a step): the step's positions and those of the later steps are reserved at
once, the later ones with their tokens to come (`BlockManager.prepare_writes`' `ahead`),
the plan carries every step's slots, and the client runs the steps between forwards
without this process. Its report names the steps it ran and their tokens; ending the
lease names them (`fill_pending`), commits the steps run (`commit_steps`) and gives the
positions of the others back.

The lease keeps the sequences' locks until it ends, so nothing else reads or changes them
meanwhile. It ends when anyone waits for one of its sequences (the client's next call
included: `SequenceLocks.on_contended`), at its timeout, or when the coordinator closes.
Ending asks the worker which layers the client reported writing (a lease its client is
running is waited for, up to the timeout again, then revoked), commits exactly those
(`BlockManager.commit_repeated_layers`: each as the coordinator's own repeated layers
commit, all in one go), then gives the locks back. A layer the lease did not write stays
unwritten: the client sends it by call, or its next step's calls find the sequence short
on that layer and are refused.
A worker that cannot be reached at the end commits nothing; its failure handling (a lost
worker's sequences answer DATA_LOSS) is the coordinator's usual one.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cache_service.engine.sequence_locks import SequenceLocks
from cache_service.engine.steps import Step, StepCache
from cache_service.engine.worker_interface import WorkerClient
from workers.errors import WorkerError
from workers.step_leases import LeaseReport

if TYPE_CHECKING:
    from cache_service.engine.coordinator import Coordinator

__all__ = ["LeaseGrant", "Leases"]

log = logging.getLogger("kvcache.leases")


@dataclass(frozen=True)
class LeaseGrant:
    """The answer to a lease request.

    Attributes:
        reason: why no lease was granted ("" when granted).
        lease_id: the lease's 16 random bytes (empty when refused).
        socket: the worker's lease socket.
        layers: the layers the lease may write.
        timeout_s: the lease ends this long after the grant at the latest.
        plan: the packed step plan when the lease was opened at the grant for the
            client's connection (`workers.step_leases.StepPlan.pack`); empty otherwise.
        steps: decode steps the lease covers.
    """

    reason: str = ""
    lease_id: bytes = b""
    socket: str = ""
    layers: tuple[int, ...] = ()
    timeout_s: float = 0.0
    plan: bytes = b""
    steps: int = 1

    @property
    def granted(self) -> bool:
        return not self.reason


@dataclass(eq=False)
class _Lease:
    lease_id: bytes
    step: Step
    epoch: str
    client: WorkerClient
    ending: asyncio.Task[None] | None = None
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)


class Leases:
    """The coordinator's step leases.

    Args:
        owner: the coordinator (its `block_manager` and `metrics` are read at each use:
            recovery replaces the block manager).
        locks: the coordinator's sequence locks (their `on_contended` is set here).
        steps: the recorded steps.
        clients, epochs: worker id -> client / epoch of every registered worker (the
            coordinator's dicts).
        timeout_s: the longest a lease lives before it is recalled; a lease its client is
            running when recalled is waited for this long again, then revoked.
        cancel_writes: releases positions reserved and never written (tenant, sequence ids).
    """

    def __init__(
        self,
        owner: Coordinator,
        locks: SequenceLocks,
        steps: StepCache,
        clients: Mapping[str, WorkerClient],
        epochs: Mapping[str, str],
        timeout_s: float,
        cancel_writes: Callable[[str, Sequence[str]], None],
    ) -> None:
        self._owner = owner
        self._cancel_writes = cancel_writes
        self._locks = locks
        self._steps = steps
        self._clients = clients
        self._epochs = epochs
        self._timeout_s = timeout_s
        self._by_seq: dict[str, _Lease] = {}
        self._sockets: dict[tuple[str, str], str] = {}
        locks.on_contended = self.recall

    def __len__(self) -> int:
        return len({id(lease) for lease in self._by_seq.values()})

    async def grant(
        self,
        tenant: str,
        seq_ids: list[str],
        num_q_heads: int,
        connections: Mapping[str, bytes] | None = None,
    ) -> LeaseGrant:
        """A lease on the step the batch's last call planned (see the module docstring),
        or the reason there is none (`connections`: as `grant_held` takes them). Raises
        what the worker's grant raises (WorkerError) with nothing held."""
        step = self._steps.get(tenant, tuple(seq_ids))
        if step is None:
            return LeaseGrant(
                "no planned step for this batch: its last call was not an append-and-attend "
                "of these sequences, in this order, planned on one worker"
            )
        await self._locks.acquire(step.lock_order)
        if self._steps.get(tenant, tuple(seq_ids)) is not step:
            self._locks.release(step.lock_order)
            return LeaseGrant("the batch's step changed meanwhile")
        return await self.grant_held(step, num_q_heads, connections)

    async def grant_held(
        self, step: Step, num_q_heads: int, connections: Mapping[str, bytes] | None = None
    ) -> LeaseGrant:
        """A lease on `step`, whose sequences' locks the caller holds and hands over: the
        lease keeps them, or (no lease: the reason says why; or an exception) they are
        released here. `connections`: the client's lease connections (socket -> token);
        the one to the step's worker, if any, gets the lease opened at the grant."""
        try:
            plan = step.plan
            if plan is None or len(plan.batches) != 1 or plan.needs_merge:
                self._locks.release(step.lock_order)
                return LeaseGrant("the step's attention is not one worker's single batch")
            worker_id = step.worker_id
            epoch = self._epochs.get(worker_id)
            client = self._clients.get(worker_id)
            layers = self._owner.block_manager.repeatable_layers(step.snapshot)
            if epoch is None or client is None or not layers:
                self._locks.release(step.lock_order)
                if not layers:
                    return LeaseGrant("every layer of the step is written (or it changed)")
                return LeaseGrant(f"worker {worker_id!r} of the step is not serving")
            socket = await self._socket(worker_id, epoch, client)
            lease_id = secrets.token_bytes(16)
            tables, lens, starts = plan.batches[0].metadata_args()
            if step.steps > 1:
                lens = lens - (step.steps - 1)  # the plan is the last step's
            token = (connections or {}).get(socket)
            plan = await client.grant_lease(
                epoch,
                lease_id,
                layers,
                tables,
                lens,
                starts,
                step.slots,
                num_q_heads,
                token,
                step.steps,
            )
        except BaseException:
            self._locks.release(step.lock_order)
            raise
        lease = _Lease(lease_id, step, epoch, client)
        for seq_id in step.lock_order:
            self._by_seq[seq_id] = lease
        lease.timer = asyncio.get_running_loop().call_later(self._timeout_s, self._end_soon, lease)
        if self._owner.metrics is not None:
            self._owner.metrics.add_step_lease("granted")
        return LeaseGrant(
            "", lease_id, socket, tuple(layers), self._timeout_s, plan or b"", step.steps
        )

    def recall(self, seq_id: str) -> None:
        """Someone waits for `seq_id`: end the lease holding it, if any (its locks then go
        to the waiters)."""
        lease = self._by_seq.get(seq_id)
        if lease is not None:
            self._end_soon(lease)

    async def end_all(self) -> None:
        """End every lease (the coordinator closes)."""
        leases = {id(lease): lease for lease in self._by_seq.values()}.values()
        for lease in list(leases):
            self._end_soon(lease)
        ending = [lease.ending for lease in leases if lease.ending is not None]
        if ending:
            await asyncio.gather(*ending, return_exceptions=True)

    def _end_soon(self, lease: _Lease) -> None:
        if lease.ending is None:
            lease.ending = asyncio.get_running_loop().create_task(self._end(lease))

    async def _end(self, lease: _Lease) -> None:
        """Ask the worker what the lease wrote, commit that, give the locks back."""
        step = lease.step
        if lease.timer is not None:
            lease.timer.cancel()
        layer_writes = 0
        try:
            report = await lease.client.end_lease(lease.epoch, lease.lease_id)
            if report is None:
                # Its client runs the step: the report comes at the forward's end (a
                # thread of the worker waits; this loop does not).
                report = await lease.client.wait_lease(lease.epoch, lease.lease_id, self._timeout_s)
            written = report.written
            layer_writes = len(written)
            if step.steps > 1:
                layer_writes = self._commit_steps(step, report)
            elif written:
                # In one call: with a write-ahead log, one commit (one fsync) for them all.
                self._owner.block_manager.commit_repeated_layers(step.snapshot, written)
            elif step.planned_only:
                # A step planned for the lease and never written on any layer: its
                # positions go back, as a failed call's would.
                self._cancel_writes(step.snapshot.tenant, list(step.snapshot.seq_ids))
        except WorkerError as exc:
            # Nothing committed: the layers stay unwritten. A lost worker is found and
            # handled by the coordinator's health checks.
            log.warning("ending a step lease on worker %s failed: %s", step.worker_id, exc)
            self._drop_pending(step)
        except Exception:
            log.exception("ending a step lease failed")
            self._drop_pending(step)
        finally:
            for seq_id in step.lock_order:
                if self._by_seq.get(seq_id) is lease:
                    del self._by_seq[seq_id]
            self._locks.release(step.lock_order)
        metrics = self._owner.metrics
        if metrics is not None:
            metrics.add_step_lease("ended")
            if layer_writes:
                # A multi-step lease's snapshot counts every step's positions.
                tokens = step.snapshot.counts if step.steps == 1 else step.num_queries
                metrics.add_tokens_appended(sum(tokens) * layer_writes)
                metrics.add_attention_tokens(sum(step.num_queries) * layer_writes)
                metrics.add_leased_layers(layer_writes)

    def _commit_steps(self, step: Step, report: LeaseReport) -> int:
        """A multi-step lease's report committed: the later steps' tokens named, the
        steps before the last on every layer and the last on its written layers, then
        whatever was reserved past them given back. Returns the layer writes committed
        per sequence (a step on every layer counts the number of layers)."""
        snapshot = step.snapshot
        manager = self._owner.block_manager
        num_layers = self._owner.layout.num_layers
        every = len(report.written) == num_layers
        full = report.steps if every else report.steps - 1
        partial = () if every else report.written
        seq_ids = snapshot.seq_ids
        if report.steps > 1:
            rows = len(seq_ids)
            fills = [
                (seq_id, start + 1, report.tokens[i::rows])
                for i, (seq_id, start) in enumerate(zip(seq_ids, snapshot.starts, strict=True))
            ]
            manager.fill_pending(snapshot.tenant, fills)
        manager.commit_steps(snapshot, full, partial)
        self._cancel_writes(snapshot.tenant, list(seq_ids))
        return full * num_layers + len(partial)

    def _drop_pending(self, step: Step) -> None:
        """After a multi-step lease's end failed, nothing committed: its positions
        reserved ahead go back (tokens never named cannot stay reserved)."""
        if step.steps > 1:
            self._cancel_writes(step.snapshot.tenant, list(step.snapshot.seq_ids))

    async def _socket(self, worker_id: str, epoch: str, client: WorkerClient) -> str:
        """The worker's lease socket, asked once per worker epoch."""
        path = self._sockets.get((worker_id, epoch))
        if path is None:
            path = await client.lease_socket()
            self._sockets[(worker_id, epoch)] = path
        return path
