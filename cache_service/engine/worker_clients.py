"""The two implementations of :class:`~cache_service.engine.worker_interface.WorkerClient`.

* :class:`RayWorkerClient` - a ``workers.actor.PoolWorker`` Ray actor handle; calls are
  ``await handle.method.remote(...)`` and Ray errors become ``workers.errors`` exceptions.
  With channel options, the per-layer data calls go over a worker channel instead
  (``cache_service.wire.worker_channel``: a Unix socket and shared memory on the worker's node,
  TCP from another; a fraction of a Ray call's cost); everything else, and every call the
  channel declines, goes through Ray.
* :class:`LocalWorkerClient` - a ``PoolWorker`` in this process (the embedded default and
  the coordinator's tests), run on one private thread so calls are serialised like an
  actor's and the event loop is not blocked.

:func:`transfer_blocks` copies blocks between two workers; between Ray workers the data goes
through the object store, never through the caller.

Tensors sent to a Ray worker are packed with :mod:`workers.transport` (raw bytes as numpy
arrays: out-of-band and zero-copy through the object store, where torch tensors would be
pickled in-band with copies); the actor packs its results the same way.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import torch

from cache_service.engine.worker_interface import AttentionResult, WorkerClient
from cache_service.wire.worker_channel import CHANNEL_METHODS, ChannelOptions, ChannelPool
from workers.actor import PoolWorker
from workers.config import PoolConfig
from workers.description import FencedEpoch, WorkerDescription, WorkerHealth
from workers.errors import WorkerError, WorkerUnavailable
from workers.fingerprints import BadSlot
from workers.round import Round
from workers.step_leases import LeaseReport
from workers.transport import pack

__all__ = ["LocalWorkerClient", "RayWorkerClient", "transfer_blocks"]

IndexLike = torch.Tensor | Sequence[int]


def _wire(value: Any) -> Any:
    """A tensor argument for a Ray call, packed (the actor only reads its inputs, so it may
    view the object store's buffer), a round with its tensors packed and without its
    output (a Ray worker cannot deliver into the caller's memory); anything else (lists,
    ObjectRefs, None) as it is."""
    if isinstance(value, torch.Tensor):
        return pack(value, readonly=True)
    if type(value) is Round:
        return replace(value, out=None).with_tensors(_wire)
    return value


def _channel_form(
    method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
    """A data call as the worker channel sends it: ``(args, kwargs, out)``. A round goes
    as its epoch then its fields (`Round.wire_fields`), its step key as the keyword the
    channel keys its repeats on, its output memory aside (the channel places it)."""
    if method != "run_round":
        return args, kwargs, None
    epoch, round = args
    return (epoch, *round.wire_fields()), {"step_key": round.step_key}, round.out


def _attention_result(value: Any, return_lse: bool) -> AttentionResult:
    if return_lse:
        out, lse = value
        return AttentionResult(out, lse)
    return AttentionResult(value, None)


class _WorkerClientBase:
    """The :class:`~cache_service.engine.worker_interface.WorkerClient` methods, each building its
    ``workers.actor.PoolWorker`` call once; a subclass runs the call with :meth:`_invoke`."""

    _worker_id: str
    # The coordinator generation this client claimed its worker with (claim()); None:
    # unfenced. Sent with every data call inside the epoch argument (_fenced).
    _generation: int | None = None
    # Whether the client can deliver an output into the caller's host tensor `out` (a
    # worker in this process; a Ray worker over its channel). Otherwise `out` is not sent.
    _accepts_out = False
    # Told (worker_id, path) at every per-layer data call (observe_data_calls).
    _on_data_call: Callable[[str, str], None] | None = None

    # Whether the worker's calls run in another process (WorkerClient.out_of_process).
    out_of_process = False

    @property
    def worker_id(self) -> str:
        return self._worker_id

    def observe_data_calls(self, fn: Callable[[str, str], None] | None) -> None:
        """Call ``fn(worker_id, path)`` at every per-layer data call (write, attention),
        ``path`` the way it went: "in_process", "channel" or "ray" (the service counts
        them: ``kvcache_worker_data_calls_total``). None: stop."""
        self._on_data_call = fn

    @property
    def generation(self) -> int | None:
        """The coordinator generation this client's calls carry (None: unfenced)."""
        return self._generation

    def _fenced(self, epoch: str) -> str | FencedEpoch:
        """The epoch argument of a data call: with this client's generation, if it has one
        (``workers.actor.PoolWorker`` refuses it once a higher generation claimed the
        worker)."""
        if self._generation is None:
            return epoch
        return FencedEpoch(epoch, self._generation)

    async def claim(self, generation: int) -> WorkerDescription:
        """Claim the worker for coordinator ``generation`` and send it with every later
        data call of this client; returns the worker's description.

        Raises:
            StaleCoordinatorError: a higher generation already claimed the worker (this
                coordinator was superseded). The client keeps the refused generation, so
                its later data calls are refused too (fail closed).
        """
        self._generation = generation
        return await self._invoke("claim", generation)

    async def _invoke(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """The result of ``PoolWorker.<method>(*args, **kwargs)`` on this client's worker."""
        raise NotImplementedError

    async def describe(self) -> WorkerDescription:
        return await self._invoke("describe")

    async def health(self) -> WorkerHealth:
        return await self._invoke("health")

    async def write(
        self,
        epoch: str,
        layer: int | None,
        slot_mapping: IndexLike,
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> None:
        await self._invoke("write", self._fenced(epoch), layer, slot_mapping, key, value)

    async def run_round(self, round: Round) -> AttentionResult:
        if round.out is not None and not self._accepts_out:
            round = replace(round, out=None)
        value = await self._invoke("run_round", self._fenced(round.epoch), round)
        options = round.options
        return _attention_result(value, options is not None and options.return_lse)

    async def reference_attend(
        self,
        epoch: str,
        layer: int,
        query: torch.Tensor,
        block_tables: torch.Tensor | Sequence[Sequence[int]],
        seq_lens: IndexLike,
        query_start_loc: IndexLike,
        *,
        causal: bool = True,
        return_lse: bool = False,
        scale: float | None = None,
        softcap: float | None = None,
        sliding_window: int | None = None,
    ) -> tuple[AttentionResult, list[BadSlot]]:
        """The torch reference of :meth:`attend` over the same blocks, and the slots whose
        data no longer matches its write-time fingerprint (online correctness check)."""
        batch = (query, block_tables, seq_lens, query_start_loc, causal, return_lse)
        options = {"scale": scale, "softcap": softcap, "sliding_window": sliding_window}
        out, lse, bad = await self._invoke(
            "reference_attend", self._fenced(epoch), layer, *batch, **options
        )
        return AttentionResult(out, lse), bad

    async def copy_blocks(self, epoch: str, src: IndexLike, dst: IndexLike) -> None:
        await self._invoke("copy_blocks", self._fenced(epoch), src, dst)

    async def export_blocks(self, epoch: str, block_ids: IndexLike) -> torch.Tensor:
        return await self._invoke("export_blocks", self._fenced(epoch), block_ids)

    async def import_blocks(self, epoch: str, block_ids: IndexLike, data: Any) -> None:
        """``data``: exported blocks (for a Ray worker also the ObjectRef of another Ray
        worker's export)."""
        await self._invoke("import_blocks", self._fenced(epoch), block_ids, data)

    async def release_blocks(self, epoch: str, block_ids: IndexLike) -> None:
        await self._invoke("release_blocks", self._fenced(epoch), block_ids)

    async def offload_blocks(self, epoch: str, block_ids: IndexLike, host_ids: IndexLike) -> int:
        return await self._invoke("offload_blocks", self._fenced(epoch), block_ids, host_ids)

    async def restore_blocks(self, epoch: str, host_ids: IndexLike, block_ids: IndexLike) -> int:
        return await self._invoke("restore_blocks", self._fenced(epoch), host_ids, block_ids)

    async def lease_socket(self) -> str:
        return await self._invoke("lease_socket")

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
        step = (
            block_tables,
            seq_lens,
            query_start_loc,
            slot_mapping,
            num_q_heads,
            connection,
            steps,
        )
        return await self._invoke("grant_lease", self._fenced(epoch), lease_id, layers, *step)

    async def end_lease(self, epoch: str, lease_id: bytes) -> LeaseReport | None:
        return await self._invoke("end_lease", self._fenced(epoch), lease_id)

    async def wait_lease(self, epoch: str, lease_id: bytes, timeout_s: float) -> LeaseReport:
        return await self._invoke("wait_lease", self._fenced(epoch), lease_id, timeout_s)


class RayWorkerClient(_WorkerClientBase):
    """A PoolWorker actor behind the async worker interface.

    Args:
        worker_id: the worker's id (its actor name).
        handle: the actor handle (``workers.launcher.launch_workers`` / ``attach_workers``).
        call_timeout_s: a call taking longer raises WorkerUnavailable (None: wait forever).
        channel: send the worker's per-layer data calls over worker channels (None: every
            call through Ray).
    """

    # `out` is delivered by the channel, and dropped from a call that goes through Ray.
    _accepts_out = True
    out_of_process = True

    def __init__(
        self,
        worker_id: str,
        handle: Any,
        *,
        call_timeout_s: float | None = None,
        channel: ChannelOptions | None = None,
    ):
        self._worker_id = worker_id
        self._handle = handle
        self._timeout = call_timeout_s
        self._channels: ChannelPool | None = None
        self._ray_data_calls = 0
        self._last_path = ""
        if channel is not None:
            self._channels = ChannelPool(
                worker_id, channel, self._channel_address, _local_node(), call_timeout_s
            )

    @classmethod
    async def connect(
        cls,
        handle: Any,
        *,
        call_timeout_s: float | None = None,
        channel: ChannelOptions | None = None,
    ) -> RayWorkerClient:
        """A client for ``handle``, learning the worker id from the worker itself."""
        worker_id = (await cls("?", handle, call_timeout_s=call_timeout_s).describe()).worker_id
        return cls(worker_id, handle, call_timeout_s=call_timeout_s, channel=channel)

    @property
    def data_path(self) -> str:
        """How the last per-layer call reached the worker: "channel_unix" or "channel_tcp"
        (a worker channel), "ray" (a Ray actor call); "" before the first."""
        return self._last_path

    @property
    def channel_calls(self) -> int:
        """Per-layer data calls the worker channel answered so far."""
        return 0 if self._channels is None else self._channels.calls

    @property
    def channel_repeats(self) -> int:
        """Of the channel's calls, those sent as repeats of the connection's last call (a
        decode step's other layers: see cache_service.wire.worker_channel)."""
        return 0 if self._channels is None else self._channels.repeats

    @property
    def ray_data_calls(self) -> int:
        """Per-layer data calls that went through Ray (no channel, or the channel declined)."""
        return self._ray_data_calls

    def close(self) -> None:
        """Close the worker channels (the actor is left running)."""
        if self._channels is not None:
            self._channels.close()

    async def _channel_address(self, tcp: bool) -> Any:
        return await self.resolve(self._handle.channel_address.remote(tcp))

    @property
    def handle(self) -> Any:
        """The actor handle."""
        return self._handle

    def submit(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Submit ``method`` without waiting: the ObjectRef of its result. Passing that ref
        to another actor call hands the result over inside Ray. Tensor arguments are packed
        for the trip (:mod:`workers.transport`)."""
        args = tuple(_wire(a) for a in args)
        kwargs = {k: _wire(v) for k, v in kwargs.items()}
        return getattr(self._handle, method).remote(*args, **kwargs)

    async def _invoke(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if method not in CHANNEL_METHODS:
            return await self.resolve(self.submit(method, *args, **kwargs))
        if self._channels is not None:
            path, value = await self._channels.call(method, *_channel_form(method, args, kwargs))
            if path is not None:
                self._last_path = path
                if self._on_data_call is not None:
                    self._on_data_call(self._worker_id, "channel")
                return value
        self._ray_data_calls += 1
        self._last_path = "ray"
        if self._on_data_call is not None:
            self._on_data_call(self._worker_id, "ray")
        return await self.resolve(self.submit(method, *args, **kwargs))

    async def resolve(self, ref: Any) -> Any:
        """Await an ObjectRef of this worker, translating Ray's errors.

        Raises:
            WorkerError: the worker's own exception (StaleEpochError, InvalidWorkerRequest, ...)
                re-raised as is, or any other error it raised wrapped in WorkerError.
            WorkerUnavailable: the actor died, is restarting, or the call timed out.
        """
        import ray.exceptions as rex  # Ray only where Ray actors are used

        try:
            if self._timeout is None:
                return await ref
            return await asyncio.wait_for(ref, self._timeout)
        except rex.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, WorkerError):
                raise cause from None
            raise WorkerError(f"worker {self._worker_id!r} failed: {cause or exc!r}") from exc
        except rex.RayActorError as exc:
            raise WorkerUnavailable(self._worker_id, f"{type(exc).__name__}: {exc}") from None
        except (TimeoutError, rex.GetTimeoutError):
            raise WorkerUnavailable(
                self._worker_id, f"no answer within {self._timeout} s"
            ) from None

    async def export_blocks(self, epoch: str, block_ids: IndexLike) -> torch.Tensor:
        # The actor's export arrives as a read-only view of the object store (zero-copy for
        # transfer_blocks); the caller gets its own writable copy.
        return (await super().export_blocks(epoch, block_ids)).clone()


class LocalWorkerClient(_WorkerClientBase):
    """A PoolWorker in this process behind the async worker interface.

    Args:
        worker_id: the worker's id.
        config: its pool.
        device: pool device (None: CUDA if available, else CPU).

        inline: run the attention rounds (``run_round``) on the caller's event loop when nothing is queued on the
            worker's thread, instead of hopping to that thread. For GPU pools: their work is a millisecond or less of host work
            around asynchronous kernels, and the hop (a thread wake-up and the GIL handed
            back and forth) cost about as much again on the H200 host. Bulk calls (whole
            sequences, exports) always take the thread, so they never stall the loop.

    Besides the protocol it can :meth:`restart` (new epoch, empty pool: what a Ray restart
    does) and :meth:`kill` (every later call raises WorkerUnavailable), so failure handling
    is testable without Ray.
    """

    # With `inline`: the per-layer attention rounds.
    _INLINE_METHODS = frozenset({"run_round"})
    # Always on the caller's loop when nothing is queued, whatever the pool's device: a
    # step lease's grant and end, once per leased step, small host work (on a GPU the
    # end's wait for the step's last kernels included), where a hop to the worker's
    # thread and back costs as much again.
    _LIGHT_METHODS = frozenset({"grant_lease", "end_lease"})
    _accepts_out = True
    # How per-layer calls reach the worker (GetInfo's WorkerInfo.data_path).
    data_path = "in_process"

    def __init__(
        self,
        worker_id: str,
        config: PoolConfig,
        device: str | None = "cpu",
        *,
        inline: bool = False,
    ) -> None:
        self._worker_id = worker_id
        self._config = config
        self._device = device
        self._worker: PoolWorker | None = PoolWorker(worker_id, config, device)
        # One thread: calls run one at a time, in order, as on an actor.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kvpool-{worker_id}")
        # The online check's recomputations run beside the calls, as on a Ray actor's
        # channel threads: `PoolWorker.reference_attend` holds the pool's lock only to stage
        # its inputs, so a check of tens of milliseconds does not hold up the rounds after it.
        self._checks = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"kvpool-check-{worker_id}"
        )
        self._inline = inline
        # Calls submitted to the thread and not yet finished (shared with `sharing` views):
        # an inline call runs only when this is 0, so calls still never overlap.
        self._queued = [0]

    @property
    def worker(self) -> PoolWorker:
        """The in-process worker (tests inspect its pool).

        Raises:
            WorkerUnavailable: after :meth:`kill`.
        """
        if self._worker is None:
            raise WorkerUnavailable(self._worker_id, "killed")
        return self._worker

    @classmethod
    def sharing(cls, other: LocalWorkerClient) -> LocalWorkerClient:
        """A second client of ``other``'s in-process worker (what a second coordinator's
        RayWorkerClient on the same actor is), with a generation of its own; calls of both
        run on ``other``'s thread, one at a time. restart/kill act on this view only."""
        view = cls.__new__(cls)
        view._worker_id = other._worker_id
        view._config = other._config
        view._device = other._device
        view._worker = other.worker
        view._executor = other._executor
        view._checks = other._checks
        view._inline = other._inline
        view._queued = other._queued
        return view

    def restart(self) -> None:
        """Replace the worker by a fresh one: new epoch, empty pool."""
        self._worker = PoolWorker(self._worker_id, self._config, self._device)

    def kill(self) -> None:
        """Drop the worker; later calls raise WorkerUnavailable until :meth:`restart`."""
        self._worker = None

    def close(self) -> None:
        """Stop the private threads (after the calls in flight)."""
        self._executor.shutdown(wait=True)
        self._checks.shutdown(wait=True)

    async def _invoke(self, method: str, *args: Any, **kwargs: Any) -> Any:
        call = functools.partial(getattr(self.worker, method), *args, **kwargs)
        if self._on_data_call is not None and method in CHANNEL_METHODS:
            self._on_data_call(self._worker_id, "in_process")
        if self._queued[0] == 0 and (
            method in self._LIGHT_METHODS or (self._inline and method in self._INLINE_METHODS)
        ):
            return call()
        if method == "reference_attend":
            return await asyncio.get_running_loop().run_in_executor(self._checks, call)
        self._queued[0] += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, call)
        finally:
            self._queued[0] -= 1


def _local_node() -> str | None:
    """This process's Ray node id (None when Ray is not initialised here)."""
    import ray  # Ray only where Ray actors are used

    if not ray.is_initialized():
        return None
    try:
        return ray.get_runtime_context().get_node_id()
    except Exception:  # a Ray client connection (ray://) has no node of its own
        return None


async def transfer_blocks(
    src: WorkerClient,
    src_epoch: str,
    src_ids: IndexLike,
    dst: WorkerClient,
    dst_epoch: str,
    dst_ids: IndexLike,
) -> None:
    """Copy blocks ``src_ids`` of ``src`` into blocks ``dst_ids`` of ``dst`` (all layers).

    For rebalancing and for copying a hot prefix next to its users. Between two Ray workers
    the export's ObjectRef is handed to the import, so the data moves through Ray's object
    store without visiting the caller. The source is left as it is (release it afterwards
    for a move).

    Raises:
        WorkerError: from either side (StaleEpochError names the worker whose epoch moved).
    """
    if isinstance(src, RayWorkerClient) and isinstance(dst, RayWorkerClient):
        exported = src.submit("export_blocks", src._fenced(src_epoch), src_ids)
        try:
            await dst.import_blocks(dst_epoch, dst_ids, exported)
        except WorkerUnavailable:
            # A dead source also fails the import; name the worker that is really gone.
            await src.describe()
            raise
        return
    data = await src.export_blocks(src_epoch, src_ids)
    await dst.import_blocks(dst_epoch, dst_ids, data)
