"""LocalWorkerClient's inline per-layer calls: on the event loop when the worker's thread
is idle, through the thread otherwise, never two calls at once."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import torch
from round_calls import round_form
from service_support import LAYOUT

from cache_service.engine.worker_clients import LocalWorkerClient
from workers.config import PoolConfig
from workers.round import Round


def _recording_client(inline: bool) -> tuple[LocalWorkerClient, list[tuple[str, str]]]:
    client = LocalWorkerClient("w0", PoolConfig(LAYOUT, num_blocks=16), inline=inline)
    seen: list[tuple[str, str]] = []
    worker = client.worker
    active = [0]

    def traced(name: str, fn, delay: float = 0.0):
        def run(*args, **kwargs):
            active[0] += 1
            try:
                assert active[0] == 1, "two worker calls overlapped"
                seen.append((name, threading.current_thread().name))
                time.sleep(delay)
                return fn(*args, **kwargs)
            finally:
                active[0] -= 1

        return run

    rounds = worker.run_round

    def run_round(epoch: Any, rnd: Round) -> Any:
        return traced(round_form(rnd), rounds)(epoch, rnd)

    worker.run_round = run_round
    worker.write = traced("write", worker.write, delay=0.05)
    return client, seen


def _step_args(client: LocalWorkerClient) -> tuple:
    d, hkv = LAYOUT.head_dim, LAYOUT.num_kv_heads
    k = torch.randn(1, hkv, d)
    q = torch.randn(1, 2 * hkv, d)
    return (client.worker.epoch(), 0, [0], k, k, q, [[0]], [1], [0, 1])


def _run(inline: bool, calls) -> list[tuple[str, str]]:
    """Run ``await calls(client)`` on a recording client; the (method, thread) pairs seen."""

    async def main() -> list[tuple[str, str]]:
        client, seen = _recording_client(inline)
        try:
            await calls(client)
        finally:
            client.close()
        return seen

    return asyncio.run(main())


async def _one_step(client: LocalWorkerClient) -> None:
    epoch, layer, slots, k, v, q, tables, lens, starts = _step_args(client)
    await client.run_round(Round(epoch, layer, q, tables, lens, starts, slots, k, v))


def test_inline_call_runs_on_the_loop_when_the_thread_is_idle() -> None:
    seen = _run(True, _one_step)
    assert seen == [("one_layer", threading.main_thread().name)]


def test_a_shared_round_over_layers_runs_on_the_loop_too() -> None:
    # A coordinator's round of several callers (in parts, over layers) is a per-layer call
    # like the others: inline when the thread is idle (it went through the thread once,
    # a hop per round for in-process pools).
    async def layers_round(client: LocalWorkerClient) -> None:
        epoch, _, slots, k, v, q, tables, lens, starts = _step_args(client)
        index = [torch.tensor(x, dtype=torch.int32) for x in (tables, lens, starts)]
        await client.run_round(Round(epoch, [1], [q], *index, slots, [k], [v], [1]))

    seen = _run(True, layers_round)
    assert seen == [("over_layers", threading.main_thread().name)]


def test_inline_call_waits_behind_a_queued_bulk_call() -> None:
    async def bulk_then_step(client: LocalWorkerClient) -> None:
        epoch = client.worker.epoch()
        kv = torch.randn(LAYOUT.num_layers, 1, LAYOUT.num_kv_heads, LAYOUT.head_dim)
        bulk = asyncio.ensure_future(client._invoke("write", epoch, None, [5], kv, kv))
        await asyncio.sleep(0)  # the bulk write is on the thread now
        await _one_step(client)
        await bulk

    seen = _run(True, bulk_then_step)
    assert [name for name, _ in seen] == ["write", "one_layer"]
    assert all(thread.startswith("kvpool-w0") for _, thread in seen)


def test_without_inline_every_call_takes_the_thread() -> None:
    seen = _run(False, _one_step)
    assert seen[0][1].startswith("kvpool-w0")


def test_a_step_lease_grant_and_end_run_on_the_loop_even_without_inline() -> None:
    # Once per leased step and light on any device (a CPU pool's rounds take the thread):
    # the hop to the thread would cost as much as the work.
    async def grant_then_end(client: LocalWorkerClient) -> None:
        worker = client.worker
        worker.grant_lease = traced_on(seen, "grant_lease", worker.grant_lease)
        worker.end_lease = traced_on(seen, "end_lease", worker.end_lease)
        epoch = worker.epoch()
        lease_id = bytes(16)
        await client.grant_lease(
            epoch, lease_id, [0], [[0]], [1], [0, 1], [0], 2 * LAYOUT.num_kv_heads
        )
        report = await client.end_lease(epoch, lease_id)
        assert report.written == ()

    seen: list[tuple[str, str]] = []
    _run(False, grant_then_end)
    main = threading.main_thread().name
    assert seen == [("grant_lease", main), ("end_lease", main)]


def traced_on(seen: list[tuple[str, str]], name: str, fn: Any) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        seen.append((name, threading.current_thread().name))
        return fn(*args, **kwargs)

    return run


def test_a_round_waits_for_no_online_check_in_flight() -> None:
    # A check's recomputation (tens of ms on a GPU at batch 32) runs on its own thread,
    # outside the pool's lock: a round sent meanwhile is answered while it still runs.
    client = LocalWorkerClient("w0", PoolConfig(LAYOUT, num_blocks=16))
    pool = client.worker._pool
    entered, release = threading.Event(), threading.Event()
    recompute = pool.reference_output

    def held(inputs):
        entered.set()
        release.wait(30)
        return recompute(inputs)

    pool.reference_output = held

    async def main() -> None:
        epoch, layer, slots, k, v, q, tables, lens, starts = _step_args(client)
        await client.run_round(Round(epoch, layer, q, tables, lens, starts, slots, k, v))
        check = asyncio.ensure_future(
            client.reference_attend(epoch, layer, q, tables, lens, starts)
        )
        while not entered.is_set():
            await asyncio.sleep(0.01)
        try:
            served = await asyncio.wait_for(
                client.run_round(Round(epoch, layer, q, tables, lens, starts)), 10
            )
        finally:
            release.set()
        ref, bad = await check
        torch.testing.assert_close(served.out, ref.out.to(served.out.dtype))
        assert bad == []

    try:
        asyncio.run(main())
    finally:
        client.close()
