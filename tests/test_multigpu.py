"""benchmarks/bench_multigpu.py on CPU: the smoke run through every section with several CPU
Ray workers (so the script cannot rot), the one-worker run, the pure arithmetic of its
figures, its input checks, and a poisoned pool failing its correctness check.

The GPU runs are in tests/test_multigpu_gpu.py.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_multigpu.py"


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_multigpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_multigpu"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


bench = _load_bench()


def run_script(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "bench_multigpu.json").read_text())
    markdown = (out / "bench_multigpu.md").read_text()
    assert proc.stdout.rstrip().endswith(markdown.rstrip())  # the tables are printed last
    return proc, result


# -- the script end to end ------------------------------------------------------------------


def test_smoke_run_covers_every_section_with_three_cpu_workers(tmp_path):
    _, result = run_script(tmp_path, "--smoke")
    cfg = bench.SMOKE
    assert result["correct"] is True
    workers = result["environment"]["workers"]
    assert len(workers) == 3
    assert len({w["pid"] for w in workers}) == 3  # three actor processes
    assert {w["device"] for w in workers} == {"cpu"}

    sc = result["scaling"]
    assert sc["kv_bytes_per_layer"] == cfg.batch * cfg.context * 2 * 32 * 2 * 4
    by_key = {(p["path"], p["workers"]): p for p in sc["points"]}
    assert set(by_key) == {(path, n) for path in bench.PATHS for n in (1, 2, 3)}
    for (_, n), p in by_key.items():
        assert len(p["per_worker_GBps"]) == n
        assert all(math.isfinite(x) and x > 0 for x in p["per_worker_GBps"])
        assert p["aggregate_GBps"] > 0 and p["rounds"] >= 2
        if n == 1:
            assert p["efficiency"] == pytest.approx(1.0)
        else:
            # Aggregate over the shared span cannot beat the sum of the per-worker rates.
            assert p["aggregate_GBps"] <= sum(p["per_worker_GBps"]) * 1.0001
            assert p["efficiency"] == pytest.approx(
                p["aggregate_GBps"] / (n * by_key[(p["path"], 1)]["aggregate_GBps"])
            )
    for err in sc["max_rel_err_vs_fp64_dense"].values():
        assert err < bench.TOLERANCE["float32"]

    ps = result["prefix_sharing"]
    assert ps["correct"] is True
    assert ps["rel_err"]["merged_vs_dense"] < 1e-4
    assert ps["rel_err"]["copied_vs_dense"] < 1e-4
    assert ps["copy_bytes"] == cfg.prefix_blocks * cfg.layout.bytes_per_block
    assert ps["per_layer_e2e_s"]["merged"]["p50"] > 0
    assert set(ps["kernel_per_layer_s"]["merged_per_worker"]) == {"bench-mg-0", "bench-mg-1"}

    tr = result["transfers"]
    assert tr["correct"] is True
    assert [r["blocks"] for r in tr["rows"]] == list(cfg.transfer_blocks)
    for r in tr["rows"]:
        assert r["bit_exact_sampled"] is True and r["GBps"] > 0
        assert r["cross_device_GBps"] is None and r["same_device_GBps"] > 0


def test_one_worker_run_skips_the_cross_worker_sections_and_says_why(tmp_path):
    proc, result = run_script(tmp_path, "--smoke", "--num-gpus", "1")
    assert len(result["environment"]["workers"]) == 1
    assert {p["workers"] for p in result["scaling"]["points"]} == {1}
    for section in ("prefix_sharing", "transfers"):
        assert result[section] == {"skipped": "needs >= 2 workers, this run has 1"}
    assert "Not run: needs >= 2 workers, this run has 1." in proc.stdout


def test_a_poisoned_pool_fails_the_correctness_check():
    ray = pytest.importorskip("ray")
    from workers.launcher import shutdown_workers
    from workers.ray_startup import start_local_ray

    cfg = bench.replace(bench.SMOKE, seconds=0.01)
    namespace = f"test-multigpu-{uuid.uuid4().hex[:8]}"
    start_local_ray(namespace, num_cpus=1)
    try:
        workers = bench.start_workers(cfg, namespace, "poison-", 1)

        def poison(worker, block):
            worker.pool.data[block] = math.nan

        # A block of the last layer's batch: the dense reference and the kernels both see it.
        first_block = int(bench.decode_batch(cfg, seed=7).block_tables[0, 0])
        ray.get(bench.call(workers.handles[0], poison, first_block))
        sc = bench.measure_scaling(cfg, workers)
    finally:
        shutdown_workers(namespace, "poison-")
        ray.shutdown()
    assert sc["correct"] is False
    assert all(math.isnan(e) for e in sc["max_rel_err_vs_fp64_dense"].values())


# -- the arithmetic of the figures ----------------------------------------------------------


def test_scaling_point_and_efficiency_arithmetic():
    W = bench.WorkerTiming
    single = bench.scaling_point("kernel", 4, [W(1.0, 100.0, 101.0, 10_000_000_000)])
    # Two workers, 10 GB each in 1 s of their own time, the second starting 0.25 s late.
    pair = bench.scaling_point(
        "kernel", 4, [W(1.0, 100.0, 101.0, 10**10), W(1.0, 100.25, 101.25, 10**10)]
    )
    assert single.aggregate_GBps == pytest.approx(10.0)
    assert pair.per_worker_GBps == pytest.approx((10.0, 10.0))
    assert pair.span_s == pytest.approx(1.25)
    assert pair.aggregate_GBps == pytest.approx(20 / 1.25)
    assert pair.start_skew_ms == pytest.approx(250.0)
    other = bench.scaling_point("worker", 4, [W(2.0, 0.0, 2.0, 10**10)])
    points = bench.with_efficiency([single, pair, other])
    assert [p.efficiency for p in points] == pytest.approx([1.0, 0.8, 1.0])


def test_scaling_point_refuses_bad_timings():
    W = bench.WorkerTiming
    with pytest.raises(ValueError, match="at least one"):
        bench.scaling_point("kernel", 1, [])
    with pytest.raises(ValueError, match="non-positive worker time"):
        bench.scaling_point("kernel", 1, [W(0.0, 1.0, 2.0, 10)])
    with pytest.raises(ValueError, match="span"):
        bench.scaling_point("kernel", 1, [W(1.0, 2.0, 2.0, 10)])


def test_rounds_fill_the_target_time():
    assert bench.rounds_for(0.01, 1.0) == 100
    assert bench.rounds_for(3.0, 1.0) == 2
    assert bench.rounds_for(0.0, 1.0) == 2


def test_dense_decode_is_the_last_position_softmax():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 8, generator=gen)
    keys = [torch.randn(5, 2, 8, generator=gen), torch.randn(3, 2, 8, generator=gen)]
    values = [torch.randn(5, 2, 8, generator=gen), torch.randn(3, 2, 8, generator=gen)]
    out = bench.dense_decode(q, keys, values)
    for s in range(2):
        k = keys[s].double().repeat_interleave(2, dim=1)
        v = values[s].double().repeat_interleave(2, dim=1)
        p = torch.softmax(torch.einsum("hd,khd->hk", q[s].double(), k) / math.sqrt(8), dim=-1)
        assert torch.allclose(out[s], torch.einsum("hk,khd->hd", p, v))


# -- input checks ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"prefix_tokens": 17}, "prefix_tokens must be a positive multiple of block_size"),
        ({"prefix_tokens": 4096}, "below context"),
        ({"num_q_heads": 12}, "multiple of num_kv_heads"),
        ({"transfer_blocks": ()}, "transfer_blocks must be positive"),
        ({"transfer_blocks": (4, 0)}, "transfer_blocks must be positive"),
        ({"seconds": 0.0}, "seconds must be a positive number"),
        ({"seconds": math.nan}, "seconds must be a positive number"),
        ({"batch": 0}, "batch must be a positive int"),
        ({"max_workers": 0}, r"max_workers \(--num-gpus\) must be a positive int"),
        ({"dtype": "int8"}, "KVLayout.dtype"),
    ],
)
def test_config_rejects_inconsistent_fields(change, message):
    with pytest.raises(ValueError, match=message):
        bench.replace(bench.BenchConfig(), **change)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--smoke", "--prefix-tokens", "20"], "prefix_tokens must be a positive multiple"),
        (["--smoke", "--transfer-blocks", "1,x"], "expected comma-separated block counts"),
        (["--smoke", "--num-gpus", "0"], "must be a positive int"),
        ([], "no CUDA device: use --smoke"),
    ],
)
def test_command_line_errors_name_the_problem(tmp_path, capsys, argv, message):
    if not argv and torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the no-GPU refusal does not apply")
    with pytest.raises(SystemExit) as exc:
        bench.parse_config(["--out", str(tmp_path), *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
