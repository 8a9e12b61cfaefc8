"""`kvcache demo`: the service end to end, checked against dense attention.

Starts the service (a local Ray with CPU workers by default, the coordinator on localhost),
then runs a few clients whose prompts share a prefix. The first client computes the shared
prefix; the others find it cached (prefix hit) and compute only their own suffix. Every
client prefills, then decodes token by token, layer by layer, with append-and-attend, and
compares every attention output with dense attention computed locally in float64 over the
K/V it knows. One client also forks its sequence and decodes on the fork (copy-on-write).

The K/V come from a toy "model": a deterministic function of (layer, token id, position),
as a real model's K/V are a deterministic function of the prefix. That is what makes a
prefix computed by one client valid for another, and lets each client rebuild the cached
part of its reference locally.

Exit status: 0 when every output matches and every block is released at the end.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from cache_service.api.server import start_service
from cache_service.client import AppendAttendItem, KVCacheClient, ServiceStats
from cache_service.config import ServiceConfig

__all__ = ["ClientReport", "DemoConfig", "DemoReport", "ToyModel", "run_demo"]


@dataclass(frozen=True)
class DemoConfig:
    """What the demo runs.

    Attributes:
        clients: concurrent clients (>= 2: one computes the shared prefix, the rest reuse it).
        shared_prefix_tokens: prompt tokens every client shares.
        suffix_tokens: each client's own prompt tokens after the prefix.
        decode_steps: tokens decoded one at a time after the prompt.
        num_q_heads: query heads (GQA: a multiple of the layout's KV heads).
        atol: largest absolute difference to dense attention that counts as a match.
        seed: seeds the toy model and the queries.
    """

    clients: int = 3
    shared_prefix_tokens: int = 48
    suffix_tokens: int = 9
    decode_steps: int = 6
    num_q_heads: int = 4
    atol: float = 2e-4
    seed: int = 0

    def __post_init__(self) -> None:
        if self.clients < 2:
            raise ValueError(f"clients must be >= 2 (one computes the prefix), got {self.clients}")
        for name in ("shared_prefix_tokens", "suffix_tokens", "decode_steps", "num_q_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class ToyModel:
    """K/V as a deterministic function of (layer, token id, position); queries random.

    kv(layer, ids, start) returns key, value float32 ``[n, Hkv, D]`` for tokens ``ids`` at
    positions ``start .. start + n - 1``.
    """

    VOCAB = 1024

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        shape = (num_layers, self.VOCAB, num_kv_heads, head_dim)
        self._k = torch.randn(shape, generator=gen)
        self._v = torch.randn(shape, generator=gen)
        self._freq = torch.exp(-torch.arange(head_dim) / head_dim * math.log(1000.0))

    def kv(self, layer: int, ids: list[int], start: int) -> tuple[torch.Tensor, torch.Tensor]:
        tok = torch.tensor(ids) % self.VOCAB
        pos = torch.arange(start, start + len(ids), dtype=torch.float32)
        # A position term, so equal tokens at different positions differ (as with RoPE).
        rot = 0.5 * torch.sin(pos[:, None] * self._freq[None, :])[:, None, :]
        return self._k[layer, tok] + rot, self._v[layer, tok] - rot


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal float64 attention of ``q [n, Hq, D]`` (the last n positions) over
    ``k, v [T, Hkv, D]``; returns ``[n, Hq, D]`` float64."""
    n, hq, d = q.shape
    t, hkv, _ = k.shape
    g = hq // hkv
    kk = k.double().repeat_interleave(g, dim=1)
    vv = v.double().repeat_interleave(g, dim=1)
    scores = torch.einsum("nhd,khd->hnk", q.double(), kk) * d**-0.5
    pos = torch.arange(t - n, t)[:, None]
    scores = scores.masked_fill(torch.arange(t)[None, :] > pos, -math.inf)
    return torch.einsum("hnk,khd->nhd", scores.softmax(-1), vv)


@dataclass
class ClientReport:
    """One client's run."""

    name: str
    prompt_tokens: int
    looked_up: int = 0
    cached_tokens: int = 0
    computed_tokens: int = 0
    checks: int = 0
    mismatches: int = 0
    max_abs_err: float = 0.0
    seq_ids: list[str] = field(default_factory=list)


@dataclass
class DemoReport:
    """The whole run: per client, and the service's stats with the sequences alive and
    after they were freed."""

    clients: list[ClientReport]
    stats_live: ServiceStats | None = None
    stats_end: ServiceStats | None = None
    workers: int = 0
    address: str = ""

    @property
    def mismatches(self) -> int:
        return sum(c.mismatches for c in self.clients)

    @property
    def leaked_blocks(self) -> int:
        if self.stats_end is None:
            return 0
        return sum(w.used_blocks for w in self.stats_end.workers)

    @property
    def ok(self) -> bool:
        return self.mismatches == 0 and self.leaked_blocks == 0 and self.stats_end is not None


class _Sequence:
    """Client-side mirror of one sequence: its tokens and the reference K/V per layer."""

    def __init__(self, seq_id: str, num_layers: int) -> None:
        self.seq_id = seq_id
        self.tokens: list[int] = []
        self.keys: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self.values: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]


def _run_client(
    address: str,
    report: ClientReport,
    prompt: list[int],
    model: ToyModel,
    cfg: DemoConfig,
    seed: int,
    fork: bool,
    progress: Callable[[str], None],
) -> None:
    gen = torch.Generator().manual_seed(seed)
    with KVCacheClient(address, timeout_s=60.0) as client:
        layout = client.info().layout
        num_layers, d = layout.num_layers, layout.head_dim
        report.looked_up = client.lookup(prompt)
        handle = client.create_sequence(prompt)
        report.cached_tokens = handle.num_cached_tokens
        report.seq_ids.append(handle.seq_id)
        seq = _Sequence(handle.seq_id, num_layers)
        # The cached prefix: its K/V are in the service already; the reference needs them.
        cached = prompt[: handle.num_cached_tokens]
        seq.tokens = list(cached)
        for layer in range(num_layers):
            if cached:
                k, v = model.kv(layer, cached, 0)
                seq.keys[layer].append(k)
                seq.values[layer].append(v)

        def step(s: _Sequence, ids: list[int]) -> None:
            start = len(s.tokens)
            s.tokens.extend(ids)
            for layer in range(num_layers):
                k, v = model.kv(layer, ids, start)
                q = torch.randn(len(ids), cfg.num_q_heads, d, generator=gen)
                (out,) = client.append_attend(layer, [AppendAttendItem(s.seq_id, ids, k, v, q)])
                s.keys[layer].append(k)
                s.values[layer].append(v)
                ref = dense_attention(q, torch.cat(s.keys[layer]), torch.cat(s.values[layer]))
                err = float((out.double() - ref).abs().max())
                report.checks += 1
                report.max_abs_err = max(report.max_abs_err, err)
                if not err <= cfg.atol:
                    report.mismatches += 1
            report.computed_tokens += len(ids)

        step(seq, prompt[handle.num_cached_tokens :])
        progress(f"{report.name}: prefill done ({report.cached_tokens} cached)")
        for i in range(cfg.decode_steps):
            step(seq, [(prompt[-1] * 31 + i * 7) % ToyModel.VOCAB])
        if fork:
            child = client.fork(seq.seq_id)
            report.seq_ids.append(child.seq_id)
            mirror = _Sequence(child.seq_id, num_layers)
            mirror.tokens = list(seq.tokens)
            mirror.keys = [list(x) for x in seq.keys]
            mirror.values = [list(x) for x in seq.values]
            for i in range(2):
                step(mirror, [(prompt[-1] * 17 + i) % ToyModel.VOCAB])
        progress(f"{report.name}: {cfg.decode_steps} decode steps checked")


def _prompts(cfg: DemoConfig) -> list[list[int]]:
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    shared = torch.randint(1, ToyModel.VOCAB, (cfg.shared_prefix_tokens,), generator=gen).tolist()
    return [
        shared + torch.randint(1, ToyModel.VOCAB, (cfg.suffix_tokens,), generator=gen).tolist()
        for _ in range(cfg.clients)
    ]


def run_clients(
    address: str, cfg: DemoConfig, progress: Callable[[str], None] = lambda _: None
) -> DemoReport:
    """Run the demo's clients against a running service; frees everything at the end."""
    with KVCacheClient(address) as admin:
        layout = admin.info().layout
    model = ToyModel(layout.num_layers, layout.num_kv_heads, layout.head_dim, cfg.seed)
    prompts = _prompts(cfg)
    reports = [ClientReport(f"client-{i}", len(p)) for i, p in enumerate(prompts)]
    lock = threading.Lock()

    def say(msg: str) -> None:
        with lock:
            progress(msg)

    # Client 0 computes the shared prefix alone; the others then run concurrently and
    # find it cached.
    _run_client(address, reports[0], prompts[0], model, cfg, cfg.seed + 100, True, say)
    with ThreadPoolExecutor(max_workers=cfg.clients - 1) as pool:
        futures = [
            pool.submit(
                _run_client,
                address,
                reports[i],
                prompts[i],
                model,
                cfg,
                cfg.seed + 100 + i,
                False,
                say,
            )
            for i in range(1, cfg.clients)
        ]
        for f in futures:
            f.result()
    report = DemoReport(reports, address=address)
    with KVCacheClient(address) as admin:
        report.stats_live = admin.stats()
        report.workers = len(admin.info().workers)
        for r in reports:
            for seq_id in r.seq_ids:
                admin.free(seq_id)
        report.stats_end = admin.stats()
    return report


async def run_demo(
    service: ServiceConfig, cfg: DemoConfig, progress: Callable[[str], None] = lambda _: None
) -> DemoReport:
    """Start the service, run the clients, stop the service (also on failure)."""
    progress("starting the service")
    running = await start_service(service)
    try:
        progress(f"serving on {running.address} with {len(running.coordinator.workers())} workers")
        loop = asyncio.get_running_loop()
        report = await loop.run_in_executor(None, run_clients, running.address, cfg, progress)
        running.coordinator.block_manager.check_integrity()
        return report
    finally:
        progress("stopping the service")
        await running.stop()


def _clients_table(report: DemoReport) -> Any:
    from rich.table import Table

    t = Table(title="Clients (every attention output checked against dense attention)")
    for col in ("client", "prompt", "cached (prefix hit)", "computed", "checks", "max |err|"):
        t.add_column(col, justify="left" if col == "client" else "right")
    t.add_column("result")
    for c in report.clients:
        t.add_row(
            c.name,
            str(c.prompt_tokens),
            str(c.cached_tokens),
            str(c.computed_tokens),
            str(c.checks),
            f"{c.max_abs_err:.2e}",
            "[green]match[/green]"
            if c.mismatches == 0
            else f"[red]{c.mismatches} mismatches[/red]",
        )
    return t


def _workers_table(stats: ServiceStats, title: str) -> Any:
    from rich.table import Table

    w = Table(title=title)
    w.add_column("worker")
    tiered = any(ws.host_tier_blocks for ws in stats.workers)
    columns = ["blocks", "used", "cached-free", "free", "utilization", "fragmentation"]
    for col in columns + (["host tier"] if tiered else []):
        w.add_column(col, justify="right")
    for ws in stats.workers:
        util = ws.used_blocks / ws.total_blocks if ws.total_blocks else 0.0
        frag = (
            (ws.allocated_slots - ws.filled_slots) / ws.allocated_slots
            if ws.allocated_slots
            else 0.0
        )
        w.add_row(
            ws.worker_id,
            str(ws.total_blocks),
            str(ws.used_blocks),
            str(ws.cached_free_blocks),
            str(ws.free_blocks),
            f"{util:.1%}",
            f"{frag:.1%}",
            *([f"{ws.host_tier_used_blocks} / {ws.host_tier_blocks}"] if tiered else []),
        )
    return w


def _service_table(stats: ServiceStats, end: ServiceStats | None) -> Any:
    from rich.table import Table

    s = Table(title="Service")
    s.add_column("figure")
    s.add_column("value", justify="right")
    queried = sum(q for q, _ in stats.prefix.values())
    hits = sum(h for _, h in stats.prefix.values())
    s.add_row(
        "prefix hits (prompt tokens served from cache)",
        f"{hits} / {queried} ({stats.prefix_hit_rate:.1%})",
    )
    s.add_row("pool utilization", f"{stats.utilization:.1%}")
    s.add_row("fragmentation (unfilled slots of used blocks)", f"{stats.fragmentation:.1%}")
    if any(w.host_tier_blocks for w in stats.workers):
        s.add_row("of the hits, restored from a host tier (tokens)", str(stats.host_hit_tokens))
        s.add_row("host tier blocks given up for room", str(stats.host_evictions))
    s.add_row("copy-on-write copies", str(stats.cow_copies))
    s.add_row("evictions", str(stats.evictions))
    s.add_row("active sequences", str(stats.active_sequences))
    s.add_row("lost sequences (not yet freed)", str(stats.lost_sequences))
    if end is not None:
        s.add_row(
            "blocks still used after every free", str(sum(w.used_blocks for w in end.workers))
        )
        s.add_row(
            "blocks kept findable after the frees (cached-free)",
            str(sum(w.cached_free_blocks for w in end.workers)),
        )
    return s


def render(report: DemoReport, console: Any) -> None:
    """Print the report as rich tables (clients, worker pools, service figures)."""
    if report.clients:
        console.print(_clients_table(report))
    if report.stats_live is not None:
        title = "Worker pools with the sequences alive" if report.clients else "Worker pools"
        console.print(_workers_table(report.stats_live, title))
        console.print(_service_table(report.stats_live, report.stats_end))
