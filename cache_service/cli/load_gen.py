"""Bounded load generator: many concurrent clients mixing create / append / attend / fork /
free against a running server, checking sampled attention outputs against dense attention.

Used by ``benchmarks/bench_load.py`` (64 clients, 60 s) and ``tests/test_load.py`` (shorter).
Each client is a thread with its own :class:`KVCacheClient` (own connection) and at most
``max_live`` sequences. Bounded twice: by wall time and by a total operation count.

The K/V of a token are a fixed function of (token id, position, layer) drawn from shared
random tables, so every client can rebuild any sequence's K/V from its token ids alone, and
sequences with the same prompt prefix hold the same K/V - which is what makes prefix
sharing between clients correct and checkable. Sampled outputs are compared with float64
dense attention over those K/V.

The server can run in a child process (:class:`ServerProcess`) so its resident memory is
measured alone (``/proc/<pid>/status``, VmRSS) while the load runs.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import os
import random
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from cache_service.cli.bench import percentile
from cache_service.client import (
    AppendAttendItem,
    AttendItem,
    KVCacheClient,
    KVCacheError,
)
from cache_service.config import ServiceConfig, from_dict, to_dict
from workers.layout import KVLayout

__all__ = [
    "OPS",
    "KVTables",
    "LoadConfig",
    "LoadResult",
    "ServerProcess",
    "dense_attention",
    "percentile",
    "read_rss_bytes",
    "run_load",
    "scrape_metric",
]

OPS = ("create", "append", "append_attend", "attend", "fork", "free")


@dataclass(frozen=True)
class LoadConfig:
    """What the load looks like.

    Attributes:
        clients: concurrent client threads.
        duration_s: stop starting operations after this many seconds.
        max_ops: ... or after this many operations over all clients (a fixed count).
        check_fraction: share of attention outputs compared with dense attention, [0, 1].
        max_live: sequences one client holds at once.
        max_tokens: a sequence longer than this is freed.
        prompts: shared system prompts (prefix sharing across clients); prompt_len tokens.
        num_q_heads: query heads (a multiple of the layout's KV heads).
        timeout_s: deadline of each call.
        seed: seed of every client's choices (client i uses seed + i).
    """

    clients: int = 64
    duration_s: float = 60.0
    max_ops: int = 1_000_000
    check_fraction: float = 0.25
    max_live: int = 2
    max_tokens: int = 80
    prompts: int = 4
    prompt_len: int = 36
    num_q_heads: int = 4
    timeout_s: float = 120.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("clients", "max_ops", "max_live", "max_tokens", "prompts", "prompt_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not self.duration_s > 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s!r}")
        if not 0 <= self.check_fraction <= 1:
            raise ValueError(f"check_fraction must be in [0, 1], got {self.check_fraction!r}")


@dataclass
class LoadResult:
    """What a run measured.

    Attributes:
        ops: operations completed, by kind.
        latency_s: per kind, every completed operation's wall time, seconds.
        errors: unexpected failures, "op: message" (none expected).
        checked, mismatches: attention outputs compared with dense / that differed.
        max_abs_err: largest |output - dense| over the compared outputs.
        wall_s: seconds from the first operation to the last client's end.
        prefix_hit_tokens: prompt tokens found cached at create.
        rss: (seconds since start, coordinator resident bytes) samples.
    """

    ops: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OPS, 0))
    latency_s: dict[str, list[float]] = field(default_factory=lambda: {op: [] for op in OPS})
    errors: list[str] = field(default_factory=list)
    checked: int = 0
    mismatches: int = 0
    max_abs_err: float = 0.0
    wall_s: float = 0.0
    prefix_hit_tokens: int = 0
    rss: list[tuple[float, int]] = field(default_factory=list)

    @property
    def total_ops(self) -> int:
        return sum(self.ops.values())


# ------------------------------------------------------------------------------ K/V oracle


class KVTables:
    """K/V of token ``t`` at position ``p`` on layer ``l``:
    ``base[l, t % vocab] + 0.5 * pos[l, p % max_pos]`` (float32 ``[Hkv, D]`` each)."""

    def __init__(self, layout: KVLayout, *, vocab: int = 4096, max_pos: int = 512, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        shape = (layout.num_layers, vocab, layout.num_kv_heads, layout.head_dim)
        pshape = (layout.num_layers, max_pos, layout.num_kv_heads, layout.head_dim)
        self._base = [torch.randn(shape, generator=gen) for _ in range(2)]
        self._pos = [torch.randn(pshape, generator=gen) for _ in range(2)]
        self._vocab = vocab
        self._max_pos = max_pos
        self.num_layers = layout.num_layers

    def kv(
        self, tokens: list[int], start: int, layer: int | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of ``tokens`` at positions ``start..``: ``[n, Hkv, D]``, or ``[L, n, Hkv, D]``
        for layer None; float32."""
        ids = torch.tensor(tokens, dtype=torch.long) % self._vocab
        pos = torch.arange(start, start + len(tokens)) % self._max_pos
        layers = slice(None) if layer is None else layer
        return tuple(  # type: ignore[return-value]
            b[layers][..., ids, :, :] + 0.5 * p[layers][..., pos, :, :]
            for b, p in zip(self._base, self._pos, strict=True)
        )


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal float64 attention of ``q [m, Hq, D]`` (the last m positions) over
    ``k, v [n, Hkv, D]``; returns ``[m, Hq, D]`` float64."""
    m, hq, d = q.shape
    n, hkv, _ = k.shape
    group = hq // hkv
    kd = k.double().repeat_interleave(group, dim=1)
    vd = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("mhd,nhd->hmn", q.double(), kd) * d**-0.5
    future = torch.arange(n)[None, :] > torch.arange(n - m, n)[:, None]
    scores = scores.masked_fill(future, -math.inf)
    return torch.einsum("hmn,nhd->mhd", torch.softmax(scores, dim=-1), vd)


# ------------------------------------------------------------------------------ clients


@dataclass
class _Seq:
    seq_id: str
    tokens: list[int]


class _Client:
    """One client thread's loop (see the module docstring)."""

    def __init__(
        self,
        index: int,
        address: str,
        layout: KVLayout,
        tables: KVTables,
        prompts: list[list[int]],
        config: LoadConfig,
        budget: Callable[[], bool],
        token: str | None,
    ) -> None:
        self.rng = random.Random(config.seed + index)
        self.gen = torch.Generator().manual_seed(config.seed * 1000 + index)
        self.address = address
        self.layout = layout
        self.tables = tables
        self.prompts = prompts
        self.config = config
        self.budget = budget
        self.token = token
        self.live: list[_Seq] = []
        self.result = LoadResult()

    def run(self) -> None:
        with KVCacheClient(
            self.address, token=self.token, timeout_s=self.config.timeout_s, max_attempts=1
        ) as client:
            self.client = client
            while self.budget():
                op = self._choose()
                t0 = time.perf_counter()
                try:
                    getattr(self, f"_{op}")()
                except KVCacheError as exc:
                    self.result.errors.append(f"{op}: {exc}")
                    self._forget_failed()
                    continue
                self.result.latency_s[op].append(time.perf_counter() - t0)
                self.result.ops[op] += 1
            for seq in self.live:
                try:
                    client.free(seq.seq_id)
                except KVCacheError as exc:
                    self.result.errors.append(f"final free: {exc}")
            self.live.clear()

    def _choose(self) -> str:
        if not self.live:
            return "create"
        if any(len(s.tokens) >= self.config.max_tokens for s in self.live):
            return "free"
        room = len(self.live) < self.config.max_live
        weights = {
            "create": 0.10 if room else 0.0,
            "append": 0.10,
            "append_attend": 0.42,
            "attend": 0.20,
            "fork": 0.08 if room else 0.0,
            "free": 0.10,
        }
        ops, w = zip(*weights.items(), strict=True)
        return self.rng.choices(ops, w)[0]

    def _forget_failed(self) -> None:
        # After an unexpected failure the client-side copy may be off: start afresh.
        for seq in self.live:
            try:
                self.client.free(seq.seq_id)
            except KVCacheError:
                pass
        self.live.clear()

    # -- operations --------------------------------------------------------------------

    def _create(self) -> None:
        rng = self.rng
        if rng.random() < 0.7:
            prompt = list(rng.choice(self.prompts))
            prompt += [rng.randrange(4096) for _ in range(rng.randint(1, 8))]
        else:
            prompt = [rng.randrange(4096) for _ in range(rng.randint(1, 20))]
        handle = self.client.create_sequence(prompt)
        cached = handle.num_cached_tokens
        self.result.prefix_hit_tokens += cached
        seq = _Seq(handle.seq_id, prompt[:cached])
        self.live.append(seq)
        if cached < len(prompt):
            self._write_all_layers(seq, prompt[cached:])

    def _append(self) -> None:
        seq = self.rng.choice(self.live)
        self._write_all_layers(
            seq, [self.rng.randrange(4096) for _ in range(self.rng.randint(1, 8))]
        )

    def _write_all_layers(self, seq: _Seq, new: list[int]) -> None:
        k, v = self.tables.kv(new, len(seq.tokens), None)
        self.client.append(seq.seq_id, new, k, v)
        seq.tokens += new

    def _append_attend(self) -> None:
        """A decode step: one new token on every layer, one query row each."""
        seq = self.rng.choice(self.live)
        token = self.rng.randrange(4096)
        pos = len(seq.tokens)
        for layer in range(self.layout.num_layers):
            k, v = self.tables.kv([token], pos, layer)
            q = torch.randn(1, self.config.num_q_heads, self.layout.head_dim, generator=self.gen)
            (out,) = self.client.append_attend(
                layer, [AppendAttendItem(seq.seq_id, [token], k, v, q)]
            )
            self._maybe_check([*seq.tokens, token], layer, q, out)
        seq.tokens.append(token)

    def _attend(self) -> None:
        seq = self.rng.choice([s for s in self.live if s.tokens] or self.live)
        if not seq.tokens:
            return
        layer = self.rng.randrange(self.layout.num_layers)
        m = self.rng.randint(1, min(4, len(seq.tokens)))
        q = torch.randn(m, self.config.num_q_heads, self.layout.head_dim, generator=self.gen)
        (out,) = self.client.attend(layer, [AttendItem(seq.seq_id, q)])
        self._maybe_check(seq.tokens, layer, q, out)

    def _fork(self) -> None:
        src = self.rng.choice(self.live)
        handle = self.client.fork(src.seq_id)
        self.live.append(_Seq(handle.seq_id, list(src.tokens)))

    def _free(self) -> None:
        longest = max(self.live, key=lambda s: len(s.tokens))
        seq = (
            longest if len(longest.tokens) >= self.config.max_tokens else self.rng.choice(self.live)
        )
        self.client.free(seq.seq_id)
        self.live.remove(seq)

    def _maybe_check(self, tokens: list[int], layer: int, q: torch.Tensor, out: Any) -> None:
        if self.rng.random() >= self.config.check_fraction:
            return
        k, v = self.tables.kv(tokens, 0, layer)
        ref = dense_attention(q, k, v)
        err = float((out.double() - ref).abs().max())
        self.result.checked += 1
        self.result.max_abs_err = max(self.result.max_abs_err, err)
        if not err <= 1e-4:  # float32 pools; NaN fails too
            self.result.mismatches += 1
            self.result.errors.append(f"attention mismatch on layer {layer}: max |err| {err:.3g}")


def run_load(
    address: str,
    layout: KVLayout,
    config: LoadConfig,
    *,
    rss_pid: int | None = None,
    token: str | None = None,
    progress: Callable[[float, int], None] | None = None,
) -> LoadResult:
    """Run the load against the server at ``address`` and return the merged figures.

    Args:
        address: "host:port" of the server.
        layout: the server's layout (``client.info().layout``).
        config: the load.
        rss_pid: the coordinator's process id, whose RSS is sampled every second.
        token: bearer token when the server authenticates.
        progress: called about every 5 s with (seconds elapsed, operations so far).
    """
    if config.num_q_heads % layout.num_kv_heads:
        raise ValueError(
            f"num_q_heads={config.num_q_heads} is not a multiple of the layout's "
            f"{layout.num_kv_heads} KV heads"
        )
    tables = KVTables(layout, max_pos=max(512, config.max_tokens + 16), seed=config.seed)
    prng = random.Random(config.seed)
    prompts = [
        [prng.randrange(4096) for _ in range(config.prompt_len)] for _ in range(config.prompts)
    ]
    lock = threading.Lock()
    started = [0]
    t0 = time.monotonic()
    deadline = t0 + config.duration_s

    def budget() -> bool:
        with lock:
            if started[0] >= config.max_ops or time.monotonic() >= deadline:
                return False
            started[0] += 1
            return True

    clients = [
        _Client(i, address, layout, tables, prompts, config, budget, token)
        for i in range(config.clients)
    ]
    threads = [threading.Thread(target=c.run, name=f"load-{i}") for i, c in enumerate(clients)]
    done = threading.Event()
    rss: list[tuple[float, int]] = []
    sampler = threading.Thread(
        target=_sample, args=(rss_pid, t0, rss, done, progress, lambda: started[0]), daemon=True
    )
    sampler.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    done.set()
    sampler.join(5)
    merged = LoadResult(wall_s=wall, rss=rss)
    for c in clients:
        r = c.result
        for op in OPS:
            merged.ops[op] += r.ops[op]
            merged.latency_s[op].extend(r.latency_s[op])
        merged.errors.extend(r.errors)
        merged.checked += r.checked
        merged.mismatches += r.mismatches
        merged.max_abs_err = max(merged.max_abs_err, r.max_abs_err)
        merged.prefix_hit_tokens += r.prefix_hit_tokens
    return merged


def _sample(
    pid: int | None,
    t0: float,
    out: list[tuple[float, int]],
    done: threading.Event,
    progress: Callable[[float, int], None] | None,
    count: Callable[[], int],
) -> None:
    last_report = t0
    while not done.wait(1.0):
        now = time.monotonic()
        if pid is not None:
            out.append((now - t0, read_rss_bytes(pid)))
        if progress is not None and now - last_report >= 5.0:
            progress(now - t0, count())
            last_report = now
    if pid is not None:
        out.append((time.monotonic() - t0, read_rss_bytes(pid)))


def read_rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid``, bytes (Linux ``/proc/<pid>/status``)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS line for process {pid}")


def scrape_metric(url: str, name: str, labels: dict[str, str] | None = None) -> float:
    """Sum of the samples of metric ``name`` (matching ``labels``) at a Prometheus URL."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name != name:
                continue
            if labels and any(sample.labels.get(k) != v for k, v in labels.items()):
                continue
            total += sample.value
    return total


# ------------------------------------------------------------------------------ server


def _serve_child(config_doc: dict[str, Any], conn: Any) -> None:
    """Child process: start the service, report (address, pid, metrics url), serve until
    told to stop."""
    from cache_service.api.server import configure_logging, start_service

    config = from_dict(config_doc)
    configure_logging(config.log_level, config.log_format)

    async def main() -> None:
        try:
            running = await start_service(config)
        except BaseException as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
            raise
        url = running.metrics_http.url if running.metrics_http is not None else None
        conn.send(("ok", running.address, os.getpid(), url))
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        await running.stop(5.0)

    asyncio.run(main())


class ServerProcess:
    """The service in a child process (spawned), for measuring it apart from its clients.

    Args:
        config: the service configuration (use port 0, and metrics port 0 if enabled).
        start_timeout_s: seconds to wait for it to serve.

    Attributes (after start): address, pid, metrics_url.
    """

    def __init__(self, config: ServiceConfig, start_timeout_s: float = 180.0) -> None:
        self._config = config
        self._timeout = start_timeout_s
        self.address = ""
        self.pid = 0
        self.metrics_url: str | None = None

    def __enter__(self) -> ServerProcess:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_serve_child, args=(to_dict(self._config), child), name="kvcache-server"
        )
        self._proc.start()
        deadline = time.monotonic() + self._timeout
        while not self._conn.poll(0.5):
            if not self._proc.is_alive():
                raise RuntimeError(f"the server process exited with code {self._proc.exitcode}")
            if time.monotonic() > deadline:
                self._proc.kill()
                raise RuntimeError(f"the server did not start within {self._timeout} s")
        msg = self._conn.recv()
        if msg[0] != "ok":
            self._proc.join(10)
            raise RuntimeError(f"the server failed to start: {msg[1]}")
        _, self.address, self.pid, self.metrics_url = msg
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._conn.send("stop")
        except (BrokenPipeError, OSError):
            pass
        self._proc.join(60)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(10)
