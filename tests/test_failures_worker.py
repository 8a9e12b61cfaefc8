"""Worker death in the running service: real Ray CPU workers, the real gRPC server on a
loopback port, several clients in the middle of traffic.

A worker killed with ``ray.kill(no_restart=False)`` during traffic, then another one killed
with SIGKILL while idle, must be noticed within seconds (failed calls, the epoch probe);
the sequences with blocks there answer DATA_LOSS telling the client to recompute (and do,
after recomputing); every other call keeps returning the dense-reference result; the
restarted worker comes back with a new epoch and its capacity returns; check_integrity
holds and, once everything is freed, no block is in use.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field

import pytest
import torch
from service_support import LAYOUT, Mirror, ServiceHarness, service_config

from cache_service.client import (
    AppendAttendItem,
    AttendItem,
    DataLossError,
    KVCacheClient,
    KVCacheError,
)

ray = pytest.importorskip("ray")

from workers.ray_startup import start_local_ray  # noqa: E402

HQ, HKV, D = 4, LAYOUT.num_kv_heads, LAYOUT.head_dim
BLOCKS = 64
NAMESPACE = f"kvcache-failures-{uuid.uuid4().hex[:8]}"
PREFIX = "fail-worker-"


@pytest.fixture(scope="module")
def svc():
    # Ray wants the main thread for init; the service then finds it connected.
    start_local_ray(NAMESPACE, num_cpus=2)
    config = service_config(
        **{
            "workers.in_process": False,
            "workers.num_workers": 2,
            "workers.blocks_per_worker": BLOCKS,
            "workers.namespace": NAMESPACE,
            "workers.name_prefix": PREFIX,
            "workers.max_restarts": -1,
            "coordinator.health_check_interval_s": 0.5,
            "coordinator.correctness_check_fraction": 0.25,
        }
    )
    try:
        with ServiceHarness(config) as harness:
            yield harness
    finally:
        ray.shutdown()


def worker_states(svc: ServiceHarness) -> dict[str, object]:
    return {w.worker_id: w for w in svc.call(svc.coordinator.workers)}


def wait_for(predicate, timeout_s: float, what: str) -> float:
    """Poll until predicate() holds; returns the seconds it took."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"{what} did not happen within {timeout_s} s")
        time.sleep(0.02)
    return time.monotonic() - t0


def noticed(svc: ServiceHarness, worker_id: str, old_epoch: str) -> bool:
    """The coordinator dropped the worker (down), or already took it back with a new epoch
    (a quick restart can make the down state too short to observe)."""
    state = worker_states(svc)[worker_id]
    return not state.up or state.epoch != old_epoch


def back_up(svc: ServiceHarness, worker_id: str, old_epoch: str) -> bool:
    state = worker_states(svc)[worker_id]
    return state.up and state.epoch != old_epoch


def placement(svc: ServiceHarness, seq_ids: list[str]) -> dict[str, tuple[str, ...]]:
    """Workers holding blocks of each (live) sequence, read on the coordinator's loop."""

    def read() -> dict[str, tuple[str, ...]]:
        out = {}
        for s in seq_ids:
            try:
                out[s] = svc.coordinator.block_manager.sequence_info("default", s).workers
            except Exception:  # freed or lost meanwhile
                pass
        return out

    return svc.call(read)


@dataclass
class Traffic:
    """One client thread: one sequence at a time, decode steps on every layer, each output
    checked against dense attention over the client's own copy of the K/V. On DATA_LOSS it
    frees the sequence and recomputes it (a new sequence, the whole history appended)."""

    address: str
    name: str
    stop: threading.Event
    steps: int = 0
    data_loss: list[tuple[str, str]] = field(default_factory=list)  # (seq id, message)
    unexpected: list[BaseException] = field(default_factory=list)
    recomputed: int = 0
    seq_ids: list[str] = field(default_factory=list)
    mirror: Mirror | None = None

    def run(self) -> None:
        gen = torch.Generator().manual_seed(hash(self.name) % 2**31)
        try:
            with KVCacheClient(self.address, timeout_s=60) as client:
                self.mirror = self._new(client, None)
                while not self.stop.is_set():
                    try:
                        self._step(client, gen)
                    except DataLossError as exc:
                        self.data_loss.append((self.mirror.seq_id, exc.message))
                        client.free(self.mirror.seq_id)
                        self.mirror = self._new(client, self.mirror)
                        self.recomputed += 1
                client.free(self.mirror.seq_id)
        except BaseException as exc:  # reported by the test
            self.unexpected.append(exc)

    def _new(self, client: KVCacheClient, old: Mirror | None) -> Mirror:
        m = Mirror(client.create_sequence().seq_id, LAYOUT.num_layers)
        self.seq_ids.append(m.seq_id)
        if old is not None and old.tokens:  # recompute: the whole history, every layer
            # The failed step may have written some layers: keep the complete tokens only.
            n = len(old.tokens)
            k = torch.stack([torch.cat(old.k[layer])[:n] for layer in range(LAYOUT.num_layers)])
            v = torch.stack([torch.cat(old.v[layer])[:n] for layer in range(LAYOUT.num_layers)])
            client.append(m.seq_id, old.tokens, k, v)
            m.tokens = list(old.tokens)
            m.k = [[k[layer]] for layer in range(LAYOUT.num_layers)]
            m.v = [[v[layer]] for layer in range(LAYOUT.num_layers)]
        return m

    def _step(self, client: KVCacheClient, gen: torch.Generator) -> None:
        m = self.mirror
        if len(m.tokens) > 40:  # keep sequences small: no spill onto the other worker
            client.free(m.seq_id)
            self.mirror = m = self._new(client, None)
        token = len(m.tokens) + 1
        for layer in range(LAYOUT.num_layers):
            k = torch.randn(1, HKV, D, generator=gen)
            v = torch.randn(1, HKV, D, generator=gen)
            q = torch.randn(1, HQ, D, generator=gen)
            (out,) = client.append_attend(layer, [AppendAttendItem(m.seq_id, [token], k, v, q)])
            m.add(layer, k, v)
            ref, _ = m.reference(layer, q)
            if not torch.allclose(out.double(), ref, atol=1e-5):
                raise AssertionError(f"{self.name}: wrong attention output on layer {layer}")
        m.tokens.append(token)
        self.steps += 1


def pid_of(svc: ServiceHarness, worker_id: str) -> int:
    handle = svc.coordinator._clients[worker_id].handle
    return ray.get(handle.__ray_call__.remote(lambda self: os.getpid()), timeout=30)


def test_a_worker_killed_mid_traffic_fails_only_its_sequences_and_comes_back(svc):
    w0, w1 = f"{PREFIX}0", f"{PREFIX}1"
    before = worker_states(svc)
    assert before[w0].up and before[w1].up
    stop = threading.Event()
    traffic = [Traffic(svc.address, f"client-{i}", stop) for i in range(4)]
    threads = [threading.Thread(target=t.run, daemon=True) for t in traffic]
    for t in threads:
        t.start()
    wait_for(lambda: all(t.steps >= 3 for t in traffic), 60, "warm-up traffic")
    live = [t.mirror.seq_id for t in traffic]
    where = placement(svc, live)
    # Kill the worker that holds the most sequences right now (placement spreads them).
    victim = max((w0, w1), key=lambda w: sum(w in ws for ws in where.values()))
    survivor = w1 if victim == w0 else w0
    on_victim = {s for s, ws in where.items() if victim in ws}
    assert on_victim, f"no sequence on either worker? {where}"
    old_epoch = before[victim].epoch

    handle = svc.coordinator._clients[victim].handle
    t_kill = time.monotonic()
    ray.kill(handle, no_restart=False)
    detected = wait_for(lambda: noticed(svc, victim, old_epoch), 30, "detection")
    back = wait_for(lambda: back_up(svc, victim, old_epoch), 60, "re-registration")
    steps_then = [t.steps for t in traffic]

    def resumed() -> bool:
        errors = [e for t in traffic for e in t.unexpected]
        assert not errors, errors
        return all(t.steps >= s + 3 for t, s in zip(traffic, steps_then, strict=True))

    wait_for(resumed, 60, "traffic after the restart")
    stop.set()
    for t in threads:
        t.join(60)
    print(
        f"\nkill -> noticed {detected:.2f} s, -> re-registered {detected + back:.2f} s "
        f"(after kill at t={t_kill:.0f}); steps {[t.steps for t in traffic]}"
    )

    assert not [e for t in traffic for e in t.unexpected], [t.unexpected for t in traffic]
    losses = [(s, msg) for t in traffic for s, msg in t.data_loss]
    # Every sequence on the victim failed with DATA_LOSS naming the worker and telling the
    # client to recompute; no sequence on the survivor did.
    lost_ids = {s for s, _ in losses}
    assert on_victim <= lost_ids, (on_victim, lost_ids)
    for s, msg in losses:
        assert victim in msg and "recompute" in msg, msg
        assert survivor not in where.get(s, ()), f"{s} on the survivor got DATA_LOSS: {msg}"
    assert sum(t.recomputed for t in traffic) == len(losses)

    after = worker_states(svc)[victim]
    assert after.up and after.epoch != old_epoch
    stats = svc.stats()
    assert stats.workers[victim].total == BLOCKS  # its capacity is back
    svc.checks_finished()  # online checks run after their rounds answered
    assert svc.coordinator.correctness.checks > 0
    assert svc.coordinator.correctness.mismatches == 0
    svc.check_integrity()
    assert all(ws.used == 0 for ws in stats.workers.values()), stats.workers


def test_a_worker_process_killed_while_idle_is_found_by_the_probe(svc):
    w0, w1 = f"{PREFIX}0", f"{PREFIX}1"
    with KVCacheClient(svc.address, timeout_s=60) as client:
        mirrors: dict[str, list[Mirror]] = {w0: [], w1: []}
        while not (mirrors[w0] and mirrors[w1]):
            m = Mirror(client.create_sequence().seq_id, LAYOUT.num_layers)
            k, v = (
                torch.randn(LAYOUT.num_layers, 6, HKV, D),
                torch.randn(LAYOUT.num_layers, 6, HKV, D),
            )
            client.append(m.seq_id, list(range(6)), k, v)
            m.tokens = list(range(6))
            m.k = [[k[i]] for i in range(LAYOUT.num_layers)]
            m.v = [[v[i]] for i in range(LAYOUT.num_layers)]
            (home,) = placement(svc, [m.seq_id])[m.seq_id]
            mirrors[home].append(m)
        victim, survivor = w1, w0
        old_epoch = worker_states(svc)[victim].epoch

        os.kill(pid_of(svc, victim), signal.SIGKILL)  # no call in flight: the probe must see it
        detected = wait_for(lambda: noticed(svc, victim, old_epoch), 30, "detection by probe")
        back = wait_for(lambda: back_up(svc, victim, old_epoch), 60, "re-registration")
        print(f"\nSIGKILL -> noticed {detected:.2f} s, -> re-registered {detected + back:.2f} s")
        # The probe dropped it from the control plane: its sequences are tombstones now.
        assert svc.stats().lost_sequences == len(mirrors[victim])

        q = torch.randn(2, HQ, D)
        for m in mirrors[victim]:
            with pytest.raises(DataLossError, match="recompute") as info:
                client.attend(0, [AttendItem(m.seq_id, q)])
            assert victim in info.value.message
        for m in mirrors[survivor]:
            for layer in range(LAYOUT.num_layers):
                (out,) = client.attend(layer, [AttendItem(m.seq_id, q)])
                assert torch.allclose(out.double(), m.reference(layer, q)[0], atol=1e-5)

        info = client.info()
        assert info.total_blocks == 2 * BLOCKS
        # The revived worker takes new sequences again, with correct results.
        fresh = []
        while len(fresh) < 4:
            m = Mirror(client.create_sequence().seq_id, LAYOUT.num_layers)
            k, v = torch.randn(3, HKV, D), torch.randn(3, HKV, D)
            (out,) = client.append_attend(0, [AppendAttendItem(m.seq_id, [1, 2, 3], k, v, q)])
            m.add(0, k, v)
            assert torch.allclose(out.double(), m.reference(0, q)[0], atol=1e-5)
            fresh.append(m)
        assert any(victim in placement(svc, [m.seq_id])[m.seq_id] for m in fresh)
        for m in mirrors[w0] + mirrors[w1] + fresh:
            try:
                client.free(m.seq_id)
            except KVCacheError as exc:  # pragma: no cover - reported
                raise AssertionError(f"free failed: {exc}") from exc
    svc.check_integrity()
    stats = svc.stats()
    assert stats.lost_sequences == 0
    assert all(ws.used == 0 for ws in stats.workers.values()), stats.workers
