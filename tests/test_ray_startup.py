"""The local-Ray start: one more try after Ray's startup timeout, and nothing else retried.

The retry decision is pure logic and runs against a fake ``init``; the process-tree walk
and the clean-up of what a failed start left behind run on real child processes.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest

from workers import ray_startup
from workers.ray_startup import is_startup_timeout, start_local_ray

TIMEOUT = Exception(
    "The current node timed out during startup. This could happen because some of the "
    "raylet failed to startup or the GCS has become overloaded."
)


class FakeInit:
    """Fails with the given errors in order, then succeeds; records its keyword arguments."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.calls: list[dict] = []

    def __call__(self, **kwargs) -> None:
        self.calls.append(kwargs)
        if self.errors:
            raise self.errors.pop(0)


def test_a_startup_timeout_is_retried_once_with_the_raylet_logs_shown(caplog, tmp_path):
    logs = tmp_path / "ray" / "session_latest" / "logs"
    logs.mkdir(parents=True)
    (logs / "raylet.out").write_text("line one\nraylet could not bind port 41000\n")
    init = FakeInit(TIMEOUT)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_TMPDIR", str(tmp_path))
        with caplog.at_level(logging.WARNING, logger=ray_startup.__name__):
            start_local_ray("ns", num_cpus=2, init=init)
    assert len(init.calls) == 2
    assert init.calls[0] == init.calls[1]
    assert init.calls[0]["address"] == "local"  # never joins a cluster found by accident
    assert init.calls[0]["namespace"] == "ns" and init.calls[0]["num_cpus"] == 2
    (record,) = caplog.records
    assert "attempt 1 of 2" in record.getMessage()
    assert "raylet could not bind port 41000" in record.getMessage()


def test_other_failures_are_raised_at_once():
    init = FakeInit(ValueError("num_cpus must be >= 0"))
    with pytest.raises(ValueError, match="num_cpus"):
        start_local_ray("ns", init=init)
    assert len(init.calls) == 1


def test_the_last_timeout_is_raised():
    init = FakeInit(TIMEOUT, TIMEOUT, TIMEOUT)
    with pytest.raises(Exception, match="timed out during startup"):
        start_local_ray("ns", attempts=3, init=init)
    assert len(init.calls) == 3


def test_init_arguments_override_the_defaults_and_attempts_are_checked():
    init = FakeInit()
    start_local_ray("ns", init=init, include_dashboard=True, object_store_memory=10**8)
    assert init.calls[0]["include_dashboard"] is True
    assert init.calls[0]["object_store_memory"] == 10**8
    with pytest.raises(ValueError, match="attempts must be >= 1, got 0"):
        start_local_ray("ns", attempts=0, init=init)


def test_the_timeout_is_told_apart_by_its_message():
    assert is_startup_timeout(TIMEOUT)
    assert not is_startup_timeout(RuntimeError("Maybe you called ray.init twice"))


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="the process walk reads /proc")
def test_what_a_failed_start_left_behind_is_found_and_stopped():
    before = ray_startup._descendants(os.getpid())
    # A grandchild too: Ray's raylet starts its own workers.
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time; "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "time.sleep(60)",
        ]
    )
    try:
        for _ in range(200):
            left = ray_startup._descendants(os.getpid()) - before
            if len(left) >= 2:
                break
            time.sleep(0.05)
        assert child.pid in left and len(left) == 2, left
        ray_startup._terminate(left)
        assert child.wait(timeout=10) == -9
    finally:
        if child.poll() is None:
            child.kill()
