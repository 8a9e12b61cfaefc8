"""Helpers of the service tests: a real server on a loopback port, run on an event loop in
a background thread, and a client-side mirror of sequences for dense-attention checks."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import torch
from round_calls import round_form
from workers_support import dense_attention

from cache_service.api.server import RunningService, start_service
from cache_service.config import CoordinatorConfig, ServiceConfig
from cache_service.engine.coordinator import Coordinator
from cache_service.engine.worker_clients import LocalWorkerClient
from cache_service.event_loop import loop_factory
from workers.config import PoolConfig
from workers.layout import KVLayout

__all__ = [
    "LAYOUT",
    "Mirror",
    "Recording",
    "ServiceHarness",
    "dense_attention",
    "local_workers",
    "run_coordinator",
    "service_config",
]

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype="float32")
HQ = 4  # query heads: GQA group of 2


def service_config(layout: KVLayout = LAYOUT, **overrides: Any) -> ServiceConfig:
    """A config for tests: free port, no metrics endpoint, in-process pools, `layout`."""
    base = {
        "server.port": 0,
        "metrics.enabled": False,
        "workers.in_process": True,
        "layout.num_layers": layout.num_layers,
        "layout.num_kv_heads": layout.num_kv_heads,
        "layout.head_dim": layout.head_dim,
        "layout.block_size": layout.block_size,
        "layout.dtype": layout.dtype,
        "coordinator.health_check_interval_s": 0,
        "server.shutdown_grace_s": 5.0,
        # Dozens of services start in one test process: no full collection at each start
        # (test_server_gc covers the freeze).
        "server.gc_freeze": False,
    }
    base.update(overrides)
    return ServiceConfig().with_overrides(base)


def run_coordinator(
    scenario: Callable[[Coordinator], Awaitable[Any]],
    layout: KVLayout = LAYOUT,
    workers: int = 1,
    blocks: int = 64,
) -> None:
    """Run ``scenario(coordinator)`` on a started Coordinator (no server) over `workers`
    in-process CPU pools w0, w1, ... of `blocks` blocks, without the online correctness
    check; close everything afterwards."""

    async def main() -> None:
        clients = [
            LocalWorkerClient(f"w{i}", PoolConfig(layout, num_blocks=blocks))
            for i in range(workers)
        ]
        coord = Coordinator(layout, clients, CoordinatorConfig(correctness_check_fraction=0.0))
        await coord.start()
        try:
            await scenario(coord)
        finally:
            await coord.close()
            for c in clients:
                c.close()

    asyncio.run(main())


def local_workers(n: int, num_blocks: int, layout: KVLayout = LAYOUT) -> list[LocalWorkerClient]:
    """`n` in-process workers w0, w1, ... of `num_blocks` blocks each."""
    return [LocalWorkerClient(f"w{i}", PoolConfig(layout, num_blocks=num_blocks)) for i in range(n)]


class ServiceHarness:
    """A started service on its own event-loop thread; tests talk to it with the blocking
    client and reach the coordinator through `run` (which executes on the loop). The loop
    is the kind `server.event_loop` names, as `kvcache serve` makes it."""

    def __init__(self, config: ServiceConfig, workers: list[Any] | None = None, **kw: Any) -> None:
        self.workers = workers
        self.loop = loop_factory(config.server.event_loop)()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.service: RunningService = self.run(start_service(config, workers=workers, **kw))

    @property
    def address(self) -> str:
        return self.service.address

    @property
    def coordinator(self) -> Any:
        return self.service.coordinator

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 60.0) -> Any:
        """Run a coroutine on the service's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Any, *args: Any) -> Any:
        """Call a plain function on the loop thread (the block manager is not thread-safe)."""

        async def wrapper() -> Any:
            return fn(*args)

        return self.run(wrapper())

    def check_integrity(self) -> None:
        self.call(self.coordinator.block_manager.check_integrity)

    def checks_finished(self) -> None:
        """Wait for the online correctness checks started so far (they run after their
        rounds answered)."""
        self.run(self.coordinator.checks_finished())

    def stats(self) -> Any:
        return self.call(self.coordinator.block_manager.stats)

    def workers_of(self, seq_id: str, tenant: str = "default") -> tuple[str, ...]:
        info = self.call(self.coordinator.block_manager.sequence_info, tenant, seq_id)
        return info.workers

    def stop(self) -> None:
        try:
            self.run(self.service.stop(2.0))
            for w in self.workers or []:
                w.close()
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()

    def __enter__(self) -> ServiceHarness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Mirror:
    """The client-side truth of one sequence: token ids and K/V per layer."""

    def __init__(self, seq_id: str, num_layers: int) -> None:
        self.seq_id = seq_id
        self.tokens: list[int] = []
        self.k: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self.v: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]

    def add(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].append(k)
        self.v[layer].append(v)

    def length(self, layer: int) -> int:
        return sum(t.shape[0] for t in self.k[layer])

    def fork(self, seq_id: str) -> Mirror:
        m = Mirror(seq_id, len(self.k))
        m.tokens = list(self.tokens)
        m.k = [list(x) for x in self.k]
        m.v = [list(x) for x in self.v]
        return m

    def reference(self, layer: int, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense float64 attention of q (the last rows) over everything on `layer`."""
        return dense_attention(q, torch.cat(self.k[layer]), torch.cat(self.v[layer]))


class Recording:
    """A WorkerClient proxy that counts data calls and their batch sizes, and can stall.

    Its `calls` count ``write`` and ``run_round``, and each round by its form as well
    (`round_calls.round_form`: "attend", "one_layer", "over_layers").

    delay_s: every data call waits this long before it runs.
    hold_first: the first round waits until this event is set (it is counted first, so a
        test can see it arrive).
    """

    def __init__(
        self, inner: Any, delay_s: float = 0.0, hold_first: threading.Event | None = None
    ) -> None:
        self.inner = inner
        self.delay_s = delay_s
        self.hold_first = hold_first
        self.calls: Counter[str] = Counter()
        self.batch_sizes: list[int] = []

    @property
    def worker_id(self) -> str:
        return self.inner.worker_id

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:
        target = getattr(self.inner, name)
        if name not in ("run_round", "write"):
            return target

        async def wrapped(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            hold = None
            if name == "run_round":
                (rnd,) = args
                self.calls[round_form(rnd)] += 1
                hold = self.hold_first if not self.batch_sizes else None
                lens = rnd.seq_lens
                self.batch_sizes.append(len(lens) if lens is not None else 0)
            if hold is not None:
                await asyncio.get_running_loop().run_in_executor(None, hold.wait)
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            return await target(*args, **kwargs)

        return wrapped


def decode_with_twins(
    shm: Any, plain: Any, batch: int, steps: int, gen: torch.Generator
) -> tuple[list[str], list[str]]:
    """`steps` decode steps, layer by layer, of `batch` new sequences through `shm` (a
    KVCacheClient with shared memory) and of as many twins through `plain` (one sending
    bytes), asserting every layer's outputs equal bit for bit and that `shm` used its
    region; the sequence ids of both, for the caller to go on with or free."""
    ids = [shm.create_sequence().seq_id for _ in range(batch)]
    twins = [plain.create_sequence().seq_id for _ in range(batch)]
    d, hkv = LAYOUT.head_dim, LAYOUT.num_kv_heads
    for _ in range(steps):
        tokens = torch.randint(0, 50000, (batch, 1), generator=gen)
        for layer in range(LAYOUT.num_layers):
            k, v = (torch.randn(batch, 1, hkv, d, generator=gen) for _ in range(2))
            q = torch.randn(batch, 1, HQ, d, generator=gen)
            got = shm.append_attend_batch(layer, ids, tokens, k, v, q)
            assert shm.shared_memory_active
            assert torch.equal(got, plain.append_attend_batch(layer, twins, tokens, k, v, q))
    return ids, twins
