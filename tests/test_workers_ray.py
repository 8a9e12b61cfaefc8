"""PoolWorker actors on a local Ray with CPU workers: the data path through real actors,
cross-worker attention, block transfer through the object store, epoch fencing after a
restart, actor death, and the launcher (named, detached, attachable)."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import time
import uuid

import pytest
import torch
from workers_support import Segment, SequenceView, dense_attention, rel_err

ray = pytest.importorskip("ray")

from round_calls import attend, write_and_attend, write_and_attend_layers  # noqa: E402

from cache_service.engine.attention_plan import plan_attention, run_attention  # noqa: E402
from cache_service.engine.worker_clients import RayWorkerClient, transfer_blocks  # noqa: E402
from cache_service.wire.worker_channel import ChannelOptions  # noqa: E402
from workers.config import PoolConfig  # noqa: E402
from workers.errors import (  # noqa: E402
    InvalidWorkerRequest,
    StaleEpochError,
    WorkerLaunchError,
    WorkersAlreadyExist,
    WorkerUnavailable,
)
from workers.launcher import (  # noqa: E402
    LaunchConfig,
    attach_workers,
    launch_workers,
    shutdown_workers,
)
from workers.layout import KVLayout  # noqa: E402
from workers.ray_startup import start_local_ray  # noqa: E402

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype="float32")
NAMESPACE = f"kvcache-test-{uuid.uuid4().hex[:8]}"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def cluster():
    started = not ray.is_initialized()
    if started:
        # address="local": a fresh cluster, never one another process left on this machine.
        start_local_ray(NAMESPACE, num_cpus=2)
    yield ray.get_runtime_context().gcs_address
    if started:
        ray.shutdown()


def _config(prefix: str, **kwargs) -> LaunchConfig:
    pool = kwargs.pop("pool", PoolConfig(LAYOUT, num_blocks=32))
    return LaunchConfig(pool, namespace=NAMESPACE, name_prefix=prefix, **kwargs)


@pytest.fixture(scope="module")
def clients(cluster):
    prefix = "data-"
    handles = launch_workers(_config(prefix, num_workers=3))
    loop = asyncio.new_event_loop()
    made = [loop.run_until_complete(RayWorkerClient.connect(h)) for h in handles]
    yield loop, made
    loop.close()
    shutdown_workers(NAMESPACE, prefix)


def _slots(blocks, start: int, n: int, bs: int = 4) -> list[int]:
    """Flat slots of tokens start..start+n-1 of a run of blocks beginning at token 0."""
    return [blocks[(start + i) // bs] * bs + (start + i) % bs for i in range(n)]


async def _write_sequence(clients_by_id, epochs, pieces, k, v, layer, rng, taken):
    """Write a sequence's K/V through the clients over ``pieces``; return its view."""
    segments, start, seq_len = [], 0, k.shape[0]
    for worker, count in pieces:
        used = taken.setdefault(worker, set())
        blocks = tuple(rng.sample([b for b in range(32) if b not in used], count))
        used.update(blocks)
        hi = min(start + count * 4, seq_len)
        slots = _slots(blocks, 0, hi - start)
        await clients_by_id[worker].write(epochs[worker], layer, slots, k[start:hi], v[start:hi])
        segments.append(Segment(worker, start, blocks))
        start += count * 4
    return SequenceView(seq_len, tuple(segments))


def test_write_attend_through_actor_matches_dense(clients):
    loop, (c0, _, _) = clients
    gen = torch.Generator().manual_seed(0)

    async def scenario():
        epoch = (await c0.describe()).epoch
        k, v = torch.randn(11, 2, 16, generator=gen), torch.randn(11, 2, 16, generator=gen)
        q = torch.randn(3, 8, 16, generator=gen)  # GQA: 8 query heads over 2 KV heads
        blocks = [9, 2, 30]
        await c0.write(epoch, 1, _slots(blocks, 0, 9), k[:9], v[:9])
        # The last two tokens arrive with the step: one call writes them and attends.
        result = await write_and_attend(c0,
            epoch, 1, _slots(blocks, 9, 2), k[9:], v[9:], q, [blocks], [11], [0, 3],
            return_lse=True,
        )  # fmt: skip
        ref_out, ref_lse = dense_attention(q, k, v)
        assert result.out.device.type == "cpu"
        assert rel_err(result.out, ref_out) < 1e-5
        assert torch.allclose(result.lse.double(), ref_lse, atol=1e-4)

    loop.run_until_complete(scenario())


@pytest.mark.parametrize(("pieces", "n"), [([("data-0", 2), ("data-1", 1)], 1),
                                           ([("data-0", 1), ("data-1", 2)], 6)])  # fmt: skip
def test_sequence_spanning_two_workers_equals_one_worker(clients, pieces, n):
    loop, made = clients
    by_id = {c.worker_id: c for c in made}
    rng = random.Random(n)
    gen = torch.Generator().manual_seed(n)

    async def scenario():
        epochs = {w: (await c.describe()).epoch for w, c in by_id.items()}
        taken: dict[str, set[int]] = {}
        seq_len = 11
        k, v = (
            torch.randn(seq_len, 2, 16, generator=gen),
            torch.randn(seq_len, 2, 16, generator=gen),
        )
        q = torch.randn(n, 4, 16, generator=gen)
        split = await _write_sequence(by_id, epochs, pieces, k, v, 0, rng, taken)
        whole = await _write_sequence(by_id, epochs, [("data-2", 3)], k, v, 0, rng, taken)
        split_plan = plan_attention([split], [n], 4)
        assert split_plan.needs_merge and len(split_plan.batches) == 2
        got = await run_attention(split_plan, q, 0, by_id, epochs)
        one = await run_attention(plan_attention([whole], [n], 4), q, 0, by_id, epochs)
        assert rel_err(got.out, one.out) < 1e-5
        assert rel_err(got.out, dense_attention(q, k, v)[0]) < 1e-5

    loop.run_until_complete(scenario())


def test_transfer_through_object_store_is_bit_exact(clients):
    loop, (c0, c1, _) = clients

    async def scenario():
        e0, e1 = (await c0.describe()).epoch, (await c1.describe()).epoch
        data = torch.randn(3, *LAYOUT.block_shape)
        await c0.import_blocks(e0, [20, 21, 22], data)
        assert torch.equal(await c0.export_blocks(e0, [20, 21, 22]), data)
        await transfer_blocks(c0, e0, [22, 20], c1, e1, [25, 26])
        assert torch.equal(await c1.export_blocks(e1, [25, 26]), data[[2, 0]])
        # A wrong source epoch fails the transfer and names the source.
        with pytest.raises(StaleEpochError) as info:
            await transfer_blocks(c0, e1, [20], c1, e1, [27])
        assert info.value.worker_id == "data-0"

    loop.run_until_complete(scenario())


def test_bad_input_through_ray_is_refused_and_changes_nothing(clients):
    loop, (_, _, c2) = clients

    async def scenario():
        epoch = (await c2.describe()).epoch
        before = await c2.export_blocks(epoch, list(range(32)))
        kv = torch.zeros(2, 2, 16)
        with pytest.raises(InvalidWorkerRequest, match="slot_mapping holds slot 128"):
            await c2.write(epoch, 0, [0, 128], kv, kv)
        with pytest.raises(InvalidWorkerRequest, match="key must be"):
            await c2.write(epoch, 0, [0], kv, kv)
        with pytest.raises(InvalidWorkerRequest, match="block_tables"):
            await write_and_attend(
                c2, epoch, 0, [0, 1], kv, kv, torch.zeros(1, 2, 16), [[40]], [1], [0, 1]
            )
        with pytest.raises(StaleEpochError):
            await c2.write("0" * 16, 0, [0, 1], kv, kv)
        assert torch.equal(await c2.export_blocks(epoch, list(range(32))), before)

    loop.run_until_complete(scenario())


def test_a_call_past_its_timeout_reports_the_worker_unavailable(clients):
    loop, (c0, _, _) = clients
    impatient = RayWorkerClient(c0.worker_id, c0.handle, call_timeout_s=1e-6)
    with pytest.raises(WorkerUnavailable, match="no answer within"):
        loop.run_until_complete(impatient.health())


@pytest.mark.parametrize("tcp", [False, True], ids=["shared-memory", "tcp"])
def test_the_worker_channel_gives_the_results_and_errors_of_ray_calls(clients, tcp):
    """Per-layer calls over the worker channel (same node: shared memory; or over TCP, as
    to a worker on another node): the same outputs, LSEs and refusals as the same calls
    through Ray, and a refused call changes nothing."""
    loop, handles = clients
    c1 = handles[1]

    async def scenario():
        options = ChannelOptions(1 << 20, force_tcp=tcp)
        fast = await RayWorkerClient.connect(c1.handle, channel=options)
        epoch = (await c1.describe()).epoch
        g = torch.Generator().manual_seed(3)
        k, v = torch.randn(7, 2, 16, generator=g), torch.randn(7, 2, 16, generator=g)
        q = torch.randn(7, 4, 16, generator=g)
        slots = [40 + i for i in range(7)]  # blocks 10 and 11
        tables, lens, starts = [[10, 11]], [7], [0, 7]
        out = torch.empty_like(q)
        got = await write_and_attend(fast, epoch, 1, slots, k, v, q, tables, lens, starts, out=out)
        assert got.out is out and fast.channel_calls == 1
        want, want_lse = dense_attention(q, k, v)
        assert rel_err(out, want) < 1e-5
        slow = await attend(c1, epoch, 1, q, tables, lens, starts, return_lse=True)
        quick = await attend(fast, epoch, 1, q, tables, lens, starts, return_lse=True)
        assert torch.equal(slow.out, quick.out) and torch.equal(slow.lse, quick.lse)
        assert rel_err(quick.lse, want_lse) < 1e-5
        # A round over layers given in parts (two callers' rows), through Ray and over the
        # channel: the same joined answer (output slots named here lie in no shared file,
        # so neither path writes them in place).
        parts = [[t[:3], t[3:]] for t in (k, v, q)]
        index = [torch.tensor(x, dtype=torch.int32) for x in (tables, lens, starts)]
        rounds = [
            await write_and_attend_layers(client,
                epoch, [1], [1] * 7, slots, *parts, *index, metadata_key=4,
                return_lse=True, out=[torch.empty_like(q[:3]), torch.empty_like(q[3:])],
            )
            for client in (c1, fast)
        ]  # fmt: skip
        assert torch.equal(rounds[0].out, rounds[1].out)
        assert torch.equal(rounds[0].lse, rounds[1].lse)
        assert rel_err(rounds[1].out, want) < 1e-5
        before = await c1.export_blocks(epoch, [10, 11])
        with pytest.raises(InvalidWorkerRequest, match="slot_mapping holds slot 128"):
            await fast.write(epoch, 0, [0, 128], k[:2], v[:2])
        with pytest.raises(StaleEpochError):
            await fast.write("0" * 16, 1, slots, k * 0, v * 0)
        assert torch.equal(await c1.export_blocks(epoch, [10, 11]), before)
        assert fast.channel_calls == 3  # the refusals were answered by the worker too
        fast.close()

    loop.run_until_complete(scenario())


@pytest.mark.parametrize("channel", [None, ChannelOptions(1 << 20)], ids=["ray", "channel"])
def test_killed_workers_are_detected(cluster, channel):
    """A restarted worker has a new epoch and an empty pool, and refuses the old epoch; a
    worker that stays dead reports WorkerUnavailable. With the worker channel, its broken
    connection hands the call to Ray, which tells which of the two happened."""
    prefix = "crash-" if channel is None else "crash-channel-"
    handles = launch_workers(_config(prefix, num_workers=2, max_restarts=1))

    async def scenario():
        restarting, dying = [await RayWorkerClient.connect(h, channel=channel) for h in handles]
        old = (await restarting.describe()).epoch
        await restarting.write(old, 0, [5], torch.ones(1, 2, 16), torch.ones(1, 2, 16))
        dead_epoch = (await dying.describe()).epoch
        await dying.write(dead_epoch, 0, [5], torch.ones(1, 2, 16), torch.ones(1, 2, 16))
        assert restarting.channel_calls == dying.channel_calls == (channel is not None)
        dead_epoch = (await dying.describe()).epoch
        ray.kill(restarting.handle, no_restart=False)
        ray.kill(dying.handle, no_restart=True)

        # ray.kill returns before the actor is gone: poll until the restarted one answers.
        deadline = time.monotonic() + 60
        new = old
        while new == old:
            assert time.monotonic() < deadline, "the killed worker did not restart in 60 s"
            try:
                new = (await restarting.describe()).epoch
            except WorkerUnavailable:
                pass
            await asyncio.sleep(0.1)
        with pytest.raises(StaleEpochError):
            await attend(restarting, old, 0, torch.zeros(1, 2, 16), [[1]], [2], [0, 1])
        assert (await restarting.export_blocks(new, [1])).abs().sum() == 0  # empty pool
        await restarting.write(new, 0, [5], torch.ones(1, 2, 16), torch.ones(1, 2, 16))
        # Over a new channel to the restarted worker.
        assert restarting.channel_calls == (2 if channel is not None else 0)
        with pytest.raises(WorkerUnavailable, match=f"{prefix}1"):
            await attend(dying, dead_epoch, 0, torch.zeros(1, 2, 16), [[1]], [2], [0, 1])
        restarting.close()
        dying.close()

    try:
        asyncio.run(scenario())
    finally:
        shutdown_workers(NAMESPACE, prefix)


def test_launcher_names_attaches_and_refuses_duplicates(cluster):
    prefix = "named-"
    handles = launch_workers(_config(prefix, num_workers=2))
    try:
        with pytest.raises(WorkersAlreadyExist, match="already exist") as info:
            launch_workers(_config(prefix, num_workers=1))
        assert info.value.names == ["named-0", "named-1"]
        attached = attach_workers(NAMESPACE, prefix)
        names = [ray.get(h.describe.remote()).worker_id for h in attached]
        assert names == ["named-0", "named-1"]
        assert [ray.get(h.epoch.remote()) for h in attached] == [
            ray.get(h.epoch.remote()) for h in handles
        ]
    finally:
        assert shutdown_workers(NAMESPACE, prefix) == 2
    with pytest.raises(WorkerLaunchError, match="no workers named"):
        attach_workers(NAMESPACE, prefix)


def test_detached_workers_survive_the_process_that_launched_them(cluster):
    prefix = "detached-"
    child = f"""
import ray
from workers.config import PoolConfig
from workers.launcher import LaunchConfig, launch_workers
from workers.layout import KVLayout
ray.init(address={cluster!r}, namespace={NAMESPACE!r}, log_to_driver=False)
pool = PoolConfig(KVLayout(2, 2, 16, 4, "float32"), num_blocks=8)
(h,) = launch_workers(LaunchConfig(pool, num_workers=1, namespace={NAMESPACE!r},
                                   name_prefix={prefix!r}))
print("EPOCH", ray.get(h.epoch.remote()))
"""
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    run = subprocess.run(
        [sys.executable, "-c", child], capture_output=True, text=True, env=env, timeout=120
    )
    assert run.returncode == 0, run.stderr[-2000:]
    epoch = next(line.split()[1] for line in run.stdout.splitlines() if line.startswith("EPOCH"))
    try:
        (handle,) = attach_workers(NAMESPACE, prefix)
        assert ray.get(handle.epoch.remote()) == epoch  # same process, pool intact
    finally:
        shutdown_workers(NAMESPACE, prefix)


def test_a_pool_that_does_not_fit_fails_the_launch_cleanly(cluster):
    prefix = "toobig-"
    huge = PoolConfig(KVLayout(1024, 64, 256, 256, "float32"), num_blocks=100_000)
    with pytest.raises(WorkerLaunchError, match="does not fit"):
        launch_workers(_config(prefix, num_workers=2, pool=huge))
    with pytest.raises(WorkerLaunchError, match="no workers named"):
        attach_workers(NAMESPACE, prefix)


def test_one_per_gpu_needs_gpus(cluster):
    with pytest.raises(WorkerLaunchError, match="one worker per GPU"):
        launch_workers(_config("nogpu-"))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_workers": 0}, "num_workers"),
        ({"name_prefix": ""}, "name_prefix"),
        ({"gpus_per_worker": 1.5}, "gpus_per_worker"),
        ({"gpus_per_worker": -1}, "gpus_per_worker"),
        ({"max_restarts": -2}, "max_restarts"),
        ({"cpus_per_worker": -1}, "cpus_per_worker"),
        ({"ready_timeout_s": 0}, "ready_timeout_s"),
    ],
)
def test_launch_config_refuses_bad_fields(kwargs, message):
    with pytest.raises(WorkerLaunchError, match=message):
        LaunchConfig(PoolConfig(LAYOUT, num_blocks=1), **kwargs)
