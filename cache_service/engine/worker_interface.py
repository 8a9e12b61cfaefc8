"""The coordinator's view of a worker: the async ``WorkerClient`` protocol.

The coordinator talks to workers only through this protocol, so its logic runs in tests
with in-process workers (``worker_clients.LocalWorkerClient``) and in production with Ray
actors (``worker_clients.RayWorkerClient``). Tensors cross as torch tensors on the host.

Every data method takes the worker epoch the caller expects first (from :meth:`describe`);
a worker that restarted since has a new epoch and an empty pool, and refuses the call.

Errors (all :class:`workers.errors.WorkerError`):

* ``StaleEpochError`` - the epoch differs: the worker restarted, its blocks are gone.
* ``InvalidWorkerRequest`` (also a ``ValueError``) - an argument does not fit the pool
  (named in the message); nothing was written.
* ``WorkerUnavailable`` - the worker died, is restarting or timed out.
* ``StaleCoordinatorError`` - a newer coordinator generation claimed the worker (clients
  with an optional ``claim(generation)`` send theirs with every call); nothing was done.
* ``WorkerError`` - anything else the worker raised (e.g. a device error).

Pure: no torch, Ray or gRPC import at run time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from workers.description import WorkerDescription, WorkerHealth
    from workers.round import Round
    from workers.step_leases import LeaseReport

__all__ = ["AttentionResult", "WorkerClient"]


class AttentionResult(NamedTuple):
    """One worker's attention output.

    Attributes:
        out: ``[T, Hq, D]`` in the pool's dtype, on the host; or, for a round that gave
            its output's memory in parts (`Round.out`) and had it delivered there, that
            list of parts, rows in order.
        lse: float32 ``[T, Hq]`` natural-log softmax denominators when asked for (-inf for
            a row that saw no key), else None.
    """

    out: torch.Tensor | list[torch.Tensor]
    lse: torch.Tensor | None


@runtime_checkable
class WorkerClient(Protocol):
    """Async access to one worker's pool. Argument meanings follow ``workers.pool.KVPool``."""

    @property
    def worker_id(self) -> str:
        """The worker's stable id (its actor name)."""
        ...

    @property
    def out_of_process(self) -> bool:
        """Whether the worker's calls run in another process (a Ray actor), leaving the
        caller's event loop free meanwhile."""
        ...

    async def describe(self) -> WorkerDescription:
        """Identity, current epoch, capacity and layout."""
        ...

    async def health(self) -> WorkerHealth:
        """A liveness probe (raises WorkerUnavailable when the worker cannot answer)."""
        ...

    async def write(
        self,
        epoch: str,
        layer: int | None,
        slot_mapping: torch.Tensor | Sequence[int],
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> None:
        """Write K/V ``[n, Hkv, D]`` (``[L, n, Hkv, D]`` for layer None) to flat slots."""
        ...

    async def run_round(self, round: Round) -> AttentionResult:
        """One worker call of an attention round (``workers.round.Round``; the worker's
        ``KVPool.run_round``): the round's write, if any, then its attention, both
        validated before the write, under the epoch `round.epoch`.

        The worker picks how to run it (one layer, or pages of every layer) and keeps the
        round's metadata under its step key for the step's later rounds. `round.out`:
        host memory for the output (one part per query part for a round in parts); a
        client that can deliver there does (the result's ``out`` is then `round.out`),
        others return the output. With ``check_finite`` the worker refuses a NaN or
        infinity with workers.errors.NonFiniteInput, writing nothing.
        """
        ...

    async def copy_blocks(
        self, epoch: str, src: torch.Tensor | Sequence[int], dst: torch.Tensor | Sequence[int]
    ) -> None:
        """Copy whole blocks (all layers) ``src[i] -> dst[i]`` (copy-on-write)."""
        ...

    async def export_blocks(
        self, epoch: str, block_ids: torch.Tensor | Sequence[int]
    ) -> torch.Tensor:
        """Copies of the blocks, ``[n, L, 2, Hkv, block_size, D]`` on the host."""
        ...

    async def import_blocks(
        self, epoch: str, block_ids: torch.Tensor | Sequence[int], data: torch.Tensor
    ) -> None:
        """Overwrite the (distinct) blocks with exported data of the same layout."""
        ...

    async def release_blocks(self, epoch: str, block_ids: torch.Tensor | Sequence[int]) -> None:
        """The blocks are free again (poisoned with NaN in debug mode)."""
        ...

    async def offload_blocks(
        self, epoch: str, block_ids: Sequence[int], host_ids: Sequence[int]
    ) -> int:
        """Copy blocks ``block_ids[i]`` (all layers) to the worker's host tier blocks
        ``host_ids[i]`` (workers.host_tier) in one batched copy; returns bytes copied."""
        ...

    async def restore_blocks(
        self, epoch: str, host_ids: Sequence[int], block_ids: Sequence[int]
    ) -> int:
        """Copy host tier blocks ``host_ids[i]`` into blocks ``block_ids[i]`` in one
        batched copy, complete before any later call reads them; returns bytes copied."""
        ...

    async def lease_socket(self) -> str:
        """The worker's lease socket (a Unix socket path on its host; started on the first
        call): co-located clients map the pool and run leased steps through it
        (workers.lease_server)."""
        ...

    async def grant_lease(
        self,
        epoch: str,
        lease_id: bytes,
        layers: Sequence[int],
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        slot_mapping: Sequence[int],
        num_q_heads: int,
        connection: bytes | None = None,
        steps: int = 1,
    ) -> bytes | None:
        """Let `lease_id`'s client write and attend `layers` of a planned step (its
        metadata and slots as a round carries them), each layer once, until
        :meth:`end_lease` (workers.step_leases). `connection`: the client's lease
        connection token; when it names a live connection the lease opens for it now and
        the packed plan is returned (else None). `steps`: decode steps the lease covers
        (the first step's lengths, every step's slots: `StepPlan`)."""
        ...

    async def end_lease(self, epoch: str, lease_id: bytes) -> LeaseReport | None:
        """End a lease without waiting: which layers it wrote and which it refused
        (non-finite inputs, nothing written); None while its client still runs it (then
        :meth:`wait_lease`)."""
        ...

    async def wait_lease(self, epoch: str, lease_id: bytes, timeout_s: float) -> LeaseReport:
        """End a lease once its client reports, waiting up to `timeout_s` (then the lease
        is revoked and counts as writing nothing)."""
        ...
