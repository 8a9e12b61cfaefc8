"""Every benchmark a user runs (benchmarks/bench_*.py) runs in its smallest CPU mode: each
started as its own process from the repository root, as a user would, must exit 0 and print
its figures with the command, device and date they belong to; each answers --help."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"

pytestmark = pytest.mark.timeout(300)

# (script, arguments of its smallest CPU run, lines its report must hold besides the date and
# the command)
SMOKE_RUNS = {
    "bench_kernels.py": (["--smoke"], ["- device: CPU", "| decode B=4 x L=80 |"]),
    "bench_control_plane.py": (["--quick"], ["- Machine:", "| append: 1 token x 256 sequences"]),
    "bench_service.py": (
        ["--smoke", "--no-ray", "--transports", "local-shm"],
        [
            "- device: CPU",
            "| in-process `PoolWorker.run_round` (no RPC) |",
            "| service, pools in the server process, local session",
            "## Concurrency: 2 clients of batch 1 versus one client of batch 1",
            "## Host tier: restore host -> device, and the prefix hit rate at 4x the pool",
            "| GPU pool + host tier of 32 blocks |",
        ],
    ),
    "bench_transformers.py": (["--smoke"], ["- device: CPU", "| batch | own tok/s |"]),
    "bench_load.py": (["--smoke"], ["- machine:", "| append_attend |"]),
    "bench_leases.py": (["--smoke"], ["- device: CPU", "| batch | StepLease p50 / p90, us |"]),
    "bench_multigpu.py": (
        ["--smoke", "--num-gpus", "1"],
        ["## 1. Aggregate attend throughput", "cpu"],
    ),
}


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_every_benchmark_script_has_a_smoke_run() -> None:
    scripts = sorted(p.name for p in BENCHMARKS.glob("*.py"))
    assert scripts == sorted(SMOKE_RUNS)


@pytest.mark.parametrize("script", sorted(SMOKE_RUNS))
def test_smallest_cpu_run_prints_its_figures(script: str, tmp_path: Path) -> None:
    args, expected = SMOKE_RUNS[script]
    if script == "bench_multigpu.py":
        args = [*args, "--out", str(tmp_path / "out")]
    proc = _run([f"benchmarks/{script}", *args], timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "date:" in out.lower(), out[-3000:]
    assert f"{script} {args[0]}" in out, out[-3000:]  # the command that made the figures
    for line in expected:
        assert line in out, f"{line!r} not in the output:\n{out[-3000:]}"


@pytest.mark.parametrize("script", sorted(SMOKE_RUNS))
def test_help_names_the_smallest_run(script: str) -> None:
    proc = _run([f"benchmarks/{script}", "--help"], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert SMOKE_RUNS[script][0][0] in proc.stdout
