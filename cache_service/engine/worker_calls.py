"""The coordinator's worker calls outside attention rounds: copy-on-write copies, K/V
writes of append and import, block exports. Each runs with the worker's current epoch;
a worker found lost or restarted becomes `WorkerLost` for the call's sequences."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

import torch

from cache_service.control.types import WritePlan
from cache_service.engine.call_tensors import group_slots
from cache_service.engine.rounds import WorkerFailed
from cache_service.engine.worker_interface import WorkerClient
from cache_service.errors import SequenceLost
from workers.errors import StaleEpochError, WorkerUnavailable

__all__ = ["WorkerCalls"]


class WorkerCalls:
    """Guarded single-worker calls of one coordinator.

    Args:
        clients: worker id -> client (the coordinator's dict).
        epochs: worker id -> epoch of every registered worker (the coordinator's dict).
        metrics: a `ServiceMetrics` to feed, or None.
        released_before_use: waits for block releases pending on those workers.
        worker_failed: drops a failed worker (`engine.membership`).
    """

    def __init__(
        self,
        clients: Mapping[str, WorkerClient],
        epochs: Mapping[str, str],
        metrics: Any,
        released_before_use: Callable[[Iterable[str]], Awaitable[None]],
        worker_failed: WorkerFailed,
    ) -> None:
        self._clients = clients
        self._epochs = epochs
        self._metrics = metrics
        self._released_before_use = released_before_use
        self._worker_failed = worker_failed

    async def run_copies(self, plan: WritePlan, seq_ids: list[str]) -> None:
        """Run one write plan's copy-on-write copies (`seq_ids`: whose, for WorkerLost)."""
        await self.run_copies_of([plan], seq_ids)

    async def run_copies_of(self, plans: list[WritePlan], seq_ids: list[str]) -> None:
        """Run the copy-on-write copies of several write plans: one call per worker."""
        by_worker: dict[str, tuple[list[int], list[int]]] = {}
        for plan in plans:
            for c in plan.copies:
                src, dst = by_worker.setdefault(c.worker_id, ([], []))
                src.append(c.src)
                dst.append(c.dst)
        await asyncio.gather(
            *(
                self.guarded(w, seq_ids, lambda cl, e, s=s, d=d: cl.copy_blocks(e, s, d))
                for w, (s, d) in by_worker.items()
            )
        )

    async def write_planned(
        self,
        plan: WritePlan,
        layer: int | None,
        key: torch.Tensor,
        value: torch.Tensor,
        seq_id: str,
    ) -> None:
        """Carry out a planned write of one sequence: its copy-on-write copies, then its
        new tokens' key / value (pool dtype, token rows on dim -3: ``[n, Hkv, D]`` for one
        layer, ``[L, n, Hkv, D]`` for layer None) on each worker holding its slots."""
        await self.run_copies(plan, [seq_id])
        calls = []
        for worker_id, (rows, slots) in group_slots(plan.slots).items():
            idx = torch.tensor(rows, dtype=torch.long)
            k = key.index_select(-3, idx)
            v = value.index_select(-3, idx)
            calls.append(self.write_on(worker_id, layer, slots, k, v, [seq_id]))
        await asyncio.gather(*calls)

    async def write_on(
        self,
        worker_id: str,
        layer: int | None,
        slots: list[int],
        key: torch.Tensor,
        value: torch.Tensor,
        seq_ids: list[str],
    ) -> None:
        """Write K/V rows (pool dtype) into `slots` of one worker's pool on `layer` (None:
        every layer), timed in the metrics."""
        t0 = time.perf_counter()
        await self.guarded(worker_id, seq_ids, lambda c, e: c.write(e, layer, slots, key, value))
        if self._metrics is not None:
            self._metrics.observe_worker_call(worker_id, 1, time.perf_counter() - t0)

    async def guarded(
        self,
        worker_id: str,
        seq_ids: list[str],
        call: Callable[[WorkerClient, str], Awaitable[Any]],
    ) -> Any:
        """Run one worker call with the current epoch; a lost worker becomes WorkerLost."""
        await self._released_before_use([worker_id])
        epoch = self._epochs.get(worker_id)
        if epoch is None:
            raise SequenceLost(
                f"worker {worker_id!r} holding blocks of this call was lost; free the "
                "sequences and recompute"
            )
        try:
            return await call(self._clients[worker_id], epoch)
        except (StaleEpochError, WorkerUnavailable) as exc:
            raise await self._worker_failed(exc, {worker_id: epoch}, seq_ids) from None
