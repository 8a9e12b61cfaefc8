"""The coordinator-generation fence (issue 8: stale writers are fenced).

A coordinator with a metadata store claims its workers with its generation and sends it
with every data call; once a newer generation claimed a worker, the older coordinator's
calls are refused with StaleCoordinatorError and change nothing. Generation None (no
store) stays unfenced.
"""

from __future__ import annotations

import asyncio
import pickle
import uuid
from pathlib import Path

import grpc
import pytest
import torch

from cache_service.api.status_mapping import status_for
from cache_service.engine.coordinator import AttendItem, Coordinator
from cache_service.engine.errors import WorkerLost
from cache_service.engine.store import MetadataStore, StoreConfig
from cache_service.engine.worker_clients import LocalWorkerClient, RayWorkerClient
from workers.actor import PoolWorker
from workers.config import PoolConfig
from workers.description import FencedEpoch
from workers.errors import StaleCoordinatorError, StaleEpochError, WorkerError
from workers.layout import KVLayout
from workers.ray_startup import start_local_ray

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
CONFIG = PoolConfig(LAYOUT, num_blocks=8)


def _kv(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (n, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


# ------------------------------------------------------------------------ PoolWorker


def test_claim_records_the_highest_generation_and_refuses_lower() -> None:
    w = PoolWorker("w0", CONFIG, "cpu")
    assert w.generation() is None
    desc = w.claim(3)
    assert desc.worker_id == "w0" and desc.epoch == w.epoch()
    assert w.generation() == 3
    w.claim(3)  # the same coordinator again (re-registration): fine
    with pytest.raises(StaleCoordinatorError, match="generation 2 was superseded by 3") as ei:
        w.claim(2)
    assert isinstance(ei.value, WorkerError)
    assert (ei.value.worker_id, ei.value.generation, ei.value.current) == ("w0", 2, 3)
    assert w.generation() == 3
    w.claim(4)
    assert w.generation() == 4


def test_data_call_from_an_old_generation_is_refused_and_changes_nothing() -> None:
    w = PoolWorker("w0", CONFIG, "cpu")
    epoch = w.epoch()
    k, v = _kv(4)
    w.claim(4)
    w.write(FencedEpoch(epoch, 4), 0, [0, 1, 2, 3], k, v)  # equal generation: accepted
    before = w.pool.export_blocks([0, 1]).clone()
    k2, v2 = _kv(4, seed=1)
    with pytest.raises(StaleCoordinatorError, match="coordinator generation 3 was superseded by 4"):
        w.write(FencedEpoch(epoch, 3), 0, [4, 5, 6, 7], k2, v2)
    with pytest.raises(StaleCoordinatorError):
        w.copy_blocks(FencedEpoch(epoch, 3), [0], [1])
    with pytest.raises(StaleCoordinatorError):
        w.release_blocks(FencedEpoch(epoch, 3), [0])
    with pytest.raises(StaleCoordinatorError):
        w.export_blocks(FencedEpoch(epoch, 3), [0])
    assert torch.equal(w.pool.export_blocks([0, 1]), before)
    assert w.generation() == 4
    assert w.health().failed_calls == 4


def test_higher_generation_call_is_accepted_and_fences_lower_ones() -> None:
    w = PoolWorker("w0", CONFIG, "cpu")
    epoch = w.epoch()
    k, v = _kv(2)
    w.claim(1)
    w.write(FencedEpoch(epoch, 2), 1, [0, 1], k, v)  # a newer coordinator: accepted
    assert w.generation() == 2
    with pytest.raises(StaleCoordinatorError):
        w.write(FencedEpoch(epoch, 1), 1, [0, 1], k, v)


def test_stale_epoch_with_a_newer_generation_records_nothing() -> None:
    w = PoolWorker("w0", CONFIG, "cpu")
    w.claim(1)
    k, v = _kv(1)
    with pytest.raises(StaleEpochError):
        w.write(FencedEpoch("not-the-epoch", 5), 0, [0], k, v)
    assert w.generation() == 1


def test_unfenced_calls_still_work() -> None:
    """Generation None (no store): plain epoch strings, never refused by the fence."""
    w = PoolWorker("w0", CONFIG, "cpu")
    w.claim(7)
    k, v = _kv(2)
    w.write(w.epoch(), 0, [0, 1], k, v)
    assert w.generation() == 7


def test_stale_coordinator_error_pickles_and_maps_to_failed_precondition() -> None:
    err = pickle.loads(pickle.dumps(StaleCoordinatorError("w1", 3, 4)))
    assert (err.worker_id, err.generation, err.current) == ("w1", 3, 4)
    status = status_for(err)
    assert status.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "generation 3 was superseded by 4" in status.message
    assert "this coordinator was superseded" in status.message
    assert not status.internal


# ------------------------------------------------------------------------ clients


def test_two_local_client_views_old_generation_refused_after_new_claim() -> None:
    async def run() -> None:
        old = LocalWorkerClient("w0", CONFIG)
        new = LocalWorkerClient.sharing(old)
        try:
            assert old.generation is None
            epoch = (await old.claim(1)).epoch
            assert old.generation == 1
            k, v = _kv(4)
            await old.write(epoch, 0, [0, 1, 2, 3], k, v)
            assert (await new.claim(2)).epoch == epoch
            before = old.worker.pool.export_blocks([0, 1]).clone()
            k2, v2 = _kv(4, seed=2)
            with pytest.raises(StaleCoordinatorError, match="generation 1 was superseded by 2"):
                await old.write(epoch, 0, [0, 1, 2, 3], k2, v2)
            with pytest.raises(StaleCoordinatorError):
                await old.claim(1)
            assert torch.equal(old.worker.pool.export_blocks([0, 1]), before)
            await new.write(epoch, 0, [0, 1, 2, 3], k2, v2)
            got = await new.export_blocks(epoch, [0])
            assert torch.equal(got[0, 0, 0], k2.transpose(0, 1))
        finally:
            old.close()

    asyncio.run(run())


# ------------------------------------------------------------------------ coordinators


def _store(path: Path, opens_before: int = 0) -> MetadataStore:
    """A store whose next begin_generation() gives opens_before + 1."""
    for _ in range(opens_before):
        with MetadataStore(StoreConfig(str(path))) as s:
            s.begin_generation()
    return MetadataStore(StoreConfig(str(path)))


def test_two_coordinators_the_superseded_ones_writes_are_refused(tmp_path: Path) -> None:
    """An old coordinator (generation 1) thought dead keeps running while its successor
    (generation 2) claims the same worker: the old one's append and attend are refused
    with a clear status, its control plane and the worker's pool stay as they were."""

    async def run() -> None:
        shared = LocalWorkerClient("w0", CONFIG)
        old = Coordinator(LAYOUT, [shared], store=_store(tmp_path / "old.db"))
        new = Coordinator(
            LAYOUT,
            [LocalWorkerClient.sharing(shared)],
            store=_store(tmp_path / "new.db", opens_before=1),
        )
        try:
            await old.start()
            assert old.generation == 1 and shared.worker.generation() == 1
            seq = (await old.create_sequence("t", [1, 2, 3, 4])).seq_id
            k, v = _kv(4)
            await old.append("t", seq, 0, [1, 2, 3, 4], k, v)

            await new.start()
            assert new.generation == 2 and shared.worker.generation() == 2

            snapshot = shared.worker.pool.export_blocks(list(range(CONFIG.num_blocks))).clone()
            records = old.block_manager.to_records()
            k2, v2 = _kv(2, seed=3)
            with pytest.raises(StaleCoordinatorError, match="1 was superseded by 2") as ei:
                await old.append("t", seq, 0, [5, 6], k2, v2)
            status = status_for(ei.value)
            assert status.code == grpc.StatusCode.FAILED_PRECONDITION
            assert "superseded" in status.message
            q = torch.randn(1, LAYOUT.num_kv_heads, LAYOUT.head_dim)
            with pytest.raises(StaleCoordinatorError):
                await old.attend("t", 0, [AttendItem(seq, q)])
            assert old.block_manager.to_records() == records  # the failed write undone
            assert "w0" in old.block_manager.workers()  # the worker is fine: we are stale
            after = shared.worker.pool.export_blocks(list(range(CONFIG.num_blocks)))
            assert torch.equal(after, snapshot)

            # The successor serves normally.
            seq2 = (await new.create_sequence("t", [9, 9])).seq_id
            await new.append("t", seq2, 0, [9, 9], k2, v2)
            out = await new.attend("t", 0, [AttendItem(seq2, q)])
            assert out[0].out.shape == q.shape
        finally:
            await new.close()
            await old.close()
            shared.close()

    asyncio.run(run())


def test_coordinator_reclaims_a_restarted_worker(tmp_path: Path) -> None:
    async def run() -> None:
        w = LocalWorkerClient("w0", CONFIG)
        coord = Coordinator(LAYOUT, [w], store=_store(tmp_path / "s.db"))
        try:
            await coord.start()
            seq = (await coord.create_sequence("t", [1])).seq_id
            w.restart()  # new epoch, empty pool, no claim recorded
            assert w.worker.generation() is None
            k, v = _kv(1)
            with pytest.raises(WorkerLost):  # the pool is gone
                await coord.append("t", seq, 0, [1], k, v)
            for _ in range(100):  # the background re-registration claims it again
                if w.worker.generation() == 1 and coord.workers()[0].up:
                    break
                await asyncio.sleep(0.02)
            assert w.worker.generation() == 1 and coord.workers()[0].up
        finally:
            await coord.close()
            w.close()

    asyncio.run(run())


def test_superseded_coordinator_cannot_start(tmp_path: Path) -> None:
    async def run() -> None:
        w = LocalWorkerClient("w0", CONFIG)
        w.worker.claim(5)  # a coordinator of generation 5 drives it
        coord = Coordinator(LAYOUT, [w], store=_store(tmp_path / "s.db"))
        try:
            with pytest.raises(StaleCoordinatorError, match="1 was superseded by 5"):
                await coord.start()
        finally:
            await coord.close()
            w.close()

    asyncio.run(run())


# ------------------------------------------------------------------------ Ray


def test_ray_actor_refuses_the_superseded_generation() -> None:
    ray = pytest.importorskip("ray")
    from workers.launcher import LaunchConfig, launch_workers, shutdown_workers

    namespace = f"kvcache-fence-{uuid.uuid4().hex[:8]}"
    started = not ray.is_initialized()
    if started:
        start_local_ray(namespace, num_cpus=1)
    prefix = "fence-"
    try:
        (handle,) = launch_workers(
            LaunchConfig(CONFIG, namespace=namespace, name_prefix=prefix, num_workers=1)
        )

        async def run() -> None:
            old = await RayWorkerClient.connect(handle)
            new = RayWorkerClient(old.worker_id, handle)
            epoch = (await old.claim(1)).epoch
            k, v = _kv(4)
            await old.write(epoch, 0, [0, 1, 2, 3], k, v)
            assert (await new.claim(2)).epoch == epoch
            before = await new.export_blocks(epoch, [0])
            k2, v2 = _kv(4, seed=4)
            with pytest.raises(StaleCoordinatorError, match="1 was superseded by 2"):
                await old.write(epoch, 0, [0, 1, 2, 3], k2, v2)
            with pytest.raises(StaleCoordinatorError):
                await old.claim(1)
            assert torch.equal(await new.export_blocks(epoch, [0]), before)
            assert await old.resolve(handle.generation.remote()) == 2
            await new.write(epoch, 0, [0, 1, 2, 3], k2, v2)
            assert torch.equal((await new.export_blocks(epoch, [0]))[0, 0, 0], k2.transpose(0, 1))

        asyncio.run(run())
    finally:
        shutdown_workers(namespace, prefix)
        if started:
            ray.shutdown()
