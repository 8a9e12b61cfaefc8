"""``PoolWorker``: the Ray actor that owns one device's KV pool.

Every data method takes the epoch the caller expects first. The epoch is a random id drawn
when the actor starts, so after a crash and a Ray restart (which reruns the constructor with
an empty pool) every call made with the old epoch is refused with
:class:`~workers.errors.StaleEpochError`: a restarted worker never serves blocks it lost.

A second fence keeps a superseded coordinator out: a coordinator with a metadata store
claims the worker (:meth:`PoolWorker.claim`) with its generation (from the store, bumped at
every coordinator start) and passes the generation with every data call
(:class:`~workers.description.FencedEpoch` in place of the epoch string). A claim or call
from a generation lower than the highest one seen is refused with
:class:`~workers.errors.StaleCoordinatorError`. A bare epoch string (no store) is unfenced.

Tensors arrive on the host, move to the pool's device here, and results go back as host
tensors. The class is plain Python so it also runs in-process
(``cache_service.engine.worker_clients.LocalWorkerClient``); :data:`PoolWorkerActor` is its Ray
actor class, which packs its tensor results with :mod:`workers.transport` (raw bytes as
numpy arrays: out-of-band, zero-copy through Ray's object store instead of torch's in-band
pickling); callers see plain torch tensors. ``RayWorkerClient`` packs the tensors it sends
the same way; tensors that arrive unpacked work too.

The per-layer data calls can also arrive over the worker channel
(:meth:`PoolWorker.channel_address`, :mod:`workers.channel_server`): a Unix socket and an
arena in shared memory for a caller on the same node, TCP for one on another, where a Ray
call would cost milliseconds. Their results stay plain tensors (packing is for Ray's trip).
Ray runs an actor's calls one at a time and the channel runs its calls on threads of its
own, so every data call takes the worker's lock: pool updates stay serialised whichever
way they came.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import ray
import torch

from workers.channel_server import ChannelAddress, ChannelServer
from workers.checks import AttendOptions
from workers.config import PoolConfig
from workers.description import FencedEpoch, WorkerDescription, WorkerHealth
from workers.errors import StaleCoordinatorError, StaleEpochError
from workers.fingerprints import BadSlot
from workers.lease_server import LeaseServer
from workers.pool import AttendResult, IndexLike, KVPool, PartsResult, ReferenceInputs
from workers.round import Round
from workers.step_leases import LeaseReport, StepLeases
from workers.transport import pack_result, unpack

__all__ = ["PoolWorker", "PoolWorkerActor", "new_epoch"]

_T = TypeVar("_T")

# Marks the channel's threads (PoolWorker._channel_call): their results are not packed.
_channel_thread = threading.local()


def _on_channel_thread() -> bool:
    """Whether this thread is one of the worker channel's (set by `_channel_call`)."""
    return getattr(_channel_thread, "active", False)


def new_epoch() -> str:
    """A fresh random epoch id (16 hex digits)."""
    return secrets.token_hex(8)


def _to_host(result: _T) -> _T:
    """A pool result with its tensors (alone or in a tuple) on the host; the rest as it is."""
    if isinstance(result, tuple):
        return tuple(_to_host(r) for r in result)  # type: ignore[return-value]
    if isinstance(result, torch.Tensor):
        return result.cpu()  # type: ignore[return-value]
    return result


class PoolWorker:
    """One KV pool behind an epoch fence.

    Args:
        worker_id: stable id (the actor's name).
        config: pool size and options.
        device: pool device; None = the GPU Ray assigned (``cuda``) if any, else CPU.
        torch_threads: intra-op CPU threads for torch in this process (None: leave as is);
            CPU workers sharing a machine should use 1 each.

    Raises:
        PoolAllocationError: the pool does not fit.
    """

    def __init__(
        self,
        worker_id: str,
        config: PoolConfig,
        device: str | None = None,
        torch_threads: int | None = None,
    ) -> None:
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
        self._worker_id = worker_id
        self._config = config
        self._pool = KVPool.serving(config, device)
        self._epoch = new_epoch()
        self._started = time.monotonic()
        self._calls = 0
        self._failed = 0
        # The highest coordinator generation that claimed this worker or called it with
        # a FencedEpoch (None: none yet). Not kept across restarts: a restarted worker
        # has a new epoch, which already refuses every caller until it re-registers (and
        # re-claims) the worker.
        self._generation: int | None = None
        # Held by every data call and claim: calls arrive on Ray's thread and on the
        # channel's threads.
        self._lock = threading.Lock()
        self._channel: ChannelServer | None = None
        self._leases = StepLeases(self._pool)
        self._lease_server: LeaseServer | None = None

    @property
    def pool(self) -> KVPool:
        """The pool itself, for code run inside the actor process (``handle.__ray_call__``:
        benchmarks timing the kernels on the worker's GPU). Not reachable as a remote method:
        no epoch fence, no validation."""
        return self._pool

    # -- identity (no epoch) ------------------------------------------------------------

    def epoch(self) -> str:
        """This start's epoch."""
        return self._epoch

    def describe(self) -> WorkerDescription:
        """Identity, epoch and capacity."""
        return WorkerDescription(
            worker_id=self._worker_id,
            epoch=self._epoch,
            num_blocks=self._pool.num_blocks,
            device=str(self._pool.device),
            layout=self._pool.layout,
            pool_bytes=self._pool.nbytes,
            debug=self._pool.debug,
            host_blocks=self._pool.host_blocks,
        )

    def generation(self) -> int | None:
        """The highest coordinator generation that claimed this worker (None: none)."""
        return self._generation

    def claim(self, generation: int) -> WorkerDescription:
        """Record ``generation`` as the coordinator driving this worker (a coordinator with
        a store calls it at every registration); calls from lower generations are refused
        from now on. Claiming again with the same generation is fine.

        Raises:
            StaleCoordinatorError: a higher generation already claimed the worker.
        """
        with self._lock:
            self._check_generation(generation)
            if self._generation is not None and generation > self._generation:
                self._leases.clear()  # granted by the coordinator this one supersedes
            self._generation = generation
        return self.describe()

    def health(self) -> WorkerHealth:
        """Probe the device with a small computation; never raises."""
        ok, detail, free = True, "", None
        try:
            probe = torch.ones(8, device=self._pool.device).sum()
            if float(probe) != 8.0:  # the read also synchronises with queued device work
                ok, detail = False, f"device probe returned {float(probe)} instead of 8"
            if self._pool.device.type == "cuda":
                free = self._pool.free_bytes()
        except Exception as exc:  # a health probe reports, it does not raise
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        return WorkerHealth(
            worker_id=self._worker_id,
            epoch=self._epoch,
            ok=ok,
            detail=detail,
            uptime_s=time.monotonic() - self._started,
            calls=self._calls,
            failed_calls=self._failed,
            device_free_bytes=free,
        )

    def channel_address(self, tcp: bool = False) -> ChannelAddress:
        """Where this worker's channel listens, starting it on the first call: a caller on
        the same node sends its per-layer data calls there instead of through Ray
        (``cache_service.wire.worker_channel``); with ``tcp``, callers on other nodes too (a
        TCP listener on this node's address, opened on the first such request)."""
        if self._channel is None:
            self._channel = ChannelServer(
                self._channel_call,
                pin_for_cuda=self._pool.device.type == "cuda",
                node_id=_ray_node_id(),
                name=self._worker_id,
            )
        if tcp:
            return self._channel.listen_tcp(_node_address())
        return self._channel.address()

    def lease_socket(self) -> str:
        """The path of this worker's lease socket (`workers.lease_server`), started on the
        first call: a client on this host sends a leased step's layers there."""
        with self._lock:
            if self._lease_server is None:
                self._lease_server = LeaseServer(
                    self._pool, self._leases, self._config.backend, self._worker_id
                )
            return self._lease_server.path

    def grant_lease(
        self,
        epoch: str | FencedEpoch,
        lease_id: bytes,
        layers: Sequence[int],
        block_tables: torch.Tensor | Sequence[Sequence[int]],
        seq_lens: IndexLike,
        query_start_loc: IndexLike,
        slot_mapping: Sequence[int],
        num_q_heads: int,
        connection: bytes | None = None,
        steps: int = 1,
    ) -> bytes | None:
        """`StepLeases.grant` behind the epoch fence: the step's layers `layers` may be
        written by the lease's client under `lease_id` until :meth:`end_lease`, for
        `steps` decode steps. Returns the packed plan when the lease was opened for
        `connection` at the grant."""
        batch = self._unpacked((block_tables, seq_lens, query_start_loc))
        return self._run(
            epoch,
            lambda: self._leases.grant(
                lease_id, layers, *batch, slot_mapping, num_q_heads, connection, steps
            ),
        )

    def end_lease(self, epoch: str | FencedEpoch, lease_id: bytes) -> LeaseReport | None:
        """`StepLeases.end` behind the epoch fence, without waiting: which layers the
        lease wrote, or None while its client runs it (then :meth:`wait_lease`)."""
        return self._fenced_run(epoch, lambda: self._leases.end(lease_id))

    def wait_lease(
        self, epoch: str | FencedEpoch, lease_id: bytes, timeout_s: float
    ) -> LeaseReport:
        """`StepLeases.wait` behind the epoch fence: end the lease once its client reports
        (or revoke it after `timeout_s`) and say which layers it wrote."""
        return self._fenced_run(epoch, lambda: self._leases.wait(lease_id, timeout_s))

    def close_channel(self) -> None:
        """Stop the channel (its connections end; callers go back to Ray calls)."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self._lease_server is not None:
            self._lease_server.close()
            self._lease_server = None

    # -- data (epoch first) -------------------------------------------------------------

    def write(
        self,
        epoch: str,
        layer: int | None,
        slot_mapping: IndexLike,
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> None:
        """:meth:`KVPool.write` behind the epoch fence."""
        self._on_pool(epoch, self._pool.write, layer, slot_mapping, key, value)

    def run_round(self, epoch: str | FencedEpoch, round: Round) -> AttendResult | PartsResult:
        """:meth:`KVPool.run_round` behind the epoch fence (`epoch`: the round's epoch as
        the caller sends it, with its generation when fenced); results on the host (the
        output in `round.out` when given)."""
        if self._pack_results and not _on_channel_thread():
            round = round.with_tensors(unpack)  # packed for Ray's trip (workers.transport)
        return self._run(epoch, lambda: _to_host(self._pool.run_round(round, to_host=True)))

    def reference_attend(
        self,
        epoch: str,
        layer: int,
        query: torch.Tensor,
        block_tables: torch.Tensor | Sequence[Sequence[int]],
        seq_lens: IndexLike,
        query_start_loc: IndexLike,
        causal: bool = True,
        return_lse: bool = False,
        *,
        scale: float | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[BadSlot]]:
        """:meth:`KVPool.reference_attend` (torch reference + slot fingerprint check) behind
        the epoch fence; tensors on the host.

        Only its first half (`KVPool.reference_inputs`: validation, staging, fingerprints)
        holds the pool's lock; the recomputation runs outside it, so the calls that arrive
        meanwhile on other threads (the channel's) are not held up by the online check
        (KVPool.reference_output says why that is safe). The epoch never changes in an
        actor's life, so the fence checked under the lock still holds after it."""
        batch = self._unpacked((query, block_tables, seq_lens, query_start_loc))

        def stage() -> ReferenceInputs:
            options = AttendOptions(causal, return_lse, scale, sliding_window, softcap)
            return self._pool.reference_inputs(layer, *batch, options)

        with self._lock:
            inputs = self._fenced_run(epoch, stage)
        try:
            out, lse = self._pool.reference_output(inputs)
        except Exception:
            with self._lock:
                self._failed += 1
            raise
        return self._for_caller(_to_host((out, lse, inputs.bad)))

    def copy_blocks(self, epoch: str, src: IndexLike, dst: IndexLike) -> None:
        """:meth:`KVPool.copy_blocks` behind the epoch fence."""
        self._on_pool(epoch, self._pool.copy_blocks, src, dst)

    def export_blocks(self, epoch: str, block_ids: IndexLike) -> torch.Tensor:
        """:meth:`KVPool.export_blocks` behind the epoch fence (host tensor; from the Ray
        actor, a read-only view of the object store: clone it before writing)."""
        return self._on_pool(epoch, self._pool.export_blocks, block_ids, readonly=True)

    def import_blocks(self, epoch: str, block_ids: IndexLike, data: torch.Tensor) -> None:
        """:meth:`KVPool.import_blocks` behind the epoch fence."""
        self._on_pool(epoch, self._pool.import_blocks, block_ids, data)

    def offload_blocks(self, epoch: str, block_ids: IndexLike, host_ids: IndexLike) -> int:
        """:meth:`KVPool.offload_blocks` (device -> host tier) behind the epoch fence;
        returns the bytes copied."""
        return self._on_pool(epoch, self._pool.offload_blocks, block_ids, host_ids)

    def restore_blocks(self, epoch: str, host_ids: IndexLike, block_ids: IndexLike) -> int:
        """:meth:`KVPool.restore_blocks` (host tier -> device) behind the epoch fence;
        returns the bytes copied."""
        return self._on_pool(epoch, self._pool.restore_blocks, host_ids, block_ids)

    def release_blocks(self, epoch: str, block_ids: IndexLike) -> None:
        """:meth:`KVPool.release_blocks` (NaN poison in debug mode) behind the epoch fence."""
        self._on_pool(epoch, self._pool.release_blocks, block_ids)

    # -- internals ---------------------------------------------------------------------

    # True in the Ray actor: tensor results leave packed (workers.transport).
    _pack_results = False

    def _on_pool(
        self,
        epoch: str | FencedEpoch,
        op: Callable[..., _T],
        *args: Any,
        readonly: bool = False,
        **kwargs: Any,
    ) -> _T:
        """``op(*args, **kwargs)`` (a pool method) on the unpacked arguments behind the epoch
        fence (and the generation fence when ``epoch`` is a FencedEpoch), its tensor results
        moved to the host."""
        args = self._unpacked(args)
        if not _on_channel_thread():
            kwargs = {k: unpack(v) for k, v in kwargs.items()}
        return self._run(epoch, lambda: _to_host(op(*args, **kwargs)), readonly=readonly)

    def _channel_call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A data method called by the channel (on one of its threads, which run nothing
        else): its result with plain tensors, never packed for Ray."""
        _channel_thread.active = True
        if method == "run_round":
            # A round travels as its epoch then its fields (Round.wire_fields).
            round = Round.from_wire(args[0], args[1:], **kwargs)
            return self.run_round(args[0], round)
        return getattr(self, method)(*args, **kwargs)

    def _check_generation(self, generation: int) -> None:
        if self._generation is not None and generation < self._generation:
            raise StaleCoordinatorError(self._worker_id, generation, self._generation)

    def _run(self, epoch: str | FencedEpoch, op: Callable[[], _T], *, readonly: bool = False) -> _T:
        with self._lock:
            result = self._fenced_run(epoch, op)
        return self._for_caller(result, readonly=readonly)

    @staticmethod
    def _unpacked(args: tuple[Any, ...]) -> tuple[Any, ...]:
        """A data call's arguments as plain tensors (the channel sends them so already)."""
        return args if _on_channel_thread() else tuple(unpack(a) for a in args)

    def _for_caller(self, result: _T, *, readonly: bool = False) -> _T:
        """A data call's result as its caller takes it: packed for a Ray caller of the actor
        (workers.transport), plain for the channel and in process."""
        if self._pack_results and not _on_channel_thread():
            return pack_result(result, readonly=readonly)
        return result

    def _fenced_run(self, epoch: str | FencedEpoch, op: Callable[[], _T]) -> _T:
        self._calls += 1
        try:
            # The data methods' epoch argument doubles as the generation carrier (so no
            # method grows a parameter): a plain string is unfenced (no store), a
            # FencedEpoch also names the caller's coordinator generation. Both fences are
            # checked before anything runs.
            generation = None
            if isinstance(epoch, FencedEpoch):
                epoch, generation = epoch.epoch, epoch.generation
                self._check_generation(generation)
            if epoch != self._epoch:
                raise StaleEpochError(self._worker_id, expected=epoch, actual=self._epoch)
            if generation is not None:
                # A call from a newer coordinator fences the older ones as a claim does.
                self._generation = generation
            return op()
        except Exception:
            self._failed += 1
            raise


def _node_address() -> str:
    """This node's address as Ray knows it (loopback outside Ray)."""
    if not ray.is_initialized():
        return "127.0.0.1"
    return ray.util.get_node_ip_address()


def _ray_node_id() -> str | None:
    """The Ray node of this process (None outside Ray)."""
    if not ray.is_initialized():
        return None
    return ray.get_runtime_context().get_node_id()


class RemotePoolWorker(PoolWorker):
    """:class:`PoolWorker` as run by Ray: tensor results are packed for the trip back
    (they unpickle as plain torch tensors)."""

    _pack_results = True


# The Ray actor class. Resources (num_gpus, name, lifetime, ...) are set per launch with
# .options() in workers.launcher.
PoolWorkerActor = ray.remote(RemotePoolWorker)
