"""A real two-node Ray cluster on this machine, the coordinator serving sequences on both.

`ray start --head` and `ray start --address` run as separate process groups on loopback
addresses (127.0.0.2 and 127.0.0.3), with token authentication. One PoolWorker is placed
on each node through a node-local custom resource (on GPUs the launcher's placement group
spreads them; a CPU machine has no GPU resource to spread by), named and detached as the
launcher names them, with max_restarts=-1 so that Ray restarts a worker when its node
returns; the coordinator (`python -m cache_service.cli serve`, its own process) attaches
to them. Then the second node is killed: its sequences fail with DATA_LOSS while the
head's keep attending correctly; the node is started again: Ray restarts its worker there,
the coordinator re-registers it, and capacity returns.

Everything is bounded; the Ray nodes and the coordinator are always stopped.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from prometheus_client.parser import text_string_to_metric_families
from workers_support import dense_attention, rel_err

from cache_service.client import AttendItem, DataLossError, KVCacheClient, KVCacheError
from cache_service.health_probe import check

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).parent / "ray")
NAMESPACE = "kvcache-multinode"
PREFIX = "kvcache-worker-"
LAYOUT = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "block_size": 4, "dtype": "float32"}
BLOCKS = 32
NUM_Q_HEADS = 4
PROMPT = 8  # tokens per sequence: 2 blocks
# Each node on its own loopback address (Ray would turn "127.0.0.1" into the machine's
# routable address, and any other 127/8 address is loopback on Linux too). Ray's gRPC servers
# still listen on every interface, so the cluster requires a random token (Ray's token
# authentication). No usage reporting; the GCS declares a killed node dead after ~1.5 s
# instead of the default ~30 s.
HEAD_IP, SECOND_IP = "127.0.0.2", "127.0.0.3"
RAY_ENV = {
    "RAY_AUTH_MODE": "token",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_health_check_initial_delay_ms": "0",
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "500",
    "RAY_health_check_failure_threshold": "3",
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(
    what: str, predicate: Callable[[], Any], timeout_s: float, poll_s: float = 0.5
) -> Any:
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            result = predicate()
            if result:
                return result
        except Exception as exc:  # the thing waited for may fail until it is ready
            last = exc
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what} (last error: {last})")


class Cluster:
    """The Ray nodes and the coordinator, each a process group this test owns."""

    def __init__(self) -> None:
        # A short path: Ray's Unix sockets live under it (108-byte limit).
        self.tmp = Path(tempfile.mkdtemp(prefix="kvmn"))
        self.gcs_port = free_port()
        self.env = {
            **os.environ,
            **RAY_ENV,
            "RAY_AUTH_TOKEN": secrets.token_hex(32),
            "PYTHONPATH": str(ROOT),
        }
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def gcs(self) -> str:
        return f"{HEAD_IP}:{self.gcs_port}"

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = (self.tmp / f"{name}.log").open("ab")
        try:
            proc = subprocess.Popen(
                argv,
                cwd=ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            log.close()
        self.procs[name] = proc
        return proc

    def _node_flags(self, ip: str, resource: str) -> list[str]:
        return [
            "--block",
            f"--node-ip-address={ip}",
            "--num-cpus=1",
            "--num-gpus=0",
            f"--resources={json.dumps({resource: 1})}",
            "--object-store-memory=100000000",
            "--disable-usage-stats",
            f"--node-manager-port={free_port()}",
            f"--object-manager-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
        ]

    def start_head(self) -> None:
        self._spawn(
            "head",
            [
                RAY,
                "start",
                "--head",
                f"--port={self.gcs_port}",
                f"--temp-dir={self.tmp}",
                "--include-dashboard=false",
                f"--dashboard-port={free_port()}",
                f"--ray-client-server-port={free_port()}",
                *self._node_flags(HEAD_IP, "kvc_node_head"),
            ],
        )

    def start_second(self) -> None:
        self._spawn(
            "second",
            [
                RAY,
                "start",
                f"--address={self.gcs}",
                *self._node_flags(SECOND_IP, "kvc_node_second"),
            ],
        )

    def ray_script(self, body: str, timeout_s: float = 90) -> Any:
        """Run `body` in a fresh Python connected to the cluster; returns its JSON print."""
        code = (
            "import json, time, ray\n"
            f"ray.init(address={self.gcs!r}, namespace={NAMESPACE!r}, log_to_driver=False)\n" + body
        )
        out = subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        assert out.returncode == 0, (
            f"ray script failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
        )
        return json.loads(out.stdout.strip().splitlines()[-1])

    def kill(self, name: str, sig: int = signal.SIGTERM, grace_s: float = 15) -> None:
        proc = self.procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=grace_s)
        except ProcessLookupError:
            pass

    def stop_all(self) -> None:
        for name in ("coordinator", "second", "head"):
            try:
                self.kill(name, grace_s=5)
            except Exception:  # keep stopping the others
                pass
        # Ray daemons that left their process group still name our private temp dir.
        found = subprocess.run(
            ["pgrep", "-f", str(self.tmp)], capture_output=True, text=True, check=False
        ).stdout.split()
        for pid in found:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        shutil.rmtree(self.tmp, ignore_errors=True)

    def log_tail(self, name: str) -> str:
        try:
            return (self.tmp / f"{name}.log").read_text(errors="replace")[-3000:]
        except OSError:
            return ""


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    c = Cluster()
    try:
        yield c
    finally:
        c.stop_all()


PLACE_WORKERS = f"""
from workers.actor import PoolWorkerActor
from workers.config import PoolConfig
from workers.launcher import worker_name
from workers.layout import KVLayout
deadline = time.time() + 90
while sum(1 for n in ray.nodes() if n["Alive"]) < 2:
    assert time.time() < deadline, "second node never joined"
    time.sleep(0.5)
pool = PoolConfig(KVLayout(**{LAYOUT!r}), num_blocks={BLOCKS})
handles = []
for i, resource in enumerate(("kvc_node_head", "kvc_node_second")):
    handles.append(PoolWorkerActor.options(
        name=worker_name({PREFIX!r}, i), namespace={NAMESPACE!r}, lifetime="detached",
        max_restarts=-1, num_cpus=0, resources={{resource: 0.01}},
    ).remote(worker_name({PREFIX!r}, i), pool, "cpu", 1))
descs = ray.get([h.describe.remote() for h in handles], timeout=60)
print(json.dumps([d.epoch for d in descs]))
"""


class Workload:
    """Sequences with known K/V, so every attention output is checked against dense."""

    def __init__(self, client: KVCacheClient) -> None:
        self.client = client
        self.kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.home: dict[str, str] = {}
        self.next_token = 1

    def used_blocks(self) -> dict[str, int]:
        return {w.worker_id: w.used_blocks for w in self.client.stats().workers}

    def add_sequence(self) -> str:
        """Create and prefill one sequence; returns the worker its blocks landed on."""
        before = self.used_blocks()
        prompt = list(range(self.next_token, self.next_token + PROMPT))
        self.next_token += PROMPT
        seq = self.client.create_sequence(prompt)
        shape = (LAYOUT["num_layers"], PROMPT, LAYOUT["num_kv_heads"], LAYOUT["head_dim"])
        k, v = torch.randn(shape), torch.randn(shape)
        self.client.append(seq.seq_id, prompt, k, v)
        after = self.used_blocks()
        grew = [w for w in after if after[w] > before.get(w, 0)]
        assert len(grew) == 1, f"a {PROMPT}-token sequence should sit on one worker: {grew}"
        self.kv[seq.seq_id] = (k, v)
        self.home[seq.seq_id] = grew[0]
        return grew[0]

    def attend_checked(self, seq_id: str) -> None:
        k, v = self.kv[seq_id]
        for layer in range(LAYOUT["num_layers"]):
            q = torch.randn(1, NUM_Q_HEADS, LAYOUT["head_dim"])
            (out,) = self.client.attend(layer, [AttendItem(seq_id, q)])
            ref, _ = dense_attention(q, k[layer], v[layer])
            assert rel_err(out, ref) < 1e-4, (seq_id, layer, rel_err(out, ref))


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_two_node_cluster_loses_and_regains_a_node(cluster: Cluster) -> None:
    t0 = time.monotonic()
    cluster.start_head()
    try:
        wait_until("the head node", lambda: "Ray runtime started" in cluster.log_tail("head"), 60)
    except AssertionError:
        pytest.fail(f"ray start --head failed:\n{cluster.log_tail('head')}")
    cluster.start_second()
    epochs = cluster.ray_script(PLACE_WORKERS)
    assert len(epochs) == 2

    grpc_port, metrics_port = free_port(), free_port()
    config = {
        "layout": LAYOUT,
        "workers": {
            "num_workers": 2,
            "blocks_per_worker": BLOCKS,
            "device": "cpu",
            "ray_address": cluster.gcs,
            "namespace": NAMESPACE,
            "name_prefix": PREFIX,
        },
        "server": {"host": "127.0.0.1", "port": grpc_port, "shutdown_grace_s": 1.0},
        "coordinator": {"worker_timeout_s": 3.0, "health_check_interval_s": 0.5},
        "metrics": {"enabled": True, "host": "127.0.0.1", "port": metrics_port},
    }
    config_path = cluster.tmp / "kvcache.yaml"
    config_path.write_text(yaml.safe_dump(config))
    cluster._spawn(
        "coordinator",
        [sys.executable, "-m", "cache_service.cli", "serve", "--config", str(config_path)],
    )
    address = f"127.0.0.1:{grpc_port}"
    try:
        wait_until("the coordinator", lambda: check(address, "", 2) == "SERVING", 60)
    except AssertionError:
        pytest.fail(f"coordinator did not start:\n{cluster.log_tail('coordinator')}")
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    w_head, w_second = f"{PREFIX}0", f"{PREFIX}1"

    with KVCacheClient(address, timeout_s=20) as client:
        info = client.info()
        assert {w.worker_id: (w.up, w.num_blocks) for w in info.workers} == {
            w_head: (True, BLOCKS),
            w_second: (True, BLOCKS),
        }
        assert info.total_blocks == 2 * BLOCKS

        # Sequences on both nodes, every output equal to dense attention.
        load = Workload(client)
        for _ in range(8):
            load.add_sequence()
            homes = set(load.home.values())
            if homes == {w_head, w_second} and len(load.home) >= 4:
                break
        assert set(load.home.values()) == {w_head, w_second}, load.home
        for seq_id in load.kv:
            load.attend_checked(seq_id)
        on_second = [s for s, w in load.home.items() if w == w_second]
        on_head = [s for s, w in load.home.items() if w == w_head]
        # Every data call went over a worker channel (the head's worker on the
        # coordinator's node over its Unix socket, the second node's over TCP), none
        # through Ray.
        samples = scrape(metrics_url)
        for w in (w_head, w_second):
            calls = "kvcache_worker_data_calls_total"
            assert samples[(calls, (("path", "channel"), ("worker", w)))] > 0, w
            assert samples.get((calls, (("path", "ray"), ("worker", w))), 0) == 0, w
        paths = {w.worker_id: w.data_path for w in client.info().workers}
        assert paths == {w_head: "channel_unix", w_second: "channel_tcp"}, paths

        # The second node dies (SIGKILL of its whole process group: a crash).
        cluster.kill("second", signal.SIGKILL)

        def lost_on_second() -> bool:
            try:
                client.attend(0, [AttendItem(on_second[0], torch.randn(1, NUM_Q_HEADS, 16))])
            except DataLossError:
                return True
            except KVCacheError:  # UNAVAILABLE / DEADLINE while the loss is being noticed
                return False
            return False

        wait_until("DATA_LOSS for the dead node's sequences", lost_on_second, timeout_s=60)
        for seq_id in on_second:
            with pytest.raises(DataLossError, match="recompute"):
                client.attend(1, [AttendItem(seq_id, torch.randn(1, NUM_Q_HEADS, 16))])
            client.free(seq_id)
            del load.kv[seq_id]
        # Everyone else keeps working, and new sequences go to the surviving node.
        for seq_id in on_head:
            load.attend_checked(seq_id)
        assert load.add_sequence() == w_head
        for seq_id in load.kv:
            load.attend_checked(seq_id)
        info = client.info()
        assert {w.worker_id: w.up for w in info.workers} == {w_head: True, w_second: False}
        assert info.total_blocks == BLOCKS

        # The node comes back: Ray restarts its worker there (empty, a new epoch) and the
        # coordinator re-registers it: the capacity returns.
        cluster.start_second()
        wait_until(
            "the returning node's worker to be re-registered",
            lambda: client.info().total_blocks == 2 * BLOCKS,
            timeout_s=90,
            poll_s=1,
        )
        stats = {w.worker_id: w for w in client.stats().workers}
        assert stats[w_second].free_blocks == BLOCKS and stats[w_second].used_blocks == 0
        placed = [load.add_sequence() for _ in range(4)]
        assert w_second in placed, placed
        for seq_id in load.kv:
            load.attend_checked(seq_id)

        samples = scrape(metrics_url)
        assert samples[("kvcache_lost_sequences_total", ())] == len(on_second)
        assert samples[("kvcache_worker_restarts_total", (("worker", w_second),))] == 1
        assert samples[("kvcache_worker_restarts_total", (("worker", w_head),))] == 0
        assert samples[("kvcache_worker_up", (("worker", w_second),))] == 1
        assert samples[("kvcache_pool_capacity_blocks", (("worker", w_second),))] == BLOCKS
    assert time.monotonic() - t0 < 170
