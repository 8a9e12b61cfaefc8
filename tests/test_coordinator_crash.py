"""A coordinator SIGKILLed mid-traffic restarts on its store and the same detached workers.

A private Ray head (`ray start --head`, its own process group, loopback, token auth) hosts
the named, detached PoolWorkers that `python -m cache_service.cli serve` launches. Client
threads append tokens and attend, each sequence on its own; while they are at it the
coordinator gets SIGKILL. A second coordinator with the same store and Ray namespace
attaches to the same workers (same epochs) and recovers the block tables. Then:

- every acknowledged append survived: each sequence's export holds its acknowledged
  tokens (and at most the one append in flight), with K/V bit-identical to what was sent;
- the sequences continue where they stopped, and every attention output (before and
  after the crash) equals the uninterrupted run's to float32 rounding: the same K/V and
  queries on fresh sequences of the restarted service, never interrupted, themselves
  checked against dense attention. Not bit for bit: the service batches concurrent calls
  on a worker, and a sequence attended beside longer ones is summed in a different order
  (padded on CPU, split differently on a GPU); a lost or repeated append would move an
  output by far more than the tolerance;
- nothing leaked: once every sequence is freed, no block is in use.

Bounded (well under two minutes here) and always cleaned up: the coordinators are killed,
the Ray head's process group is killed, and any process that still carries this test's
Ray token in its environment is killed before the temporary directory is removed.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from workers_support import dense_attention

from cache_service.client import AttendItem, KVCacheClient, KVCacheError

# The bound: two minutes including the Ray head's start (about 60 s here, 2 shared cores).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).parent / "ray")
# Ray would turn 127.0.0.1 into the machine's routable address; any 127/8 address is
# loopback on Linux. The token keeps the cluster private even so.
HEAD_IP = "127.0.0.4"
L, HKV, D, BS, HQ = 2, 2, 16, 4, 4
LAYOUT = {"num_layers": L, "num_kv_heads": HKV, "head_dim": D, "block_size": BS, "dtype": "float32"}
# Sequences per set, prompt tokens, tokens at the end: enough decode steps left after the
# kill condition holds that the traffic is still running when the kill lands (a decode
# token takes about a millisecond per layer over the worker channel).
SEQS, PROMPT, TOTAL = 3, 6, 80
KILL_AFTER = 3  # decode tokens acknowledged on every sequence before the kill
B_TOKENS = 1_000_000  # the reference set's token ids: no prefix shared with set A


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(what: str, check: Callable[[], Any], timeout_s: float, poll_s: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            result = check()
            if result:
                return result
        except Exception as exc:  # not ready yet
            last = exc
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what} ({last})")


# ---- the data: every tensor a function of (sequence, position, layer) -------------------


def kv(i: int, p: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of position p of sequence i, every layer: ``[L, 1, Hkv, D]`` each."""
    g = torch.Generator().manual_seed(1_000_003 * i + p)
    return torch.randn(L, 1, HKV, D, generator=g), torch.randn(L, 1, HKV, D, generator=g)


def kv_range(i: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [kv(i, p) for p in range(start, stop)]
    return torch.cat([k for k, _ in parts], 1), torch.cat([v for _, v in parts], 1)


def query(i: int, p: int, layer: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7_000_001 * i + 31 * p + layer + 17)
    return torch.randn(1, HQ, D, generator=g)


def token(i: int, p: int, offset: int) -> int:
    return offset + 1000 * i + p


class Sequence:
    """One sequence's traffic: prefill, then per position append + attend on each layer."""

    def __init__(self, i: int, seq_id: str, offset: int) -> None:
        self.i, self.seq_id, self.offset = i, seq_id, offset
        self.acked = 0  # positions whose append was acknowledged
        self.in_flight = False  # an append was sent and not acknowledged
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}  # (position, layer) -> out

    def append(self, client: KVCacheClient, start: int, stop: int) -> None:
        k, v = kv_range(self.i, start, stop)
        ids = [token(self.i, p, self.offset) for p in range(start, stop)]
        self.in_flight = True
        assert client.append(self.seq_id, ids, k, v) == start
        self.in_flight = False
        self.acked = stop

    def attend(self, client: KVCacheClient, p: int) -> None:
        """Attention of position p's query (p = the last written position)."""
        for layer in range(L):
            (out,) = client.attend(layer, [AttendItem(self.seq_id, query(self.i, p, layer))])
            self.outputs[(p, layer)] = out

    def run(self, client: KVCacheClient, start: int, stop: int) -> None:
        for p in range(start, stop):
            if p >= self.acked:
                self.append(client, p, p + 1)
            self.attend(client, p)


# ---- processes --------------------------------------------------------------------------


class Processes:
    """The Ray head and the coordinators: process groups this test owns."""

    def __init__(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="kvcr"))  # short: Ray's socket paths
        self.token = secrets.token_hex(32)
        self.env = {
            **os.environ,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": self.token,
            "RAY_USAGE_STATS_ENABLED": "0",
            "PYTHONPATH": str(ROOT),
        }
        self.gcs = f"{HEAD_IP}:{free_port()}"
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        with (self.tmp / f"{name}.log").open("ab") as log:
            proc = subprocess.Popen(
                argv,
                cwd=ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def log(self, name: str, tail: int | None = 4000) -> str:
        """The process's log (its last `tail` characters; None: all of it)."""
        try:
            text = (self.tmp / f"{name}.log").read_text(errors="replace")
        except OSError:
            return ""
        return text if tail is None else text[-tail:]

    def start_head(self) -> None:
        port = self.gcs.rsplit(":", 1)[1]
        flags = {
            "port": port,
            "node-ip-address": HEAD_IP,
            "num-cpus": 1,
            "num-gpus": 0,
            "temp-dir": self.tmp,
            "include-dashboard": "false",
            "object-store-memory": 100_000_000,
            "ray-client-server-port": free_port(),
            "dashboard-port": free_port(),
            "dashboard-agent-listen-port": free_port(),
            "dashboard-agent-grpc-port": free_port(),
            "metrics-export-port": free_port(),
            "runtime-env-agent-port": free_port(),
            "node-manager-port": free_port(),
            "object-manager-port": free_port(),
        }
        argv = [RAY, "start", "--head", "--block", "--disable-usage-stats"]
        self.spawn("head", argv + [f"--{k}={v}" for k, v in flags.items()])
        # The whole log: what Ray prints after this line can be longer than a tail.
        try:
            wait_until("the Ray head", lambda: "Ray runtime started" in self.log("head", None), 60)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; its log ends:\n{self.log('head')}") from None

    def serve(self, name: str, config: Path) -> subprocess.Popen[bytes]:
        return self.spawn(name, [sys.executable, "-m", "cache_service.cli", "serve", "--config",
                                 str(config)])  # fmt: skip

    def ours(self) -> list[int]:
        """Processes carrying this test's Ray token (the head, its daemons and workers)."""
        needle = f"RAY_AUTH_TOKEN={self.token}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                try:
                    if needle in (entry / "environ").read_bytes().split(b"\0"):
                        found.append(int(entry.name))
                except OSError:
                    continue
        return found

    def stop_all(self) -> None:
        for proc in reversed(self.procs):  # coordinators first, then the head
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait(timeout=30)
        # Whatever left the process groups (Ray workers, daemons) still has our token.
        deadline = time.monotonic() + 20
        while (left := self.ours()) and time.monotonic() < deadline:
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
        assert not self.ours(), "processes of the test's Ray cluster are still running"
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture
def procs() -> Iterator[Processes]:
    p = Processes()
    try:
        yield p
    finally:
        p.stop_all()


def connect(address: str, proc: subprocess.Popen[bytes], procs: Processes, name: str) -> Any:
    """A client of a coordinator once it serves with both workers up; its info."""
    client = KVCacheClient(address, timeout_s=30, max_attempts=1)

    def ready() -> Any:
        assert proc.poll() is None, f"the coordinator exited:\n{procs.log(name)}"
        info = client.info(timeout_s=5)
        return info if sum(w.up for w in info.workers) == 2 else None

    return client, wait_until(f"{name} to serve", ready, 90)


def test_coordinator_sigkill_midtraffic_recovers(procs: Processes) -> None:
    t0 = time.monotonic()
    procs.start_head()
    grpc_port = free_port()
    config = procs.tmp / "kvcache.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "layout": LAYOUT,
                "workers": {
                    "num_workers": 2,
                    "blocks_per_worker": 64,
                    "device": "cpu",
                    "ray_address": procs.gcs,
                    "namespace": f"kvcrash-{os.getpid()}",
                    "name_prefix": "crash-worker-",
                },
                "server": {"host": "127.0.0.1", "port": grpc_port, "shutdown_grace_s": 1.0},
                "coordinator": {"health_check_interval_s": 0, "correctness_check_fraction": 0},
                "metrics": {"enabled": False},
                "store_path": str(procs.tmp / "meta.db"),
            }
        )
    )
    address = f"127.0.0.1:{grpc_port}"
    first = procs.serve("coordinator-1", config)
    client, info = connect(address, first, procs, "coordinator-1")
    epochs = {w.worker_id: w.epoch for w in info.workers}

    # Set A: prefill, then decode from one thread per sequence until the kill.
    seqs = [Sequence(i, client.create_sequence().seq_id, 0) for i in range(SEQS)]
    for s in seqs:
        s.append(client, 0, PROMPT)
    stop_reason: dict[int, BaseException] = {}

    def traffic(s: Sequence) -> None:
        try:
            s.run(client, PROMPT - 1, TOTAL)
        except KVCacheError as exc:  # the coordinator died under the call
            stop_reason[s.i] = exc

    threads = [threading.Thread(target=traffic, args=(s,), daemon=True) for s in seqs]
    for t in threads:
        t.start()
    wait_until(
        "decode traffic", lambda: all(s.acked >= PROMPT + KILL_AFTER for s in seqs), 60, 0.005
    )
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=10)
    for t in threads:
        t.join(timeout=40)
    client.close()
    assert first.returncode == -signal.SIGKILL
    assert len(stop_reason) == SEQS, "every sequence should have been cut off mid-traffic"
    assert all(s.acked < TOTAL for s in seqs)

    second = procs.serve("coordinator-2", config)
    client, info = connect(address, second, procs, "coordinator-2")
    # The same detached workers, pools intact (same epochs).
    assert {w.worker_id: w.epoch for w in info.workers} == epochs
    assert client.stats().active_sequences == SEQS
    with client:
        for s in seqs:
            exported = client.export_blocks(s.seq_id)
            n = exported.num_tokens
            assert s.acked <= n <= s.acked + int(s.in_flight), (s.i, s.acked, n)
            assert exported.token_ids == [token(s.i, p, 0) for p in range(n)]
            blocks = exported.blocks()  # [nb, L, 2, Hkv, bs, D]
            k, v = kv_range(s.i, 0, n)
            flat = blocks.permute(1, 2, 0, 4, 3, 5).reshape(L, 2, -1, HKV, D)[:, :, :n]
            assert torch.equal(flat[:, 0], k) and torch.equal(flat[:, 1], v), s.i
            print(f"seq {s.i}: acked {s.acked}, in flight {s.in_flight}, recovered {n}")
            s.acked = n  # an append that landed unacknowledged is not sent again
            first_missing = min(
                (p for p in range(PROMPT - 1, TOTAL) if (p, L - 1) not in s.outputs),
                default=TOTAL,
            )
            s.run(client, first_missing, TOTAL)

        # The uninterrupted run: the same K/V and queries on fresh sequences.
        reference = [Sequence(i, client.create_sequence().seq_id, B_TOKENS) for i in range(SEQS)]
        for r in reference:
            r.append(client, 0, PROMPT)
            r.run(client, PROMPT - 1, TOTAL)
        compared = 0
        for s, r in zip(seqs, reference, strict=True):
            assert set(s.outputs) == set(r.outputs)  # every position, before or after
            k, v = kv_range(r.i, 0, TOTAL)
            for (p, layer), out in r.outputs.items():
                torch.testing.assert_close(
                    s.outputs[(p, layer)], out, rtol=1e-5, atol=2e-6, msg=f"{(s.i, p, layer)}"
                )
                ref, _ = dense_attention(query(r.i, p, layer), k[layer, : p + 1], v[layer, : p + 1])
                assert torch.allclose(out.double(), ref, atol=1e-5), (r.i, p, layer)
                compared += 1
        assert compared == SEQS * (TOTAL - PROMPT + 1) * L

        for s in [*seqs, *reference]:
            client.free(s.seq_id)
        stats = client.stats()
        assert stats.active_sequences == 0 and stats.lost_sequences == 0
        for w in stats.workers:
            assert w.used_blocks == 0, w
            assert w.free_blocks + w.cached_free_blocks == w.total_blocks, w
    second.send_signal(signal.SIGTERM)
    second.wait(timeout=30)
    assert second.returncode == 0, procs.log("coordinator-2")
    print(f"coordinator crash test: {time.monotonic() - t0:.1f} s, {compared} outputs compared")
