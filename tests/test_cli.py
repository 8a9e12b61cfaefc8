"""The `kvcache` command: demo, serve (as a process, stopped by SIGTERM), info, stats, bench,
and configuration errors."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from service_support import ServiceHarness, local_workers, service_config

from cache_service.cli import build_parser, main, service_config_from_args
from cache_service.cli.bench import BenchConfig, run_decode_bench
from cache_service.client import KVCacheClient

ROOT = Path(__file__).resolve().parents[1]


def test_flags_override_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("server: {port: 7000}\nworkers: {num_workers: 4}\n")
    args = build_parser().parse_args(
        ["serve", "--config", str(path), "--port", "0", "--in-process", "--no-metrics",
         "--batch-window-ms", "2", "--dtype", "float16", "--max-message-mb", "64",
         "--host-tier-blocks", "128", "--torch-threads", "1"]
    )  # fmt: skip
    config = service_config_from_args(args)
    assert config.workers.host_tier_blocks == 128 and config.server.torch_threads == 1
    assert config.server.port == 0 and config.workers.num_workers == 4
    assert config.workers.in_process and not config.metrics.enabled
    assert config.coordinator.batch_window_ms == 2.0 and config.layout.dtype == "float16"
    assert config.server.max_message_bytes == 64 << 20


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--config", "/nonexistent.yaml"],
        ["serve", "--port", "70000"],
        ["serve", "--torch-threads", "0"],
        ["serve", "--tls-cert", "only-cert.pem"],
        ["demo", "--in-process", "--clients", "1"],
    ],
)
def test_bad_settings_exit_2_with_a_message(argv, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvcache {argv[0]}: ")


def test_demo_in_process_checks_everything_and_exits_0(capsys) -> None:
    assert main(["demo", "--in-process", "--clients", "3", "--decode-steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "OK: every output equals dense attention" in out
    assert "prefix hits" in out and "fragmentation" in out and "utilization" in out
    assert out.count("match") >= 3


def test_info_and_stats_against_a_server(capsys) -> None:
    with ServiceHarness(service_config(), local_workers(2, 16)) as svc:
        assert main(["info", "--target", svc.address]) == 0
        out = capsys.readouterr().out
        assert "w0" in out and "w1" in out and "capacity 32 blocks" in out
        assert out.count("in_process") == 2  # how the per-layer calls reach each worker
        # The console wraps long lines: compare without line breaks.
        assert f"local sessions at {svc.service.local_sessions.path}" in out.replace("\n", "")
        assert main(["stats", "--target", svc.address]) == 0
        assert "pool utilization" in capsys.readouterr().out
    assert main(["info", "--target", "127.0.0.1:1", "--timeout", "1"]) == 1


def test_bench_runs_against_an_embedded_service(capsys) -> None:
    argv = ["bench", "--in-process", "--batch", "2", "--context", "8", "--steps", "2",
            "--num-layers", "2", "--head-dim", "16"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert re.search(r"per-call p50\s+│\s+[\d.]+ ms", out), out


def test_bench_reads_the_server_clock_around_the_timed_steps() -> None:
    readings = iter([10.0, 12.5])
    calls: list[int] = []

    def clock() -> float:
        calls.append(1)
        return next(readings)

    with ServiceHarness(service_config(), local_workers(1, 64)) as svc:
        cfg = BenchConfig(batch=2, context=8, steps=2, warmup_steps=1, num_q_heads=4)
        result = run_decode_bench(svc.address, cfg, server_cpu_clock=clock)
        plain = run_decode_bench(svc.address, cfg)
    assert len(calls) == 2 and result.server_cpu_seconds == 2.5
    assert plain.server_cpu_seconds is None and len(result.call_seconds) == 2 * result.layers


def test_serve_runs_until_sigterm_and_drains() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-m", "cache_service.cli", "serve", "--in-process", "--port", "0",
         "--no-metrics", "--num-layers", "2", "--head-dim", "16", "--blocks-per-worker", "8",
         "--log-format", "json"],
        stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
    )  # fmt: skip
    try:
        address = None
        lines = []
        for line in proc.stderr:
            lines.append(line)
            found = re.search(r"kvcache serving on (\S+)", line)
            if found:
                address = found.group(1)
                break
        assert address, "".join(lines)
        with KVCacheClient(address, timeout_s=10) as client:
            assert client.info().layout.num_layers == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        rest = proc.stderr.read()
        assert '"msg": "stopped"' in rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class Skewed:
    """A worker proxy whose attention outputs are slightly off (what a kernel bug does)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    @property
    def worker_id(self) -> str:
        return self.inner.worker_id

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name):
        target = getattr(self.inner, name)
        if name != "run_round":
            return target

        async def skewed(*args, **kwargs):
            result = await target(*args, **kwargs)
            return type(result)(result.out + 1e-3, result.lse)

        return skewed


def test_the_demo_check_catches_wrong_outputs() -> None:
    from cache_service.cli.demo import DemoConfig, run_clients

    workers = [Skewed(w) for w in local_workers(1, 64)]
    with ServiceHarness(service_config(), workers) as svc:
        report = run_clients(svc.address, DemoConfig(clients=2, decode_steps=1))
    assert report.mismatches > 0 and not report.ok
