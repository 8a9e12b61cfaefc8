"""The coordinator's adaptive batching window (`engine.batching.Batcher`).

A lone caller must not wait for the window; calls that overlap must still share one worker
call. The batcher tests drive a fake clock: a window "passes" only when the test fires its
timer, so nothing here depends on how fast the machine is.
"""

from __future__ import annotations

import asyncio
import functools
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from service_support import HQ, LAYOUT, dense_attention

import cache_service.engine.rounds as rounds_module
from cache_service.config import CoordinatorConfig
from cache_service.engine.batching import Batcher, Part
from cache_service.engine.coordinator import AppendAttendItem, Coordinator
from cache_service.engine.worker_clients import LocalWorkerClient, RayWorkerClient
from workers.config import PoolConfig

HKV, D = LAYOUT.num_kv_heads, LAYOUT.head_dim
KEY = (0, "w0", HQ)


class FakeTimer:
    def __init__(self, delay: float, callback: Callable[[], None]) -> None:
        self.delay = delay
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeClock:
    """`call_later` whose timers fire only when the test says the window has passed."""

    def __init__(self) -> None:
        self.timers: list[FakeTimer] = []

    def call_later(self, delay: float, callback: Callable[[], None]) -> FakeTimer:
        timer = FakeTimer(delay, callback)
        self.timers.append(timer)
        return timer

    def armed(self) -> list[FakeTimer]:
        return [t for t in self.timers if not t.cancelled]

    def pass_window(self) -> None:
        due, self.timers = self.armed(), []
        for timer in due:
            timer.callback()


class Worker:
    """The batcher's `run`: records each batch's sequence ids and holds the batch "on the
    worker" until the test lets it finish."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.gates: list[asyncio.Event] = []

    async def run(self, key: Any, parts: list[Part]) -> None:
        self.batches.append([s for p in parts for s in p.seq_ids])
        gate = asyncio.Event()
        self.gates.append(gate)
        await gate.wait()

    async def finish(self, index: int) -> None:
        self.gates[index].set()
        for _ in range(3):  # the task ends, its done-callback runs
            await asyncio.sleep(0)


def part(*seq_ids: str, origin: int | None = None) -> Part:
    return Part(
        views=[],
        num_queries=[1] * len(seq_ids),
        seq_ids=list(seq_ids),
        query=torch.empty(0),
        writes={},
        return_lse=False,
        origin=origin,
    )


def make(
    window_s: float = 0.5, max_items: int = 64, overlap: bool = False
) -> tuple[Batcher, Worker, FakeClock]:
    worker, clock = Worker(), FakeClock()
    batcher = Batcher(
        KEY, window_s, max_items, worker.run, call_later=clock.call_later, overlap=overlap
    )
    return batcher, worker, clock


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


def test_a_lone_part_leaves_at_once_without_opening_a_window() -> None:
    async def scenario() -> None:
        batcher, worker, clock = make()
        for i in range(5):  # one caller, one call after the other
            batcher.submit(part(f"s{i}"))
            await settle()
            assert worker.batches[-1] == [f"s{i}"]
            assert clock.timers == []  # no window was ever opened
            await worker.finish(i)
        assert len(worker.batches) == 5
        assert not batcher.windowed

    asyncio.run(scenario())


def test_parts_arriving_during_a_batch_gather_and_the_window_comes_back() -> None:
    async def scenario() -> None:
        batcher, worker, clock = make()
        batcher.submit(part("a"))  # lone: on the worker at once
        await settle()
        assert worker.batches == [["a"]]
        batcher.submit(part("b"))
        batcher.submit(part("c"))
        await settle()
        # Both wait for the batch in flight and for the window opened by "b".
        assert worker.batches == [["a"]]
        assert len(clock.armed()) == 1
        await worker.finish(0)
        assert worker.batches == [["a"]]  # "a" is back, the window has not passed
        clock.pass_window()
        await settle()
        assert worker.batches == [["a"], ["b", "c"]]  # one worker call for both
        await worker.finish(1)

        # That batch was shared: the next part at an idle batcher waits for company.
        assert batcher.windowed
        batcher.submit(part("d"))
        await settle()
        assert worker.batches == [["a"], ["b", "c"]]
        assert len(clock.armed()) == 1
        batcher.submit(part("e"))
        clock.pass_window()
        await settle()
        assert worker.batches[-1] == ["d", "e"]
        await worker.finish(2)

    asyncio.run(scenario())


def test_lone_traffic_after_shared_batches_drops_the_window_again() -> None:
    async def scenario() -> None:
        batcher, worker, clock = make()
        batcher.submit(part("a"))
        await settle()
        batcher.submit(part("b"))
        await worker.finish(0)
        clock.pass_window()
        await settle()
        await worker.finish(1)
        assert batcher.windowed
        waited = []
        for i in range(6):
            batcher.submit(part(f"lone{i}"))
            await settle()
            if clock.armed():  # it waited for the window, alone
                waited.append(i)
                clock.pass_window()
                await settle()
            assert worker.batches[-1] == [f"lone{i}"]
            await worker.finish(len(worker.batches) - 1)
        # The first lone calls still wait (the traffic might be concurrent), then not.
        assert waited and waited == list(range(len(waited)))
        assert len(waited) <= 3
        assert not batcher.windowed

    asyncio.run(scenario())


def test_once_everyone_of_the_last_rounds_is_there_the_batch_leaves_without_the_window():
    async def scenario() -> None:
        batcher, worker, clock = make()
        batcher.submit(part("a"))  # lone: leaves at once
        await settle()
        for name in ("b", "c"):  # two more clients arrive while it is in flight
            batcher.submit(part(name))
        await worker.finish(0)
        clock.pass_window()  # they wait for their window
        await settle()
        assert worker.batches[-1] == ["b", "c"]
        await worker.finish(1)
        # The next round: the three callers of the last two batches, no window needed.
        for name in ("a", "b", "c"):
            batcher.submit(part(name))
        await settle()
        assert worker.batches[-1] == ["a", "b", "c"]
        assert clock.armed() == []
        # Arriving while that round is on the worker: they leave when it is back.
        for name in ("a", "b", "c"):
            batcher.submit(part(name))
        await settle()
        assert len(worker.batches) == 3
        await worker.finish(2)
        await settle()
        assert len(worker.batches) == 4 and clock.armed() == []
        await worker.finish(3)
        # One client fell behind: the two others wait for the window, as before.
        batcher.submit(part("a"))
        batcher.submit(part("b"))
        await settle()
        assert len(worker.batches) == 4
        assert len(clock.armed()) == 1
        clock.pass_window()
        await settle()
        assert worker.batches[-1] == ["a", "b"]
        await worker.finish(4)

    asyncio.run(scenario())


def test_a_caller_that_leaves_holds_the_others_for_two_windows_at_most() -> None:
    async def scenario() -> None:
        batcher, worker, clock = make()
        batcher.submit(part("a"))
        await settle()
        for name in ("b", "c"):
            batcher.submit(part(name))
        await worker.finish(0)
        clock.pass_window()
        await settle()
        await worker.finish(1)
        # "c" is gone: "a" and "b" wait for it through two windows, then no longer.
        windows = 0
        for _ in range(4):
            batcher.submit(part("a"))
            batcher.submit(part("b"))
            await settle()
            if clock.armed():
                windows += 1
                clock.pass_window()
                await settle()
            assert worker.batches[-1] == ["a", "b"]
            await worker.finish(len(worker.batches) - 1)
        assert windows == 2
        # Without "c", "a" and "b" leave without a window; "c", back, waits for its own...
        batcher.submit(part("a"))
        batcher.submit(part("b"))
        await settle()
        assert worker.batches[-1] == ["a", "b"] and clock.armed() == []
        batcher.submit(part("c"))
        await worker.finish(len(worker.batches) - 1)
        clock.pass_window()
        await settle()
        assert worker.batches[-1] == ["c"]
        await worker.finish(len(worker.batches) - 1)
        # ...and is expected again: the three are one round.
        for name in ("c", "a", "b"):
            batcher.submit(part(name))
        await settle()
        assert worker.batches[-1] == ["c", "a", "b"] and clock.armed() == []
        await worker.finish(len(worker.batches) - 1)

    asyncio.run(scenario())


async def _split_into_two_groups(batcher: Batcher, worker: Worker, clock: FakeClock) -> None:
    """Callers a, b, c, d seen together, then "a" and "b" on the worker (after their
    window) while "c" and "d" wait, their window passed."""
    batcher.submit(part("a"))
    await settle()
    for name in ("b", "c", "d"):
        batcher.submit(part(name))
    await worker.finish(0)
    clock.pass_window()
    await settle()
    assert worker.batches[-1] == ["b", "c", "d"]
    await worker.finish(1)
    for name in ("a", "b", "c", "d"):
        batcher.submit(part(name))
    await settle()
    assert worker.batches[-1] == ["a", "b", "c", "d"]
    # "c" and "d" come late: "a" and "b" leave after their window...
    batcher.submit(part("a"))
    batcher.submit(part("b"))
    await worker.finish(2)
    clock.pass_window()
    await settle()
    assert worker.batches[-1] == ["a", "b"]
    # ...and "c" and "d" arrive while that batch is on the worker; their window passes.
    batcher.submit(part("c"))
    batcher.submit(part("d"))
    clock.pass_window()
    await settle()
    assert len(worker.batches) == 4


def test_two_groups_of_callers_that_drifted_apart_merge_into_one_batch() -> None:
    async def scenario() -> None:
        batcher, worker, clock = make()
        await _split_into_two_groups(batcher, worker, clock)
        # "a" and "b" come back: "c" and "d" wait one more window for them instead of
        # taking their own turn on the worker, and all four leave together at once.
        await worker.finish(3)
        await settle()
        assert len(worker.batches) == 4 and len(clock.armed()) == 1
        batcher.submit(part("a"))
        batcher.submit(part("b"))
        await settle()
        assert worker.batches[-1] == ["c", "d", "a", "b"]
        assert clock.armed() == []
        await worker.finish(4)
        # From then on the four call in step: one batch a round, no window.
        for name in ("a", "b", "c", "d"):
            batcher.submit(part(name))
        await settle()
        assert worker.batches[-1] == ["a", "b", "c", "d"] and clock.armed() == []
        await worker.finish(5)

    asyncio.run(scenario())


def test_the_extra_window_for_returning_callers_is_given_once() -> None:
    async def scenario() -> None:
        batcher, worker, clock = make()
        await _split_into_two_groups(batcher, worker, clock)
        await worker.finish(3)
        await settle()
        clock.pass_window()  # "a" and "b" do not come back in time: "c" and "d" go alone
        await settle()
        assert worker.batches[-1] == ["c", "d"]
        await worker.finish(4)

    asyncio.run(scenario())


async def _callers_seen(
    batcher: Batcher, worker: Worker, clock: FakeClock, names: str = "abcdefgh"
) -> None:
    """Callers `names` seen in the last two batches (the first alone, then the others)."""
    batcher.submit(part(names[0]))
    await settle()
    for name in names[1:]:
        batcher.submit(part(name))
    await worker.finish(0)
    clock.pass_window()
    await settle()
    assert worker.batches[-1] == list(names[1:])
    await worker.finish(1)


def test_with_overlap_callers_in_step_take_turns_in_two_groups() -> None:
    async def scenario() -> None:
        batcher, worker, clock = make(overlap=True)
        await _callers_seen(batcher, worker, clock)
        for name in "abc":
            batcher.submit(part(name))
        await settle()
        assert len(worker.batches) == 2
        batcher.submit(part("d"))  # half the parts expected, nothing in flight: they go
        await settle()
        assert worker.batches[-1] == list("abcd")
        for name in "efg":
            batcher.submit(part(name))
        await settle()
        assert len(worker.batches) == 3
        batcher.submit(part("h"))  # everyone not on the worker is here: they go too
        await settle()
        assert worker.batches[-1] == list("efgh")
        # The first group comes back while the second is on the worker, and so on.
        for turn in range(4):
            await worker.finish(len(worker.batches) - 2)
            group = "abcd" if turn % 2 == 0 else "efgh"
            for name in group[:3]:
                batcher.submit(part(name))
            await settle()
            assert worker.batches[-1] != list(group)
            batcher.submit(part(group[3]))
            await settle()
            assert worker.batches[-1] == list(group)
        assert clock.armed() == []  # no group waited for a window

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("overlap", "names"),
    [(False, "abcdefgh"), (True, "abc")],
    ids=["no-overlap", "overlap-under-four-parts"],
)
def test_callers_in_step_share_one_batch_without_overlap(overlap: bool, names: str) -> None:
    # Without overlap, or with fewer than four parts expected, everyone waits for the
    # last caller and they leave as one batch.
    async def scenario() -> None:
        batcher, worker, clock = make(overlap=overlap)
        await _callers_seen(batcher, worker, clock, names)
        for name in names[:-1]:
            batcher.submit(part(name))
        await settle()
        assert len(worker.batches) == 2
        batcher.submit(part(names[-1]))
        await settle()
        assert worker.batches[-1] == list(names)

    asyncio.run(scenario())


def test_a_client_alternating_between_two_batches_is_one_caller() -> None:
    # Two clients, each alternating between two batches of sequences (each call waits for
    # the one before): by sequence they would be four callers, two of them never pending;
    # by connection they are two, both there every round.
    async def scenario() -> None:
        batcher, worker, clock = make()
        batcher.submit(part("a1", origin=1))  # lone: leaves at once
        await settle()
        batcher.submit(part("b1", origin=2))
        await worker.finish(0)
        clock.pass_window()
        await settle()
        await worker.finish(1)
        for round_ in range(4):
            suffix = "2" if round_ % 2 == 0 else "1"
            batcher.submit(part("a" + suffix, origin=1))
            batcher.submit(part("b" + suffix, origin=2))
            await settle()
            assert worker.batches[-1] == ["a" + suffix, "b" + suffix]
            assert clock.armed() == []
            await worker.finish(len(worker.batches) - 1)

    asyncio.run(scenario())


def test_threads_sharing_one_connection_are_one_caller_with_several_parts() -> None:
    async def scenario() -> None:
        batcher, worker, clock = make()
        batcher.submit(part("w", origin=7))  # lone: leaves at once
        await settle()
        for name in ("t0", "t1", "t2"):  # three threads of that connection meanwhile
            batcher.submit(part(name, origin=7))
        await worker.finish(0)
        clock.pass_window()
        await settle()
        assert worker.batches[-1] == ["t0", "t1", "t2"]
        await worker.finish(1)
        # The connection sent three parts last round: two pending are not everyone...
        batcher.submit(part("t0", origin=7))
        batcher.submit(part("t1", origin=7))
        await settle()
        assert len(worker.batches) == 2 and len(clock.armed()) == 1
        # ...the third is, and the batch leaves without its window.
        batcher.submit(part("t2", origin=7))
        await settle()
        assert worker.batches[-1] == ["t0", "t1", "t2"] and len(worker.batches) == 3
        assert clock.armed() == []
        await worker.finish(2)

    asyncio.run(scenario())


def test_a_full_batch_leaves_at_once_even_with_one_in_flight() -> None:
    async def scenario() -> None:
        batcher, worker, clock = make(window_s=3600.0, max_items=3)
        batcher.submit(part("a"))
        await settle()
        batcher.submit(part("b"))
        batcher.submit(part("c", "d"))
        await settle()
        assert worker.batches == [["a"], ["b", "c", "d"]]
        assert clock.armed() == []
        await worker.finish(0)
        await worker.finish(1)

    asyncio.run(scenario())


def test_a_lone_caller_of_the_coordinator_never_opens_a_window(monkeypatch) -> None:
    """Every batcher the coordinator makes gets a clock that records each window it is
    asked for (and lets it pass at once, so a wrong answer fails instead of hanging): one
    caller's calls ask for none, and each is one worker call with the right output."""
    windows: list[float] = []

    def call_later(delay: float, callback: Callable[[], None]) -> Any:
        windows.append(delay)
        return asyncio.get_running_loop().call_soon(callback)

    monkeypatch.setattr(rounds_module, "Batcher", functools.partial(Batcher, call_later=call_later))

    async def scenario() -> None:
        worker = LocalWorkerClient("w0", PoolConfig(LAYOUT, num_blocks=32))
        calls = 0
        inner = worker.run_round

        async def counted(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            return await inner(*args, **kwargs)

        worker.run_round = counted  # type: ignore[method-assign]
        coord = Coordinator(LAYOUT, [worker], CoordinatorConfig(batch_window_ms=3_600_000.0))
        await coord.start()
        try:
            seq = (await coord.create_sequence("t")).seq_id
            gen = torch.Generator().manual_seed(0)
            keys: dict[int, list[torch.Tensor]] = {}
            for token in range(3):
                for layer in range(LAYOUT.num_layers):
                    k = torch.randn(1, HKV, D, generator=gen)
                    q = torch.randn(1, HQ, D, generator=gen)
                    item = AppendAttendItem(seq, [token], k, k, q)
                    (res,) = await coord.append_attend("t", layer, [item])
                    keys.setdefault(layer, []).append(k)
                    kk = torch.cat(keys[layer])
                    ref, _ = dense_attention(q.double(), kk.double(), kk.double())
                    assert torch.allclose(res.out.double(), ref, atol=1e-5)
            assert calls == 3 * LAYOUT.num_layers
            assert windows == []
            assert coord._rounds.batchers and not any(
                b.windowed for b in coord._rounds.batchers.values()
            )
        finally:
            await coord.close()
            worker.close()

    asyncio.run(scenario())


def test_calls_for_different_layers_that_overlap_share_one_worker_call() -> None:
    # Clients decoding layer by layer are rarely at the same layer at once: with
    # coalesce_layers (the default) calls for different layers that gather while another
    # is on the worker leave as one call over pages of every layer.
    import threading

    from service_support import Recording

    async def scenario(coalesce: bool) -> Counter:
        hold = threading.Event()
        worker = Recording(
            LocalWorkerClient("w0", PoolConfig(LAYOUT, num_blocks=32)), hold_first=hold
        )
        config = CoordinatorConfig(coalesce_layers=coalesce, correctness_check_fraction=0.0)
        coord = Coordinator(LAYOUT, [worker], config)
        await coord.start()
        try:
            seqs = [(await coord.create_sequence("t")).seq_id for _ in range(3)]
            gen = torch.Generator().manual_seed(5)
            kv = {}

            def item(i: int) -> AppendAttendItem:
                k = torch.randn(1, HKV, D, generator=gen)
                kv[i] = (k, torch.randn(1, HQ, D, generator=gen))
                return AppendAttendItem(seqs[i], [i], k, k, kv[i][1])

            # The first call holds the worker; the other two (layers 1 and 0) gather.
            first = asyncio.create_task(coord.append_attend("t", 0, [item(0)]))
            while not worker.calls:
                await asyncio.sleep(0.001)
            rest = [
                asyncio.create_task(coord.append_attend("t", 1, [item(1)])),
                asyncio.create_task(coord.append_attend("t", 0, [item(2)])),
            ]
            await asyncio.sleep(0.05)
            hold.set()
            results = [await first] + [await t for t in rest]
            for i, (res,) in enumerate(results):
                k, q = kv[i]
                ref, _ = dense_attention(q.double(), k.double(), k.double())
                assert torch.allclose(res.out.double(), ref, atol=1e-5)
            for s, layer in zip(seqs, (0, 1, 0), strict=True):
                written = coord.block_manager.sequence_info("t", s).written
                assert written[layer] == 1 and sum(written) == 1
            coord.block_manager.check_integrity()
            return worker.calls
        finally:
            await coord.close()
            worker.close()

    merged = asyncio.run(scenario(True))
    assert merged == {"run_round": 2, "one_layer": 1, "over_layers": 1}
    separate = asyncio.run(scenario(False))
    assert separate == {"run_round": 3, "one_layer": 3}


def test_a_round_over_pages_of_recorded_steps_is_planned_once(monkeypatch) -> None:
    # Two callers' recorded steps meet in rounds over pages (each at another layer) twice:
    # the second round reuses the first one's plan, as rounds on one layer do, and every
    # output is still the dense attention of its sequence.
    import dataclasses
    import threading

    from service_support import Mirror, Recording

    planned: list[int] = []
    real_plan = rounds_module.plan_attention

    def counted(views: Any, nq: Any, *args: Any, **kwargs: Any) -> Any:
        planned.append(len(views))
        return real_plan(views, nq, *args, **kwargs)

    monkeypatch.setattr(rounds_module, "plan_attention", counted)

    layout = dataclasses.replace(LAYOUT, num_layers=4)

    async def scenario() -> tuple[list[int], Counter]:
        worker = Recording(LocalWorkerClient("w0", PoolConfig(layout, num_blocks=32)))
        config = CoordinatorConfig(correctness_check_fraction=0.0)
        coord = Coordinator(layout, [worker], config)
        await coord.start()
        gen = torch.Generator().manual_seed(9)
        try:
            mirrors = [
                Mirror((await coord.create_sequence("t")).seq_id, layout.num_layers)
                for _ in range(3)
            ]

            async def call(i: int, layer: int) -> None:
                m = mirrors[i]
                k, v = torch.randn(1, HKV, D, generator=gen), torch.randn(1, HKV, D)
                q = torch.randn(1, HQ, D, generator=gen)
                (res,) = await coord.append_attend(
                    "t", layer, [AppendAttendItem(m.seq_id, [7], k, v, q)]
                )
                m.add(layer, k, v)
                ref, _ = m.reference(layer, q.double())
                assert torch.allclose(res.out.double(), ref, atol=1e-5), (i, layer)

            for i in range(3):  # layer 0 of the step, alone: each caller's step recorded
                await call(i, 0)
            rounds = []
            for a_layer, b_layer in ((1, 2), (2, 1)):
                # Caller 2 holds the worker; callers 0 and 1 gather meanwhile, each at
                # another layer: one round over pages.
                hold = threading.Event()
                worker.hold_first, worker.batch_sizes = hold, []
                holder = asyncio.create_task(call(2, a_layer))
                while not worker.batch_sizes:
                    assert not holder.done(), holder.result()
                    await asyncio.sleep(0.001)
                before = len(planned)
                gathered = [
                    asyncio.create_task(call(0, a_layer)),
                    asyncio.create_task(call(1, b_layer)),
                ]
                await asyncio.sleep(0.05)
                hold.set()
                await asyncio.gather(holder, *gathered)
                rounds.append(len(planned) - before)
            coord.block_manager.check_integrity()
            return rounds, worker.calls
        finally:
            await coord.close()
            worker.close()

    rounds, calls = asyncio.run(scenario())
    assert calls["over_layers"] == 2
    assert rounds == [1, 0]  # planned on the first meeting only


def test_overlap_is_on_by_default_for_workers_in_another_process_only() -> None:
    class OtherProcess(LocalWorkerClient):
        out_of_process = True  # what RayWorkerClient says

    async def scenario(overlap: bool | None) -> dict[str, bool]:
        workers = [
            LocalWorkerClient("near", PoolConfig(LAYOUT, num_blocks=8)),
            OtherProcess("far", PoolConfig(LAYOUT, num_blocks=8)),
        ]
        config = CoordinatorConfig(overlap_rounds=overlap, correctness_check_fraction=0.0)
        coord = Coordinator(LAYOUT, workers, config)
        await coord.start()
        try:
            return {
                w.worker_id: coord._rounds.batcher(0, w.worker_id, HQ)._overlap for w in workers
            }
        finally:
            await coord.close()
            for w in workers:
                w.close()

    assert RayWorkerClient.out_of_process and not LocalWorkerClient.out_of_process
    assert asyncio.run(scenario(None)) == {"near": False, "far": True}
    assert asyncio.run(scenario(True)) == {"near": True, "far": True}
    assert asyncio.run(scenario(False)) == {"near": False, "far": False}


def test_two_groups_in_flight_on_one_worker_answer_every_caller_correctly() -> None:
    # Eight callers in step on one worker whose calls take a while off the event loop (as
    # a Ray actor's do): with overlap the second group's round goes while the first is
    # still on the worker, and every output is still the dense attention of its sequence.
    from service_support import Mirror, Recording

    async def scenario() -> int:
        worker = Recording(LocalWorkerClient("w0", PoolConfig(LAYOUT, num_blocks=64)), 0.02)
        config = CoordinatorConfig(overlap_rounds=True, correctness_check_fraction=0.0)
        coord = Coordinator(LAYOUT, [worker], config)
        flying, most = [0], [0]
        run_parts = coord._rounds.run_parts

        async def counted(key: Any, parts: list[Part]) -> None:
            flying[0] += 1
            most[0] = max(most[0], flying[0])
            try:
                await run_parts(key, parts)
            finally:
                flying[0] -= 1

        coord._rounds.run_parts = counted  # type: ignore[method-assign]
        await coord.start()
        try:

            async def client(i: int) -> None:
                gen = torch.Generator().manual_seed(100 + i)
                m = Mirror((await coord.create_sequence("t")).seq_id, LAYOUT.num_layers)
                for step in range(6):
                    for layer in range(LAYOUT.num_layers):
                        k, v = torch.randn(1, HKV, D, generator=gen), torch.randn(1, HKV, D)
                        q = torch.randn(1, HQ, D, generator=gen)
                        item = AppendAttendItem(m.seq_id, [step], k, v, q)
                        (res,) = await coord.append_attend("t", layer, [item])
                        m.add(layer, k, v)
                        ref, _ = m.reference(layer, q.double())
                        assert torch.allclose(res.out.double(), ref, atol=1e-5), (i, step, layer)
                await coord.free("t", m.seq_id)

            await asyncio.gather(*(client(i) for i in range(8)))
            coord.block_manager.check_integrity()
            stats = coord.block_manager.stats()
            assert stats.active_sequences == 0 and all(w.used == 0 for w in stats.workers.values())
            assert all(b._overlap for b in coord._rounds.batchers.values())
            return most[0]
        finally:
            await coord.close()
            worker.close()

    assert asyncio.run(scenario()) >= 2


def test_a_round_answered_with_other_rows_fails_every_caller_and_keeps_nothing() -> None:
    # Each caller's rows of a round are cut from the worker's answer in one split; an
    # answer whose rows are not the round's (a worker bug) must fail every caller of the
    # round with a message (the plan's check), not hand anyone another sequence's rows,
    # and keep no write.
    async def scenario() -> None:
        worker = LocalWorkerClient("w0", PoolConfig(LAYOUT, num_blocks=32))

        def shortened(inner: Any) -> Any:
            async def short(*args: Any, **kwargs: Any) -> Any:
                result = await inner(*args, **kwargs)
                lse = None if result.lse is None else result.lse[:-1]
                return type(result)(result.out[:-1], lse)

            return short

        config = CoordinatorConfig(batch_window_ms=50.0, correctness_check_fraction=0.0)
        coord = Coordinator(LAYOUT, [worker], config)
        await coord.start()
        try:
            seqs = [(await coord.create_sequence("t")).seq_id for _ in range(2)]
            gen = torch.Generator().manual_seed(3)

            def item(seq: str) -> AppendAttendItem:
                k = torch.randn(1, HKV, D, generator=gen)
                return AppendAttendItem(seq, [1], k, k, torch.randn(1, HQ, D, generator=gen))

            # One good call first, so the batcher expects both callers and they share rounds.
            await asyncio.gather(*(coord.append_attend("t", 0, [item(s)]) for s in seqs))
            worker.run_round = shortened(worker.run_round)  # type: ignore[method-assign]
            outcome = await asyncio.gather(
                *(coord.append_attend("t", 1, [item(s)]) for s in seqs), return_exceptions=True
            )
            for error in outcome:
                assert isinstance(error, Exception), error
                assert "returned 1 rows, the plan has 2" in str(error)
            for s in seqs:
                assert coord.block_manager.sequence_info("t", s).written[1] == 0
            coord.block_manager.check_integrity()
        finally:
            await coord.close()
            worker.close()

    asyncio.run(scenario())
