"""The online correctness check through the real server: sampled attention rounds are
recomputed by the workers' torch reference and every slot read is compared with its
write-time fingerprint; mismatches are counted per worker and logged with sequence and
layer. Blocks are corrupted on purpose by writing into a pool behind the service's back."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from typing import Any

import pytest
import torch
from service_support import LAYOUT, Mirror, ServiceHarness, service_config

from cache_service.client import AppendAttendItem, AttendItem, KVCacheClient
from cache_service.config import ConfigError
from cache_service.engine.correctness_check import (
    CorrectnessChecker,
    compare_outputs,
    tolerance_for,
)
from cache_service.engine.worker_clients import LocalWorkerClient
from workers.config import PoolConfig

HQ, HKV, D = 4, LAYOUT.num_kv_heads, LAYOUT.head_dim


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


def fingerprinted_workers(n: int, num_blocks: int) -> list[LocalWorkerClient]:
    config = PoolConfig(LAYOUT, num_blocks=num_blocks, fingerprints=True)
    return [LocalWorkerClient(f"w{i}", config) for i in range(n)]


def mismatches(svc: ServiceHarness, worker_id: str) -> float:
    metrics = svc.service.metrics
    value = metrics.registry.get_sample_value(
        f"{metrics.prefix}_correctness_mismatches_total", {"worker": worker_id}
    )
    return value or 0.0


def fill(client: KVCacheClient, m: Mirror, ids: list[int]) -> None:
    for layer in range(LAYOUT.num_layers):
        k, v, q = rand(len(ids), HKV, D), rand(len(ids), HKV, D), rand(len(ids), HQ, D)
        (out,) = client.append_attend(layer, [AppendAttendItem(m.seq_id, ids, k, v, q)])
        m.add(layer, k, v)
        ref, _ = m.reference(layer, q)
        assert torch.allclose(out.double(), ref, atol=1e-5)
    m.tokens += ids


def blocks_of(svc: ServiceHarness, seq_id: str, layer: int) -> list[tuple[str, int]]:
    view = svc.call(svc.coordinator.block_manager.attention_view, "default", seq_id, layer)
    return [(seg.worker_id, b) for seg in view.segments for b in seg.block_indices]


def worker(svc: ServiceHarness, worker_id: str) -> LocalWorkerClient:
    return next(w for w in svc.workers if w.worker_id == worker_id)


@pytest.fixture
def svc():
    config = service_config(**{"coordinator.correctness_check_fraction": 1.0})
    with ServiceHarness(config, fingerprinted_workers(2, num_blocks=12)) as harness:
        yield harness


@pytest.fixture
def client(svc):
    with KVCacheClient(svc.address, timeout_s=20) as c:
        yield c


def test_clean_traffic_is_checked_and_never_mismatches(svc, client):
    seqs = []
    for i in range(3):
        m = Mirror(client.create_sequence().seq_id, LAYOUT.num_layers)
        fill(client, m, list(range(10 * i, 10 * i + 7)))
        seqs.append(m)
    fork = client.fork(seqs[0].seq_id)  # shared blocks, then a copy-on-write write
    fm = seqs[0].fork(fork.seq_id)
    fill(client, fm, [99, 98])
    for m in [*seqs, fm]:
        q = rand(2, HQ, D)
        for layer in range(LAYOUT.num_layers):
            (out,) = client.attend(layer, [AttendItem(m.seq_id, q)])
            assert torch.allclose(out.double(), m.reference(layer, q)[0], atol=1e-5)
    svc.checks_finished()  # checks run after their rounds answered
    checker = svc.coordinator.correctness
    # Every worker round was checked (fraction 1.0), none failed.
    assert checker.checks >= 3 * LAYOUT.num_layers + 4 * LAYOUT.num_layers
    assert checker.mismatches == 0 and checker.errors == 0 and checker.discarded == 0
    assert mismatches(svc, "w0") == 0 and mismatches(svc, "w1") == 0
    # Each check is timed in the exported histogram: its count is the number of checks.
    metrics = svc.service.metrics
    timed = metrics.registry.get_sample_value(f"{metrics.prefix}_correctness_check_seconds_count")
    assert timed == checker.checks
    total = metrics.registry.get_sample_value(f"{metrics.prefix}_correctness_check_seconds_sum")
    assert total is not None and total > 0


def test_a_corrupted_block_raises_the_counter_and_logs_sequence_and_layer(svc, client, caplog):
    victim = Mirror(client.create_sequence().seq_id, LAYOUT.num_layers)
    fill(client, victim, list(range(9)))
    bystander = Mirror(client.create_sequence().seq_id, LAYOUT.num_layers)
    fill(client, bystander, list(range(50, 57)))
    layer = 1
    (worker_id, block), *_ = blocks_of(svc, victim.seq_id, layer)
    others = {b for b in blocks_of(svc, bystander.seq_id, layer)}
    assert (worker_id, block) not in others
    svc.checks_finished()  # the fills' checks read the block before it is corrupted
    before = svc.coordinator.correctness.mismatches

    # Garbage into one slot's values of layer 1, bypassing the service.
    pool = worker(svc, worker_id).worker.pool
    pool.data[block, layer, 1, :, 2, :] = 1e3

    q = rand(1, HQ, D)
    with caplog.at_level(logging.ERROR, logger="kvcache.correctness"):
        client.attend(layer, [AttendItem(victim.seq_id, q)])
        svc.checks_finished()
    assert mismatches(svc, worker_id) == 1
    assert svc.coordinator.correctness.mismatches == before + 1
    record = next(r for r in caplog.records if "mismatch" in r.getMessage())
    assert record.layer == layer and record.sequences == [victim.seq_id]
    assert record.bad_slots[worker_id][0][1:] == (block, 2, 1)  # block, offset, value half

    # Layer 0 of the same blocks is intact, and so is the bystander's every layer.
    client.attend(0, [AttendItem(victim.seq_id, q)])
    for lyr in range(LAYOUT.num_layers):
        (out,) = client.attend(lyr, [AttendItem(bystander.seq_id, q)])
        assert torch.allclose(out.double(), bystander.reference(lyr, q)[0], atol=1e-5)
    svc.checks_finished()
    assert mismatches(svc, worker_id) == 1


def test_corruption_in_a_sequence_spread_over_two_workers_blames_the_right_worker():
    config = service_config(**{"coordinator.correctness_check_fraction": 1.0})
    # 6 blocks of 4 slots per worker: a 40-token sequence needs 10 blocks, on both workers.
    with (
        ServiceHarness(config, fingerprinted_workers(2, num_blocks=6)) as svc,
        KVCacheClient(svc.address, timeout_s=20) as client,
    ):
        m = Mirror(client.create_sequence().seq_id, LAYOUT.num_layers)
        ids = list(range(40))
        for layer in range(LAYOUT.num_layers):
            k, v = rand(40, HKV, D), rand(40, HKV, D)
            client.append(m.seq_id, ids, k, v, layer=layer)
            m.add(layer, k, v)
        blocks = blocks_of(svc, m.seq_id, 0)
        assert len({w for w, _ in blocks}) == 2
        q = rand(3, HQ, D)
        (out,) = client.attend(0, [AttendItem(m.seq_id, q)])
        assert torch.allclose(out.double(), m.reference(0, q)[0], atol=1e-5)
        svc.checks_finished()
        assert svc.coordinator.correctness.mismatches == 0
        worker_id, block = blocks[-1]  # the last block: the other worker than the first's
        assert worker_id != blocks[0][0]
        worker(svc, worker_id).worker.pool.data[block, 0, 0, 0, 1, 0] += 5.0
        client.attend(0, [AttendItem(m.seq_id, q)])
        svc.checks_finished()
        assert mismatches(svc, worker_id) == 1
        assert mismatches(svc, blocks[0][0]) == 0


class WrongKernelWorker:
    """A real worker whose attention output is off by 0.1 in one row: a kernel bug as seen
    from outside. Writes, blocks and the reference path are untouched."""

    def __init__(self, inner: LocalWorkerClient) -> None:
        self.inner = inner
        self.worker_id = inner.worker_id

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    async def run_round(self, *args, **kwargs):
        result = await self.inner.run_round(*args, **kwargs)
        result.out[0] += 0.1
        return result

    def close(self) -> None:
        self.inner.close()


def test_a_wrong_kernel_output_is_caught_by_the_reference_path():
    config = service_config(**{"coordinator.correctness_check_fraction": 1.0})
    workers = [WrongKernelWorker(w) for w in fingerprinted_workers(1, num_blocks=8)]
    with (
        ServiceHarness(config, workers) as svc,
        KVCacheClient(svc.address, timeout_s=20) as client,
    ):
        seq = client.create_sequence()
        ids = [1, 2, 3]
        out = client.append_attend(
            0, [AppendAttendItem(seq.seq_id, ids, rand(3, HKV, D), rand(3, HKV, D), rand(3, HQ, D))]
        )
        assert out[0].shape == (3, HQ, D)
        svc.checks_finished()
        assert mismatches(svc, "w0") == 1
        assert svc.coordinator.correctness.mismatches == 1


def test_checking_some_sequences_recomputes_only_those_and_still_catches_corruption():
    config = service_config(
        **{
            "coordinator.correctness_check_fraction": 1.0,
            "coordinator.correctness_check_sequences": 1,
        }
    )
    with (
        ServiceHarness(config, fingerprinted_workers(1, num_blocks=16)) as svc,
        KVCacheClient(svc.address, timeout_s=20) as client,
    ):
        mirrors = []
        for i in range(3):
            m = Mirror(client.create_sequence().seq_id, LAYOUT.num_layers)
            fill(client, m, list(range(10 * i, 10 * i + 6)))
            mirrors.append(m)
        svc.checks_finished()  # the fills' checks
        recomputed: list[int] = []  # sequences per reference call
        w0 = worker(svc, "w0")
        real = w0.reference_attend

        async def spy(epoch: str, layer: int, q: Any, tables: Any, lens: Any, *a: Any, **k: Any):
            recomputed.append(int(lens.shape[0]))
            return await real(epoch, layer, q, tables, lens, *a, **k)

        w0.reference_attend = spy  # type: ignore[method-assign]
        checker = svc.coordinator.correctness
        before = checker.checks
        for _ in range(4):  # rounds of three sequences, one of them checked each time
            q = rand(1, HQ, D)
            for layer in range(LAYOUT.num_layers):
                outs = client.attend(layer, [AttendItem(m.seq_id, q) for m in mirrors])
                for m, out in zip(mirrors, outs, strict=True):
                    assert torch.allclose(out.double(), m.reference(layer, q)[0], atol=1e-5)
        svc.checks_finished()
        assert checker.checks - before == 4 * LAYOUT.num_layers
        assert recomputed and set(recomputed) == {1}
        assert checker.mismatches == 0

        # A corrupted slot of the only sequence of a round is found as before.
        layer = 1
        victim = mirrors[0]
        (worker_id, block), *_ = blocks_of(svc, victim.seq_id, layer)
        worker(svc, worker_id).worker.pool.data[block, layer, 1, :, 2, :] = 1e3
        client.attend(layer, [AttendItem(victim.seq_id, rand(1, HQ, D))])
        svc.checks_finished()
        assert checker.mismatches == 1 and mismatches(svc, worker_id) == 1


class HeldReferenceWorker:
    """A real worker whose next reference recomputation (after `hold`) waits until `go`
    is set: a check still running while the traffic goes on."""

    def __init__(self, inner: LocalWorkerClient) -> None:
        self.inner = inner
        self.worker_id = inner.worker_id
        self.held = threading.Event()  # the held recomputation has started
        self.go = threading.Event()
        self._hold = False

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def hold(self) -> None:
        self._hold, self.go = True, threading.Event()

    async def reference_attend(self, *args, **kwargs):
        if self._hold:
            self._hold = False
            self.held.set()
            await asyncio.to_thread(self.go.wait, 20)
        return await self.inner.reference_attend(*args, **kwargs)

    def close(self) -> None:
        self.inner.close()


@contextlib.contextmanager
def held_service(num_blocks: int):
    """A service checking every round on one HeldReferenceWorker, a client, and a first
    sequence filled on every layer: ``(svc, held worker, client, its Mirror)``."""
    config = service_config(**{"coordinator.correctness_check_fraction": 1.0})
    (held,) = [HeldReferenceWorker(w) for w in fingerprinted_workers(1, num_blocks)]
    with (
        ServiceHarness(config, [held]) as svc,
        KVCacheClient(svc.address, timeout_s=20) as client,
    ):
        first = Mirror(client.create_sequence().seq_id, LAYOUT.num_layers)
        fill(client, first, list(range(7)))
        yield svc, held, client, first


def test_a_check_answers_first_and_is_discarded_when_its_blocks_are_reused():
    # Two blocks in all: the second sequence can only have the first one's blocks.
    with held_service(num_blocks=2) as (svc, held, client, a):
        checker = svc.coordinator.correctness
        svc.checks_finished()
        held.hold()
        q = rand(1, HQ, D)
        (out,) = client.attend(1, [AttendItem(a.seq_id, q)])
        # Answered while its check waits for the worker's recomputation.
        assert held.held.wait(10) and not held.go.is_set()
        assert torch.allclose(out.double(), a.reference(1, q)[0], atol=1e-5)
        client.free(a.seq_id)
        b = Mirror(client.create_sequence().seq_id, LAYOUT.num_layers)
        fill(client, b, list(range(100, 107)))  # other tokens: a's blocks evicted, rewritten
        held.go.set()
        svc.checks_finished()
        # The held check read b's data where a's was: discarded, not a mismatch.
        assert checker.discarded == 1
        assert checker.mismatches == 0 and checker.errors == 0
        assert mismatches(svc, "w0") == 0
        metrics = svc.service.metrics
        name = f"{metrics.prefix}_correctness_checks_discarded_total"
        assert metrics.registry.get_sample_value(name) == 1
        svc.check_integrity()


def test_a_check_whose_sequences_stay_put_is_judged_after_the_answer():
    with held_service(num_blocks=8) as (svc, held, client, a):
        checker = svc.coordinator.correctness
        other = Mirror(client.create_sequence().seq_id, LAYOUT.num_layers)
        fill(client, other, list(range(50, 55)))
        svc.checks_finished()
        before = checker.checks
        held.hold()
        client.attend(0, [AttendItem(a.seq_id, rand(1, HQ, D))])
        assert held.held.wait(10)
        # Another sequence freed meanwhile: its blocks are not the check's.
        client.free(other.seq_id)
        (worker_id, block), *_ = blocks_of(svc, a.seq_id, 0)
        worker(svc, worker_id).worker.pool.data[block, 0, 0, :, 1, :] = 7.0
        held.go.set()
        svc.checks_finished()
        # The corruption landed before the held recomputation read the block: a mismatch.
        assert checker.checks == before + 1 and checker.discarded == 0
        assert checker.mismatches == 1 and mismatches(svc, worker_id) == 1


def test_fraction_zero_disables_the_check_and_sampling_follows_the_fraction():
    assert service_config().coordinator.correctness_check_fraction == 0.01
    off = service_config(**{"coordinator.correctness_check_fraction": 0.0})
    with ServiceHarness(off, fingerprinted_workers(1, num_blocks=8)) as svc:
        assert svc.coordinator.correctness is None
    checker = CorrectnessChecker(0.25, torch.float32, seed=7)
    hits = sum(checker.sample() for _ in range(4000))
    assert 850 < hits < 1150
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        CorrectnessChecker(1.5, torch.float32)
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="sequences must be a positive int"):
            CorrectnessChecker(0.5, torch.float32, sequences=bad)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="correctness_check_sequences"):
            service_config(**{"coordinator.correctness_check_sequences": bad})


def test_compare_outputs_tolerance_follows_the_dtype():
    ref = torch.randn(5, 4, 8)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        atol, _ = tolerance_for(dtype)
        close = ref + atol / 4
        assert compare_outputs(close, ref, dtype)[1] == []
        far = ref.clone()
        far[3, 1, 2] += 50 * atol
        err, rows = compare_outputs(far, ref, dtype)
        assert rows == [3] and err == pytest.approx(50 * atol, rel=1e-3)
    nan = ref.clone()
    nan[1, 0, 0] = float("nan")
    assert compare_outputs(nan, ref, torch.float32)[1] == [1]
    with pytest.raises(ValueError, match="shape"):
        compare_outputs(ref[:2], ref, torch.float32)
