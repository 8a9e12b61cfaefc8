"""examples/kv_router.py against real services: it sends a prompt to the service and
worker holding its longest cached prefix, and follows evictions and lost workers."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from service_support import LAYOUT, ServiceHarness, local_workers, service_config

from cache_service.client import KVCacheClient

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]


def _router_module():
    spec = importlib.util.spec_from_file_location("kv_router", ROOT / "examples/kv_router.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["kv_router"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _prefill(c: KVCacheClient, tokens: list[int]) -> str:
    seq = c.create_sequence(tokens)
    n = seq.num_cached_tokens
    shape = (LAYOUT.num_layers, len(tokens) - n, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    c.append(seq.seq_id, tokens[n:], torch.zeros(shape), torch.zeros(shape))
    return seq.seq_id


def test_the_router_picks_the_longest_cached_prefix_across_services_and_workers() -> None:
    kv_router = _router_module()
    bs = LAYOUT.block_size
    workers_a, workers_b = local_workers(2, 16), local_workers(1, 16)
    with (
        ServiceHarness(service_config(), workers=workers_a) as a,
        ServiceHarness(service_config(), workers=workers_b) as b,
        KVCacheClient(a.address, max_attempts=1) as ca,
        KVCacheClient(b.address, max_attempts=1) as cb,
    ):
        router = kv_router.KvRouter([a.address, b.address])
        try:
            shared = list(range(100, 100 + 2 * bs))
            # Service a holds two blocks of the prompt, service b three.
            _prefill(ca, [*shared, 1])
            long_seq = _prefill(cb, [*shared, *range(500, 500 + bs), 1])
            prompt = shared + list(range(500, 500 + 2 * bs))
            route = router.route(prompt)
            assert (route.target, route.worker_id, route.cached_tokens) == (
                b.address,
                "w0",
                3 * bs,
            )
            assert route.cached_tokens == cb.lookup([*prompt, 0])

            # On service a, a prompt cached on w1 only is routed to w1.
            w1_seq = None
            for i in range(6):
                s = _prefill(ca, list(range(1000 + 50 * i, 1000 + 50 * i + bs + 1)))
                if a.workers_of(s) == ("w1",):
                    w1_seq = (s, list(range(1000 + 50 * i, 1000 + 50 * i + bs + 1)))
                    break
            assert w1_seq is not None, "placement never used w1"
            route = router.route(w1_seq[1])
            assert (route.target, route.worker_id, route.cached_tokens) == (a.address, "w1", bs)

            # w1 lost: its keys are gone from the router's view.
            workers_a[1].kill()
            a.run(a.coordinator.check_workers())
            assert router.route(w1_seq[1]).cached_tokens == 0

            # b's blocks evicted (freed, then the pool filled): b no longer wins.
            cb.free(long_seq)
            for i in range(3):
                _prefill(cb, list(range(2000 + 100 * i, 2000 + 100 * i + 5 * bs)))
            assert b.stats().workers["w0"].cached_free < 3
            route = router.route(prompt)
            assert route.cached_tokens == max(ca.lookup([*prompt, 0]), cb.lookup([*prompt, 0]))
        finally:
            router.close()
