"""A coordinator process SIGKILLed in the middle of logging recovers a consistent prefix.

The child runs the seeded workload against a DurableBlockManager (synchronous=FULL,
frequent checkpoints) and prints the last committed lsn after every step, which is what
a client would have been acknowledged. The test kills it at a random moment, recovers from
the file, and checks against an independent oracle: the same seeded workload run on a
plain in-memory BlockManager, stopped after exactly as many mutations as were recovered.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from cache_service.control.block_manager import BlockManager
from cache_service.engine.recovery import LOGGED_OPS, recover
from cache_service.engine.store import MetadataStore, StoreConfig
from tests.store_workload import CONFIG, Workload, restore_ids, seed_ids

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]


class _Stop(Exception):
    """The oracle reached the number of mutations the crashed run had logged."""


class _CountingManager:
    """A BlockManager that allows exactly `limit` successful mutations, then stops."""

    def __init__(self, manager: BlockManager, limit: int) -> None:
        self.manager = manager
        self.limit = limit
        self.count = 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.manager, name)
        if name not in LOGGED_OPS:
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.count == self.limit:
                raise _Stop
            result = attr(*args, **kwargs)
            self.count += 1
            return result

        return call


def _oracle(seed: int, mutations: int) -> BlockManager:
    """The state after the first `mutations` successful mutations of the seeded workload."""
    seed_ids(seed)
    try:
        counting = _CountingManager(BlockManager(CONFIG), mutations)
        work = Workload(counting, random.Random(seed))
        # Workload checks isinstance(BlockManager) to pass epochs; the counting proxy is
        # not one, so it logs epochs like the durable manager does: drop them here.
        real_add = counting.__getattr__("add_worker")
        counting.add_worker = lambda w, n, epoch=None: real_add(w, n)  # type: ignore[attr-defined]
        try:
            work.setup()
            for _ in range(1_000_000):
                work.step()
        except _Stop:
            pass
        return counting.manager
    finally:
        restore_ids()


def _run_and_kill(
    path: Path, seed: int, checkpoint_every: int, group_every: int, delay_s: float
) -> int:
    """Start the child, SIGKILL it after `delay_s`; returns the last acknowledged lsn."""
    args = [str(path), str(seed), str(checkpoint_every), str(group_every)]
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.store_workload", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    acked = [-1]

    def reader() -> None:
        assert child.stdout is not None
        for line in child.stdout:
            if line.startswith("ack "):
                acked[0] = int(line.split()[1])

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    # Wait for the first acknowledgement so the kill lands in the loop, not at import.
    deadline = time.monotonic() + 30
    while acked[0] < 0 and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(delay_s)
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=10)
    thread.join(timeout=10)
    stderr = child.stderr.read() if child.stderr else ""
    assert child.returncode == -signal.SIGKILL, f"child ended on its own: {stderr[-2000:]}"
    assert acked[0] >= 0, f"child never acknowledged anything: {stderr[-2000:]}"
    return acked[0]


def test_sigkill_mid_log_recovers_a_consistent_prefix(tmp_path: Path) -> None:
    rng = random.Random(1234)
    figures = []
    for round_ in range(6):
        seed = rng.randrange(2**32)
        path = tmp_path / f"crash-{round_}.db"
        checkpoint_every = rng.choice([7, 20, 50])
        # Even rounds: a commit per call; odd rounds: group commit every 1-5 steps.
        group_every = 0 if round_ % 2 == 0 else rng.randrange(1, 6)
        acked = _run_and_kill(path, seed, checkpoint_every, group_every, rng.uniform(0.1, 0.8))
        # Nothing acknowledged may be lost; at most the unacknowledged calls (two per step,
        # group_every steps per acknowledgement) may have been committed beyond it.
        slack = 2 * max(group_every, 1)

        store = MetadataStore(StoreConfig(str(path)))
        assert store.begin_generation() == 2
        result = recover(store, CONFIG)
        recovered = result.checkpoint_lsn + result.replayed
        assert recovered == store.last_lsn()
        assert acked <= recovered <= acked + slack, (acked, recovered, group_every)
        result.manager.check_integrity()
        assert result.manager.to_records() == _oracle(seed, recovered).to_records()
        store.close()
        figures.append((group_every, acked, recovered, result.checkpoint_lsn, result.replayed))
    print("\n(group_every, acked, recovered, checkpoint lsn, replayed) per kill:", figures)
    # The kills landed after real work, including after at least one checkpoint.
    assert all(f[2] > 10 for f in figures)
    assert any(f[3] > 0 for f in figures)
