"""Load generator for `kvcache bench` and benchmarks/bench_service.py: decode steps through
the service, layer by layer, timing every append-and-attend call.

One "client" is a thread with its own channel and `batch` sequences. Each sequence is first
filled with `context` tokens on every layer (one streamed Append per sequence), then every
step sends, for each layer, one append-and-attend carrying one new token and one query row
per sequence: what a model's decode step does. Per-call latency is wall time around the RPC
as the client sees it (serialisation, network, coordinator, worker, kernels, reply).

K/V and queries are random: the figures measure the service, not a model.

Several runs against one server can share their filling: `fill_bases` fills the sequences
once, and a run whose config names them (`BenchConfig.bases`) decodes forks of them
instead, each fork sharing its base's blocks (a separate context per sequence, as before)
and freed after the run, so every run starts from the same `context` tokens.
"""

from __future__ import annotations

import multiprocessing
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from queue import SimpleQueue
from typing import Any

import torch

from cache_service.client import AppendAttendItem, KVCacheClient

__all__ = [
    "BenchConfig",
    "BenchResult",
    "fill_bases",
    "free_bases",
    "percentile",
    "run_decode_bench",
]


@dataclass(frozen=True)
class BenchConfig:
    """What to run.

    Attributes:
        batch: sequences per client (rows of one append-and-attend).
        context: tokens already cached in every sequence before the timed steps.
        steps: timed decode steps (each: one call per layer).
        warmup_steps: untimed steps first.
        clients: concurrent clients (threads, one channel each).
        num_q_heads: query heads (a multiple of the layout's KV heads).
        dtype: dtype of the K/V/query tensors sent ("float16" | "bfloat16" | "float32").
        timeout_s: deadline of each call.
        api: "batch" sends the batch as ``[batch, ...]`` tensors (`append_attend_batch`,
            what a model executor holds); "items" as one `AppendAttendItem` per sequence.
        session: the client's batch calls as messages of one Session stream (else one
            unary RPC each); see `KVCacheClient`.
        shared_memory: the batch calls' tensors through a shared-memory region when the
            client can map it (else as bytes in the messages).
        local_session: where the session's messages go (KVCacheClient's local_session):
            "auto" (default) the server's local socket when this process can reach it,
            True that socket or fail, False the gRPC stream.
        bases: sequences filled with `context` tokens beforehand (`fill_bases`), one
            tuple of `batch` ids per client: each client decodes forks of its tuple (freed
            after the run; the bases stay as they are) instead of filling new sequences.
    """

    batch: int = 8
    context: int = 128
    steps: int = 20
    warmup_steps: int = 3
    clients: int = 1
    num_q_heads: int = 4
    dtype: str = "float32"
    timeout_s: float = 60.0
    api: str = "batch"
    session: bool = True
    shared_memory: bool = True
    local_session: bool | str = "auto"
    bases: tuple[tuple[str, ...], ...] | None = None

    def __post_init__(self) -> None:
        for name in ("batch", "context", "steps", "clients", "num_q_heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps!r}")
        if self.dtype not in ("float16", "bfloat16", "float32"):
            raise ValueError(f"dtype must be float16, bfloat16 or float32, got {self.dtype!r}")
        if self.local_session not in (True, False, "auto"):
            raise ValueError(
                f"local_session must be True, False or 'auto', got {self.local_session!r}"
            )
        if self.api not in ("batch", "items"):
            raise ValueError(f"api must be batch or items, got {self.api!r}")
        if self.bases is not None and (
            len(self.bases) != self.clients or any(len(b) != self.batch for b in self.bases)
        ):
            raise ValueError(
                f"bases must hold {self.clients} tuple(s) of {self.batch} sequence ids (one "
                f"per client), got {[len(b) for b in self.bases]}"
            )


@dataclass
class BenchResult:
    """Measured figures.

    Attributes:
        call_seconds: every timed append-and-attend call's latency, seconds.
        wall_seconds: wall time of the timed steps, all clients together.
        steps: timed steps per client; layers: calls per step.
        tokens: decode tokens produced over all clients (steps * batch * clients).
        sequences_per_worker_call: sequences per coordinator -> worker call, mean (above
            the batch size when calls were coalesced; None: not measured, only a caller
            with the server's metrics can).
        correctness_checks: (rounds the online correctness check judged, their total check
            time in seconds) over the run, warm-up included (None: not measured; as
            above). Checks run after their rounds answered.
        server_cpu_seconds: what the caller's `server_cpu_clock` counted over the timed
            steps, seconds (a server in the caller's process: its event-loop thread's CPU
            time); None without a clock.
    """

    config: BenchConfig
    layers: int
    call_seconds: list[float] = field(default_factory=list)
    wall_seconds: float = 0.0
    tokens: int = 0
    sequences_per_worker_call: float | None = None
    correctness_checks: tuple[int, float] | None = None
    server_cpu_seconds: float | None = None

    @property
    def p50_ms(self) -> float:
        return percentile(self.call_seconds, 50) * 1e3

    @property
    def p99_ms(self) -> float:
        return percentile(self.call_seconds, 99) * 1e3

    @property
    def mean_ms(self) -> float:
        return statistics.fmean(self.call_seconds) * 1e3 if self.call_seconds else 0.0

    @property
    def steps_per_s(self) -> float:
        """Full decode steps (all layers) per second of each client (they run in parallel)."""
        return self.config.steps / self.wall_seconds if self.wall_seconds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_seconds if self.wall_seconds else 0.0


# Client i of a run draws its random data from seed _FIRST_SEED + i.
_FIRST_SEED = 1000


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; 0 for no values."""
    if not values:
        return 0.0
    data = sorted(values)
    pos = (len(data) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def _client(target: str, token: str | None, cfg: BenchConfig) -> KVCacheClient:
    return KVCacheClient(
        target,
        token=token,
        timeout_s=cfg.timeout_s,
        session=cfg.session,
        shared_memory="auto" if cfg.shared_memory else False,
        local_session=cfg.local_session if cfg.session else False,
    )


def _fill(client: KVCacheClient, layout: Any, cfg: BenchConfig, seed: int, seqs: list[Any]) -> None:
    """Create `cfg.batch` sequences into `seqs` (so a caller's cleanup sees each as soon as
    it exists) and fill each with `cfg.context` tokens on every layer of `layout` (the
    service's, from `client.info()`)."""
    dtype = getattr(torch, cfg.dtype)
    gen = torch.Generator().manual_seed(seed)
    hkv, d, num_layers = layout.num_kv_heads, layout.head_dim, layout.num_layers
    for _ in range(cfg.batch):
        seqs.append(client.create_sequence())
    # One random context for every sequence (drawing 2048 x 32 layers of K/V per sequence
    # would dominate the setup); distinct token ids keep the sequences' blocks distinct, so
    # attention reads a separate context per sequence.
    kv = torch.randn(num_layers, cfg.context, hkv, d, generator=gen).to(dtype)
    for i, s in enumerate(seqs):
        ids = [(seed * 7919 + i * 104729 + t) % 2**31 for t in range(cfg.context)]
        client.append(s.seq_id, ids, kv, kv, layer=None)


def _client_run(
    target: str,
    token: str | None,
    cfg: BenchConfig,
    seed: int,
    start: Any,
    times: list[float],
    errors: list[BaseException],
) -> None:
    dtype = getattr(torch, cfg.dtype)
    try:
        with _client(target, token, cfg) as client:
            layout = client.info().layout
            hkv, d, num_layers = layout.num_kv_heads, layout.head_dim, layout.num_layers
            seqs: list[Any] = []
            try:
                if cfg.bases is None:
                    _fill(client, layout, cfg, seed, seqs)
                else:
                    for base in cfg.bases[seed - _FIRST_SEED]:
                        seqs.append(client.fork(base))
                # Random tensors are made once: generating them is not what is measured.
                gen = torch.Generator().manual_seed(seed + 1)
                k = torch.randn(cfg.batch, 1, hkv, d, generator=gen).to(dtype)
                q = torch.randn(cfg.batch, 1, cfg.num_q_heads, d, generator=gen).to(dtype)

                seq_ids = [s.seq_id for s in seqs]
                token_ids = [[7]] * cfg.batch

                def step(timed: bool) -> None:
                    for layer in range(num_layers):
                        if cfg.api == "batch":
                            t0 = time.perf_counter()
                            client.append_attend_batch(layer, seq_ids, token_ids, k, k, q)
                        else:
                            items = [
                                AppendAttendItem(s, [7], k[i], k[i], q[i])
                                for i, s in enumerate(seq_ids)
                            ]
                            t0 = time.perf_counter()
                            client.append_attend(layer, items)
                        if timed:
                            times.append(time.perf_counter() - t0)

                for _ in range(cfg.warmup_steps):
                    step(False)
                start.wait()
                for _ in range(cfg.steps):
                    step(True)
                start.wait()
            finally:
                for s in seqs:
                    s.free()
    except BaseException as exc:
        errors.append(exc)
        start.abort()


def _fill_process(target: str, token: str | None, cfg: BenchConfig, seed: int, queue: Any) -> None:
    """`_fill_main` in a client process of its own (one intra-op thread, as `_process_main`)."""
    torch.set_num_threads(1)
    _fill_main(target, token, cfg, seed, queue)


def _fill_main(target: str, token: str | None, cfg: BenchConfig, seed: int, queue: Any) -> None:
    """`fill_bases`' work for one client: put (seed, ids, error text or None) on `queue`; a
    failure frees what it filled."""
    seqs: list[Any] = []
    try:
        with _client(target, token, cfg) as client:
            try:
                _fill(client, client.info().layout, cfg, seed, seqs)
            except BaseException:
                for s in seqs:
                    s.free()
                raise
        queue.put((seed, tuple(s.seq_id for s in seqs), None))
    except BaseException as exc:
        queue.put((seed, (), repr(exc)))


def fill_bases(
    target: str, cfg: BenchConfig, *, token: str | None = None, processes: bool = False
) -> tuple[tuple[str, ...], ...]:
    """Create and fill what `cfg`'s clients would fill (`cfg.clients` x `cfg.batch`
    sequences of `cfg.context` tokens on every layer, the same token ids), the clients in
    parallel; the ids, one tuple per client, for `BenchConfig.bases`. The caller frees
    them (`free_bases`). Raises the first client's error (after freeing every filled
    sequence).

    processes: one process per client (as in `run_decode_bench`), else one thread each.
    """
    seeds = [_FIRST_SEED + i for i in range(cfg.clients)]
    results: dict[int, tuple[tuple[str, ...], str | None]] = {}
    if processes:
        ctx = multiprocessing.get_context("spawn")
        queue: Any = ctx.Queue()
        procs = [
            ctx.Process(target=_fill_process, args=(target, token, cfg, seed, queue), daemon=True)
            for seed in seeds
        ]
        for p in procs:
            p.start()
        for _ in procs:
            try:
                seed, ids, error = queue.get(timeout=max(600.0, cfg.timeout_s))
            except Exception:  # queue.Empty: a process died without reporting
                break
            results[seed] = (ids, error)
        for p in procs:
            p.join()
        while len(results) < len(procs):  # reports that came after a process died
            try:
                seed, ids, error = queue.get(timeout=1.0)
            except Exception:
                break
            results[seed] = (ids, error)
    else:
        local: SimpleQueue[Any] = SimpleQueue()
        threads = [
            threading.Thread(target=_fill_main, args=(target, token, cfg, seed, local))
            for seed in seeds
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        while not local.empty():
            seed, ids, error = local.get()
            results[seed] = (ids, error)
    outcomes = [results.get(seed, ((), "the filling process died")) for seed in seeds]
    bases = tuple(ids for ids, _ in outcomes)
    failed = next((error for _, error in outcomes if error is not None), None)
    if failed is not None:
        free_bases(target, bases, token=token)
        raise RuntimeError(f"filling the bench's sequences failed: {failed}")
    return bases


def free_bases(
    target: str, bases: tuple[tuple[str, ...], ...], *, token: str | None = None
) -> None:
    """Free the sequences `fill_bases` made."""
    with KVCacheClient(target, token=token) as client:
        for ids in bases:
            for seq_id in ids:
                client.free(seq_id)


def _watch(processes: list[Any], barrier: Any, finished: threading.Event) -> None:
    while not finished.wait(0.2):
        if any(p.exitcode not in (None, 0) for p in processes):
            barrier.abort()
            return


def _process_main(
    target: str, token: str | None, cfg: BenchConfig, seed: int, barrier: Any, queue: Any
) -> None:
    """A client in its own process: run, then send back (latencies, error text or None)."""
    # A model executor's RPC thread does small tensor copies; torch's default of one
    # intra-op thread per core would have every client process spin a full thread pool on
    # a machine the server shares.
    torch.set_num_threads(1)
    times: list[float] = []
    errors: list[BaseException] = []
    _client_run(target, token, cfg, seed, barrier, times, errors)
    queue.put((seed, times, repr(errors[0]) if errors else None))


def run_decode_bench(
    target: str,
    cfg: BenchConfig,
    *,
    token: str | None = None,
    processes: bool = False,
    server_cpu_clock: Callable[[], float] | None = None,
) -> BenchResult:
    """Run `cfg` against the server at `target`; raises the first client error.

    processes: one process per client instead of one thread (clients then do not share a
    GIL with each other or with a server running in this process).
    server_cpu_clock: read (seconds) when the timed steps start and when the last client
        finishes them; the difference becomes `BenchResult.server_cpu_seconds`.
    """
    with KVCacheClient(target, token=token) as probe:
        layers = probe.info().layout.num_layers
    # Two rendezvous around the timed steps: clients start together, and the wall clock
    # stops when the last one finishes.
    per_client: list[list[float]] = [[] for _ in range(cfg.clients)]
    errors: list[BaseException] = []
    workers, barrier, queue = _make_clients(target, token, cfg, processes, per_client, errors)
    for w in workers:
        w.start()
    finished = threading.Event()
    if processes:
        # A client process that dies without reaching the barrier (a crash at import) would
        # leave everyone waiting: break the barrier instead.
        threading.Thread(target=_watch, args=(workers, barrier, finished), daemon=True).start()
    server_cpu = None
    try:
        barrier.wait()
        t0 = time.perf_counter()
        cpu0 = server_cpu_clock() if server_cpu_clock is not None else 0.0
        barrier.wait()
        wall = time.perf_counter() - t0
        if server_cpu_clock is not None:
            server_cpu = server_cpu_clock() - cpu0
    except threading.BrokenBarrierError:
        wall = 0.0
    finished.set()
    if processes:
        _collect_process_times(len(workers), queue, per_client, errors)
    for w in workers:
        w.join()
    if errors:
        raise errors[0]
    result = BenchResult(cfg, layers)
    result.call_seconds = [x for times in per_client for x in times]
    result.wall_seconds = wall
    result.server_cpu_seconds = server_cpu
    result.tokens = cfg.steps * cfg.batch * cfg.clients
    return result


def _make_clients(
    target: str,
    token: str | None,
    cfg: BenchConfig,
    processes: bool,
    per_client: list[list[float]],
    errors: list[BaseException],
) -> tuple[list[Any], Any, Any]:
    """The clients, not started: ``(threads or processes, the barrier of cfg.clients + 1
    parties, the queue the processes report on or None)``. A thread appends its step times
    (seconds) to ``per_client[i]`` and its error to `errors`; a process reports both on
    the queue."""
    queue: Any = None
    if processes:
        ctx = multiprocessing.get_context("spawn")
        barrier: Any = ctx.Barrier(cfg.clients + 1)
        queue = ctx.Queue()
        workers: list[Any] = [
            ctx.Process(
                target=_process_main,
                args=(target, token, cfg, _FIRST_SEED + i, barrier, queue),
                daemon=True,
            )
            for i in range(cfg.clients)
        ]
    else:
        barrier = threading.Barrier(cfg.clients + 1)
        workers = [
            threading.Thread(
                target=_client_run,
                args=(target, token, cfg, _FIRST_SEED + i, barrier, per_client[i], errors),
                daemon=True,
            )
            for i in range(cfg.clients)
        ]
    return workers, barrier, queue


def _collect_process_times(
    clients: int, queue: Any, per_client: list[list[float]], errors: list[BaseException]
) -> None:
    """Read each client process's ``(seed, step times, error)`` report into `per_client` and
    `errors`; a process that died without reporting adds an error and ends the reading."""
    for _ in range(clients):
        try:
            seed, times, error = queue.get(timeout=30)
        except Exception:  # queue.Empty: a process died without reporting
            errors.append(RuntimeError("a client process died; see its stderr"))
            break
        per_client[seed - _FIRST_SEED] = times
        if error is not None:
            errors.append(RuntimeError(f"client {seed - _FIRST_SEED}: {error}"))
