"""Tokens/s of a transformers model generating through the service vs. its own KV cache.

For each batch size: random prompts of different lengths (left-padded), greedy generation of
``new_tokens`` tokens, timed end to end (prefill + decode) with

* ``own``     - transformers' own attention (sdpa) and DynamicCache, the same weights;
* ``service`` - ``ServiceModel``: every layer's K/V and attention in the service, fresh
                sequences (no prefix reuse); co-located, each forward is planned by one
                StepLease call and its layers run in this process on the worker's mapped
                pool (``--no-leases``: every layer a call);
* ``prefix``  - the same prompts again with prefix reuse: the prefill sends only what the
                first service run did not leave cached (whole blocks).

Also reported: the share of the service run spent inside the RPCs, how many generated
tokens equal the ``own`` run's (bf16 runs may legitimately diverge after a near-tie), and
where one layer's call goes, per stage (the model around it, the integration's checks and
copies, client + transport, the server's handling, the worker's write and kernel), from the
integration's timers (``SessionStats``) and the server's own Prometheus histograms.

The service runs as deployed: ``kvcache serve`` in a process of its own on a free port, with
the profile's layout, in-process KV pools (``--ray``: pools in Ray actors) on the model's
device; the client reaches it as a same-host user does (local session socket and shared
memory when the server offers them). ``--embedded`` runs it in this process instead (a
background thread sharing the model's GIL); ``--target`` uses a service started elsewhere
whose layout fits the profile's model (no server-side split then).

Usage (from the repository root):
    .venv/bin/python benchmarks/bench_transformers.py            # CPU, fp32, tiny Llama
    .venv/bin/python benchmarks/bench_transformers.py --smoke    # the same, smallest (seconds)
    python3 benchmarks/bench_transformers.py --h200 --out benchmarks/results
        # CUDA, bf16, a 1.1B-parameter Llama-shaped config (16 layers, 32 query / 8 KV heads)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import functools
import json
import os
import platform
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import transformers
from prometheus_client.parser import text_string_to_metric_families

from cache_service.client import KVCacheClient
from cache_service.config import (
    LayoutConfig,
    MetricsConfig,
    ServerConfig,
    ServiceConfig,
    WorkersConfig,
)
from cache_service.integrations.embedded import EmbeddedService
from cache_service.integrations.transformers import ServiceModel, SessionConfig


@dataclass(frozen=True)
class Profile:
    """Model, service and workload of one benchmark run."""

    name: str
    device: str
    dtype: str  # model and KV dtype: "float32" | "bfloat16" | "float16"
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    batch_sizes: tuple[int, ...]
    prompt_len: int  # longest prompt; others are 50..100 % of it
    new_tokens: int
    repeats: int
    blocks_per_worker: int


CPU = Profile(
    name="cpu-smoke",
    device="cpu",
    dtype="float32",
    num_layers=4,
    hidden_size=256,
    intermediate_size=512,
    num_q_heads=8,
    num_kv_heads=4,
    head_dim=32,
    vocab_size=1024,
    batch_sizes=(1, 8),
    prompt_len=64,
    new_tokens=32,
    repeats=2,
    blocks_per_worker=256,
)

SMOKE = replace(
    CPU,
    name="cpu-smoke-min",
    num_layers=2,
    batch_sizes=(2,),
    prompt_len=16,
    new_tokens=4,
    repeats=1,
)

H200 = Profile(
    name="h200-llama-1.1b-bf16",
    device="cuda",
    dtype="bfloat16",
    num_layers=16,
    hidden_size=2048,
    intermediate_size=5632,
    num_q_heads=32,
    num_kv_heads=8,
    head_dim=64,
    vocab_size=32000,
    batch_sizes=(1, 8, 32),
    prompt_len=512,
    new_tokens=128,
    repeats=3,
    blocks_per_worker=8192,
)

# The 8B-shaped case: Llama-3-8B's attention and MLP sizes, batch 32.
H200_8B = replace(
    H200,
    name="h200-llama-8b-bf16",
    num_layers=32,
    hidden_size=4096,
    intermediate_size=14336,
    num_q_heads=32,
    num_kv_heads=8,
    head_dim=128,
    batch_sizes=(32,),
    blocks_per_worker=4096,
)


def log(msg: str) -> None:
    print(msg, flush=True)


def build_model(p: Profile) -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=p.vocab_size,
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_layers,
        num_attention_heads=p.num_q_heads,
        num_key_value_heads=p.num_kv_heads,
        head_dim=p.head_dim,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    with torch.device(p.device):  # an 8B model initialises in seconds on the GPU
        model = transformers.LlamaForCausalLM(config).to(getattr(torch, p.dtype))
    return model.eval()


def prompts(p: Profile, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(p.prompt_len // 2, p.prompt_len + 1, (batch,), generator=g).tolist()
    lengths[0] = p.prompt_len
    ids = torch.zeros((batch, p.prompt_len), dtype=torch.long)
    mask = torch.zeros((batch, p.prompt_len), dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, p.prompt_len - n :] = torch.randint(1, p.vocab_size, (n,), generator=g)
        mask[b, p.prompt_len - n :] = 1
    return ids, mask


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Any, device: str) -> tuple[float, Any]:
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


class ServedProcess:
    """``kvcache serve`` in a process of its own, as deployed; ``stop()`` drains and ends it.

    Args:
        flags: the ``kvcache serve`` flags (layout, workers, device); the port is free,
            the log is JSON at INFO so the "serving" line names the address and /metrics.
        start_timeout_s: how long the server may take to start, seconds.
    """

    def __init__(self, flags: list[str], start_timeout_s: float = 180.0) -> None:
        command = [sys.executable, "-m", "cache_service.cli", "serve", "--port", "0"]
        command += ["--metrics-port", "0", "--log-level", "INFO", "--log-format", "json"]
        # The repository first, then whatever the caller's path already holds.
        paths = [str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
        self._proc = subprocess.Popen(
            [*command, *flags], stderr=subprocess.PIPE, text=True, env=env
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self.problems: list[str] = []  # the server's warnings and errors (JSON lines)
        threading.Thread(target=self._drain, name="kvcache-serve-log", daemon=True).start()
        self.address, self.metrics_url = self._wait_serving(start_timeout_s)

    def _drain(self) -> None:
        # The server logs for as long as it runs: read its pipe to the end so it never blocks.
        assert self._proc.stderr is not None
        for line in self._proc.stderr:
            self._lines.put(line)
            if '"level": "WARNING"' in line or '"level": "ERROR"' in line:
                self.problems.append(line.rstrip())
        self._lines.put(None)

    def _wait_serving(self, timeout_s: float) -> tuple[str, str | None]:
        deadline = time.monotonic() + timeout_s
        seen: list[str] = []
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                self.stop()
                raise RuntimeError("kvcache serve did not start:\n" + "".join(seen[-40:]))
            seen.append(line)
            with contextlib.suppress(json.JSONDecodeError):
                record = json.loads(line)
                if record.get("msg") == "serving":
                    return record["address"], record.get("metrics")

    def stop(self) -> None:
        """SIGTERM (the server drains and stops its workers), then wait; kill if it hangs.
        Prints the server's warnings and errors of the run, if any."""
        if self.problems:
            log(f"kvcache serve logged {len(self.problems)} warnings or errors; the first:")
            for line in self.problems[:5]:
                log("  " + line[:2000])
            self.problems.clear()
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def __enter__(self) -> ServedProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_flags(p: Profile, use_ray: bool) -> list[str]:
    """``kvcache serve`` flags giving the profile's model layout, one pool on its device."""
    flags = [
        "--num-layers", str(p.num_layers), "--num-kv-heads", str(p.num_kv_heads),
        "--head-dim", str(p.head_dim), "--block-size", "16", "--dtype", p.dtype,
        "--num-workers", "1", "--blocks-per-worker", str(p.blocks_per_worker),
        "--device", p.device,
    ]  # fmt: skip
    return [*flags, "--ray-num-cpus", "2"] if use_ray else [*flags, "--in-process"]


# The server's own timing, from its Prometheus metrics: (metric, label filter) -> stage.
SERVER_SERIES = {
    "server": ("kvcache_rpc_duration_seconds", ("method", ("AppendAttendBatch", "AppendAttend",
               "Session.AppendAttendBatch", "Session.AppendAttend"))),
    "worker": ("kvcache_worker_call_duration_seconds", None),
}  # fmt: skip


def scrape(url: str | None) -> dict[str, tuple[float, float]]:
    """Per stage of :data:`SERVER_SERIES`: (seconds, count) summed over its label sets;
    empty when there is no /metrics to read (an external service)."""
    if url is None:
        return {}
    with urllib.request.urlopen(url, timeout=30) as reply:
        text = reply.read().decode()
    totals: dict[str, list[float]] = {stage: [0.0, 0.0] for stage in SERVER_SERIES}
    for family in text_string_to_metric_families(text):
        for stage, (name, label) in SERVER_SERIES.items():
            if family.name != name.removesuffix("_seconds") and family.name != name:
                continue
            for sample in family.samples:
                if label is not None and sample.labels.get(label[0]) not in label[1]:
                    continue
                if sample.name == name + "_sum":
                    totals[stage][0] += sample.value
                elif sample.name == name + "_count":
                    totals[stage][1] += sample.value
    return {stage: (v[0], v[1]) for stage, v in totals.items()}


@dataclass
class StageTimes:
    """Where the service runs' time went, seconds summed over the timed runs."""

    total: float = 0.0  # the generate() calls
    attend: float = 0.0  # the attention layers' service path (integration + client call)
    client_call: float = 0.0  # inside the client's append-and-attend calls
    calls: int = 0  # append-and-attend calls
    leased: float = 0.0  # layers run under a step lease on the mapped pool (host time)
    leased_calls: int = 0
    lease: float = 0.0  # the StepLease calls and a held lease's next steps (host time)
    leases: int = 0
    lease_forwards: int = 0
    server: float = 0.0  # the server handling them (its rpc_duration histogram)
    server_calls: float = 0.0
    worker: float = 0.0  # the coordinator -> worker calls (worker_call_duration)
    worker_calls: float = 0.0

    def add(self, seconds: float, stats: Any, before: dict, after: dict) -> None:
        self.total += seconds
        self.attend += stats.attend_seconds
        self.client_call += stats.rpc_seconds
        self.calls += stats.rpc_calls
        self.leased += stats.leased_seconds
        self.leased_calls += stats.leased_calls
        self.lease += stats.lease_seconds
        self.leases += stats.leases
        self.lease_forwards += stats.lease_forwards
        if before and after:
            self.server += after["server"][0] - before["server"][0]
            self.server_calls += after["server"][1] - before["server"][1]
            self.worker += after["worker"][0] - before["worker"][0]
            self.worker_calls += after["worker"][1] - before["worker"][1]

    def split_us(self) -> dict[str, float | None]:
        """Microseconds: per layer (calls and leased layers alike) the model outside
        attention and the integration (checks, host copies);
        per append-and-attend call (None without calls) client + transport (encode, send,
        wait, decode: the client call less the server's handling), server (handling less
        the worker call), worker (the pool's write and kernel, with the actor round trip
        if Ray); per leased layer the host time of the service's part (the inputs copied,
        the write and the attention launched or replayed as a graph; the kernels run on
        the device meanwhile), per leased forward its StepLease call, and the share of
        layers that went leased."""
        layers = max(self.calls + self.leased_calls, 1)
        n = self.calls
        known = self.server_calls > 0 and n > 0
        call_attend = self.attend - self.leased - self.lease
        per = {
            "model": (self.total - self.attend) / layers * 1e6,
            "integration": (call_attend - self.client_call) / layers * 1e6,
            "call": self.client_call / n * 1e6 if n else None,
            "client_transport": (self.client_call - self.server) / n * 1e6 if known else None,
            "server": (self.server - self.worker) / n * 1e6 if known else None,
            "worker": self.worker / n * 1e6 if known else None,
            "leased": self.leased / self.leased_calls * 1e6 if self.leased_calls else None,
            "lease_per_forward": (
                self.lease / self.lease_forwards * 1e6 if self.lease_forwards else None
            ),
            "forwards_per_lease": self.lease_forwards / self.leases if self.leases else None,
            "leased_share": self.leased_calls / layers,
        }
        return per


def open_service(
    p: Profile, use_ray: bool, mode: str, target: str | None, stack: contextlib.ExitStack
) -> tuple[str, str | None, str]:
    """Start (or name) the service: (address, its /metrics URL or None, a description)."""
    pools = "ray" if use_ray else "in-process"
    if mode == "external":
        assert target is not None
        return target, None, f"external {target}"
    if mode == "process":
        served = stack.enter_context(ServedProcess(serve_flags(p, use_ray)))
        return served.address, served.metrics_url, f"`kvcache serve` process, {pools} pools"
    config = ServiceConfig(
        layout=LayoutConfig(
            num_layers=p.num_layers,
            num_kv_heads=p.num_kv_heads,
            head_dim=p.head_dim,
            block_size=16,
            dtype=p.dtype,
        ),
        workers=WorkersConfig(
            num_workers=1,
            blocks_per_worker=p.blocks_per_worker,
            device=p.device,
            in_process=not use_ray,
            ray_num_cpus=2 if use_ray else None,
        ),
        server=ServerConfig(port=0),
        metrics=MetricsConfig(port=0),
        log_level="WARNING",
    )
    embedded = stack.enter_context(EmbeddedService(config))
    url = embedded.running.metrics_http.url if embedded.running.metrics_http else None
    return embedded.address, url, f"embedded in the model's process, {pools} pools"


def run(
    p: Profile,
    use_ray: bool,
    mode: str,
    target: str | None,
    leases: bool = True,
    shared_prefix: int = 0,
    shared_batch: int = 16,
    lease_steps: int = SessionConfig.lease_steps,
) -> dict[str, Any]:
    model = build_model(p)
    own = copy.deepcopy(model)
    own.set_attn_implementation("sdpa")
    settings = dict(max_new_tokens=p.new_tokens, min_new_tokens=p.new_tokens, do_sample=False)
    rows = []
    with contextlib.ExitStack() as stack:
        address, metrics_url, service = open_service(p, use_ray, mode, target, stack)
        client = stack.enter_context(KVCacheClient(address, timeout_s=120))
        served = ServiceModel(model, client)
        for batch in p.batch_sizes:
            ids, mask = prompts(p, batch, seed=batch)
            dev_ids, dev_mask = ids.to(p.device), mask.to(p.device)
            tokens = batch * p.new_tokens
            stages = StageTimes()
            with torch.no_grad():
                # Warm-up (kernels, allocator, gRPC channel): own once; the service twice,
                # as a running server is: a decode step's CUDA graphs are captured at the
                # second sighting of its shape (workers.decode_graphs), once per process.
                own.generate(input_ids=dev_ids, attention_mask=dev_mask, **settings)
                cold = SessionConfig(
                    reuse_prefix=False, step_leases=leases, lease_steps=lease_steps
                )
                warm = SessionConfig(step_leases=leases, lease_steps=lease_steps)
                for _ in range(2 if p.device == "cuda" else 1):
                    served.generate(ids, mask, cold, **settings)
                # The reuse run's shapes (a shorter, ragged prefill) compile and capture
                # their own kernel variants and graphs once, as the cold run's did above.
                served.generate(ids, mask, warm, **settings)
                own_t, svc_t, rpc_t, pre_t = [], [], [], []
                for _ in range(p.repeats):
                    t, ref = timed(
                        functools.partial(
                            own.generate, input_ids=dev_ids, attention_mask=dev_mask, **settings
                        ),
                        p.device,
                    )
                    own_t.append(t)
                    before = scrape(metrics_url)
                    t, (out, stats) = timed(
                        functools.partial(served.generate, ids, mask, cold, **settings), p.device
                    )
                    stages.add(t, stats, before, scrape(metrics_url))
                    svc_t.append(t)
                    rpc_t.append(stats.rpc_seconds / t)
                    t, (out_prefix, pstats) = timed(
                        functools.partial(served.generate, ids, mask, warm, **settings), p.device
                    )
                    pre_t.append(t)
            width = ids.shape[1]
            same = (out[:, width:].cpu() == ref[:, width:].cpu()).float().mean().item()
            same_prefix = (
                (out_prefix[:, width:].cpu() == out[:, width:].cpu()).float().mean().item()
            )
            own_tok_s = tokens / statistics.median(own_t)
            service_tok_s = tokens / statistics.median(svc_t)
            row = dict(
                batch=batch,
                prompt_tokens=int(mask.sum()),
                new_tokens=tokens,
                own_tok_s=own_tok_s,
                service_tok_s=service_tok_s,
                ratio=service_tok_s / own_tok_s,
                prefix_tok_s=tokens / statistics.median(pre_t),
                rpc_share=statistics.median(rpc_t),
                rpcs_per_run=stats.rpc_calls,
                per_call_us=stages.split_us(),
                prefix_cached_tokens=sum(pstats.cached_tokens),
                prefix_prefill_tokens=sum(pstats.prefill_tokens),
                same_tokens_as_own=same,
                prefix_same_tokens=same_prefix,
            )
            rows.append(row)
            log(
                f"batch {batch:3d}: own {row['own_tok_s']:8.1f} tok/s | service "
                f"{row['service_tok_s']:8.1f} tok/s ({row['ratio']:.2f}x; "
                f"{row['rpc_share']:.0%} in RPCs, "
                f"{row['rpcs_per_run']} RPCs) | prefix reuse {row['prefix_tok_s']:8.1f} tok/s "
                f"(prefill {row['prefix_prefill_tokens']} of {row['prompt_tokens']} tokens) | "
                f"same tokens as own {same:.1%}, prefix run vs service {same_prefix:.1%}"
            )
            log("  per call, us: " + format_split(row["per_call_us"]))
        shared = (
            shared_prefix_run(p, own, served, shared_prefix, shared_batch, leases, lease_steps)
            if shared_prefix
            else None
        )
        transport = (
            "local session socket" if client.local_session_active else "gRPC session stream"
        ) + (", shared memory" if client.shared_memory_active else ", tensors as bytes")
        served.detach()
    return dict(
        profile=asdict(p),
        service=f"{service}; client calls over the {transport}",
        rows=rows,
        shared_prefix=shared,
        device=torch.cuda.get_device_name(0)
        if p.device == "cuda"
        else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        torch=torch.__version__,
        transformers=transformers.__version__,
        python=platform.python_version(),
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        command=" ".join(sys.argv),
        commit=git_commit(),
    )


def shared_prefix_run(
    p: Profile,
    own: Any,
    served: ServiceModel,
    prefix_len: int,
    batch: int,
    leases: bool,
    lease_steps: int,
) -> dict[str, Any]:
    """`batch` requests sharing a system prompt of `prefix_len` tokens (each with 64 tokens
    of its own), the system prompt cached in the service by an earlier request: time to
    first token (a generate of one token; through the service the session's open, which
    creates the rows, and its generate, the rows' freeing after the token timed apart)
    and tokens/s of a whole generation (its open and close included), own cache against
    the service with prefix reuse. Each repeat sends other suffixes, so only the system
    prompt is ever reused."""

    def first_token(ids: torch.Tensor, mask: torch.Tensor) -> tuple[float, Any]:
        sync(p.device)
        t0 = time.perf_counter()
        session = served.session(ids, mask, reuse)
        try:
            session.generate(**first)
            sync(p.device)
            elapsed = time.perf_counter() - t0
        finally:
            session.close()
        return elapsed, session.stats

    gen = torch.Generator().manual_seed(7)
    system = torch.randint(1, p.vocab_size, (prefix_len,), generator=gen)

    def requests(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        suffix = torch.randint(1, p.vocab_size, (batch, 64), generator=g)
        ids = torch.cat([system.expand(batch, -1), suffix], dim=1)
        return ids, torch.ones_like(ids)

    reuse = SessionConfig(step_leases=leases, lease_steps=lease_steps)
    first = dict(max_new_tokens=1, min_new_tokens=1, do_sample=False)
    whole = dict(max_new_tokens=p.new_tokens, min_new_tokens=p.new_tokens, do_sample=False)
    times: dict[str, list[float]] = {
        k: [] for k in ("ttft_own", "ttft", "gen_own", "gen", "open", "close")
    }
    with torch.no_grad():
        ids, mask = requests(1000)  # caches the system prompt
        served.generate(ids[:1], mask[:1], reuse, **first)
        # Both paths warmed on a whole generation: own's cache grows its allocations
        # (a first run's device allocations would count against own alone).
        ids, mask = requests(1001)
        own.generate(input_ids=ids.to(p.device), attention_mask=mask.to(p.device), **whole)
        served.generate(ids, mask, reuse, **whole)
        for r in range(p.repeats):
            for kind, settings in (("ttft", first), ("gen", whole)):
                ids, mask = requests(2000 + 2 * r + (kind == "gen"))
                dev = dict(input_ids=ids.to(p.device), attention_mask=mask.to(p.device))
                t, _ = timed(functools.partial(own.generate, **dev, **settings), p.device)
                times[f"{kind}_own"].append(t)
                if kind == "ttft":
                    t, stats = first_token(ids, mask)
                    times["open"].append(stats.open_seconds)
                    times["close"].append(stats.close_seconds)
                else:
                    t, (_, stats) = timed(
                        functools.partial(served.generate, ids, mask, reuse, **settings), p.device
                    )
                times[kind].append(t)
    med = {k: statistics.median(v) for k, v in times.items()}
    tokens = batch * p.new_tokens
    out = dict(
        prefix_len=prefix_len,
        batch=batch,
        ttft_own_ms=med["ttft_own"] * 1e3,
        ttft_ms=med["ttft"] * 1e3,
        ttft_ratio=med["ttft"] / med["ttft_own"],
        ttft_open_ms=med["open"] * 1e3,
        ttft_close_ms=med["close"] * 1e3,
        own_tok_s=tokens / med["gen_own"],
        service_tok_s=tokens / med["gen"],
        cached_tokens=sum(stats.cached_tokens),
        prefill_tokens=sum(stats.prefill_tokens),
    )
    log(
        f"shared prefix {prefix_len} x {batch}: time to first token own "
        f"{out['ttft_own_ms']:.1f} ms, service {out['ttft_ms']:.1f} ms "
        f"({out['ttft_ratio']:.2f}x; of it creating the rows {out['ttft_open_ms']:.1f} ms; "
        f"freeing them after {out['ttft_close_ms']:.1f} ms); tokens/s own {out['own_tok_s']:.1f}, service "
        f"{out['service_tok_s']:.1f}; the last run prefilled {out['prefill_tokens']} tokens, "
        f"{out['cached_tokens']} cached"
    )
    return out


def git_commit() -> str:
    """The repository's HEAD commit (short), with "+dirty" for uncommitted changes."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "unknown"
    return (head or "unknown") + ("+dirty" if dirty else "")


def format_split(split: dict[str, float | None]) -> str:
    return ", ".join(
        f"{name} {'-' if value is None else f'{value:.2f}' if name.endswith('share') else f'{value:.0f}'}"
        for name, value in split.items()
    )


def report(result: dict[str, Any]) -> str:
    """The Markdown tables of a `run` result, with its date, command and device first."""
    p = result["profile"]
    lines = [
        f"# transformers through the service ({p['name']})",
        "",
        f"- date: {result['date']}",
        f"- command: `{result['command']}`",
        f"- commit: {result['commit']}",
        f"- device: {result['device']}; torch {result['torch']}, transformers "
        f"{result['transformers']}, python {result['python']}",
        f"- model: Llama-shaped, {p['num_layers']} layers, {p['num_q_heads']} query / "
        f"{p['num_kv_heads']} KV heads, head_dim {p['head_dim']}, {p['dtype']}; prompts up to "
        f"{p['prompt_len']} tokens, {p['new_tokens']} new tokens, greedy; median of "
        f"{p['repeats']}; service: {result['service']}",
        "",
        "| batch | own tok/s | service tok/s | service / own | share in RPCs "
        "| prefix reuse tok/s | prefilled with reuse | same tokens as own |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['batch']} | {r['own_tok_s']:.1f} | {r['service_tok_s']:.1f} | "
            f"{r['ratio']:.2f}x | {r['rpc_share']:.0%} | {r['prefix_tok_s']:.1f} | "
            f"{r['prefix_prefill_tokens']} of {r['prompt_tokens']} | {r['same_tokens_as_own']:.1%} |"
        )
    lines += [
        "",
        "Where one layer's time goes (service runs without prefix reuse, mean, "
        "microseconds): *model* = the rest of the forward, per layer; *integration* = "
        "checks and the tensors' moves around the layer's call or lease, per layer; per "
        "append-and-attend call (`-` without calls): *call* = inside "
        "the client call, split into *client + transport* (encode, send, wait, decode) = "
        "the call less the server's handling, *server* = its handling (`rpc_duration`) less "
        "the worker call, *worker* = the pool's write and kernel (`worker_call_duration`). "
        "`-`: no server metrics (an external service). *leased*: a layer run in the model's "
        "process on the worker's mapped pool under a step lease, the host time of the "
        "service's part (inputs copied, write and attention launched); *leased share*: of "
        "all layers; *lease / forward*: per leased forward, its share of the lease's host "
        "time (the StepLease call that plans up to `--lease-steps` decode forwards, or "
        "taking the held lease's next step; the lease's open counts in its first layer's "
        "*leased*; its end, which waits for the device, in *model*); *forwards / lease*: "
        "forwards run under each lease.",
        "",
        "| batch | model | integration | call | client + transport | server | worker "
        "| leased | leased share | lease / forward | forwards / lease |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        split = r["per_call_us"]
        cells = [
            "-" if split.get(k) is None else f"{split[k]:.0f}"
            for k in (
                "model",
                "integration",
                "call",
                "client_transport",
                "server",
                "worker",
                "leased",
            )
        ]
        cells.append(f"{split.get('leased_share', 0.0):.0%}")
        forward = split.get("lease_per_forward")
        cells.append("-" if forward is None else f"{forward:.0f}")
        per_lease = split.get("forwards_per_lease")
        cells.append("-" if per_lease is None else f"{per_lease:.1f}")
        lines.append(f"| {r['batch']} | " + " | ".join(cells) + " |")
    shared = result.get("shared_prefix")
    if shared:
        lines += [
            "",
            f"{shared['batch']} requests sharing a system prompt of {shared['prefix_len']} "
            "tokens (64 tokens each of their own), the system prompt cached in the service "
            "by an earlier request; the service with prefix reuse. Its time to first token "
            "is the session's open (creating the rows) and first forward; the rows' "
            "freeing after the token is apart (*close*); tokens/s include both.",
            "",
            "| time to first token, own | through the service | service / own | of it: open "
            "| close | own tok/s | service tok/s | prefilled / cached tokens (last run) |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
            f"| {shared['ttft_own_ms']:.1f} ms | {shared['ttft_ms']:.1f} ms | "
            f"{shared['ttft_ratio']:.2f}x | {shared['ttft_open_ms']:.1f} ms | "
            f"{shared['ttft_close_ms']:.1f} ms | {shared['own_tok_s']:.1f} | "
            f"{shared['service_tok_s']:.1f} | {shared['prefill_tokens']} / "
            f"{shared['cached_tokens']} |",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--h200", action="store_true", help="CUDA bf16 1.1B Llama-shaped config")
    size.add_argument(
        "--h200-8b", action="store_true", help="CUDA bf16 8B Llama-shaped config, batch 32"
    )
    size.add_argument(
        "--smoke", action="store_true", help="the smallest CPU run (seconds; figures mean nothing)"
    )
    parser.add_argument("--ray", action="store_true", help="KV pools in Ray actors")
    parser.add_argument(
        "--no-leases",
        action="store_true",
        help="every layer as a call (no step leases), to compare with the leased path",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--target",
        help="host:port of a running service whose layout fits the profile's model "
        "(default: start `kvcache serve` in a process of its own)",
    )
    where.add_argument(
        "--embedded",
        action="store_true",
        help="run the service in the model's process (a background thread) instead",
    )
    parser.add_argument("--batch-sizes", help="comma-separated, overrides the profile's")
    parser.add_argument(
        "--lease-steps",
        type=int,
        default=SessionConfig.lease_steps,
        help="decode forwards one step lease covers (SessionConfig.lease_steps; 1: a "
        "lease per forward)",
    )
    parser.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        help="also time requests sharing a system prompt of this many tokens (0: off)",
    )
    parser.add_argument(
        "--shared-batch", type=int, default=16, help="requests sharing the system prompt"
    )
    parser.add_argument("--prompt-len", type=int)
    parser.add_argument("--new-tokens", type=int)
    parser.add_argument("--repeats", type=int)
    parser.add_argument(
        "--out", type=Path, help="directory for bench_transformers_<profile>.json and .md"
    )
    args = parser.parse_args()

    p = H200 if args.h200 else H200_8B if args.h200_8b else SMOKE if args.smoke else CPU
    if p.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--h200 needs a CUDA device")
    if args.batch_sizes:
        p = replace(p, batch_sizes=tuple(int(b) for b in args.batch_sizes.split(",")))
    for name in ("prompt_len", "new_tokens", "repeats"):
        if getattr(args, name) is not None:
            p = replace(p, **{name: getattr(args, name)})
    log(f"profile {p.name}: {p}")
    mode = "external" if args.target else "embedded" if args.embedded else "process"
    result = run(
        p,
        args.ray,
        mode,
        args.target,
        leases=not args.no_leases,
        shared_prefix=args.shared_prefix,
        shared_batch=args.shared_batch,
        lease_steps=args.lease_steps,
    )
    text = report(result)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"bench_transformers_{p.name}.json"
        path.write_text(json.dumps(result, indent=2))
        path.with_suffix(".md").write_text(text)
        log(f"wrote {path} and its .md")
    print(text, flush=True)


if __name__ == "__main__":
    main()
