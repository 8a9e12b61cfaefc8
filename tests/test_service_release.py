"""Blocks that go free are reported to their worker, whose debug pool poisons them (NaN).

Through the real server with debug pools: a freed block that nobody reuses reads NaN on
its worker; a block that stays cached-free (still published in the prefix index) keeps its
KV bit for bit and a later prompt adopts it; a cached-free block evicted to be reused is
poisoned *before* its new owner writes it (the new slots hold the new KV, the others NaN,
never the old prompt's, and attention is still right), on every write path (append,
import); the blocks a lost worker's sequence held on another worker are poisoned there.
"""

from __future__ import annotations

import time

import pytest
import torch
from service_support import HQ, LAYOUT, Mirror, ServiceHarness, service_config

from cache_service.client import AttendItem, DataLossError, KVCacheClient
from cache_service.engine.worker_clients import LocalWorkerClient
from workers.config import PoolConfig

pytestmark = pytest.mark.timeout(60)

D, HKV, NL, BS = LAYOUT.head_dim, LAYOUT.num_kv_heads, LAYOUT.num_layers, LAYOUT.block_size
GEN = torch.Generator().manual_seed(3)


def debug_workers(*sizes: int) -> list[LocalWorkerClient]:
    return [
        LocalWorkerClient(f"w{i}", PoolConfig(LAYOUT, num_blocks=n, debug=True))
        for i, n in enumerate(sizes)
    ]


def blocks_of(svc: ServiceHarness, worker: LocalWorkerClient, ids: list[int]) -> torch.Tensor:
    """The blocks ``[n, L, 2, Hkv, bs, D]`` as the worker holds them, read in the worker's
    own call order (after everything already sent to it)."""
    return svc.run(worker.export_blocks(worker.worker.epoch(), ids))


def wait_poisoned(svc: ServiceHarness, worker: LocalWorkerClient, ids: list[int]) -> None:
    """Releases are fire-and-forget: poll until the blocks read all NaN (or fail)."""
    deadline = time.monotonic() + 10
    while not bool(torch.isnan(blocks_of(svc, worker, ids)).all()):
        assert time.monotonic() < deadline, f"blocks {ids} of {worker.worker_id} not poisoned"
        time.sleep(0.02)


def slots(kv: torch.Tensor, block: torch.Tensor, layer: int, kind: int, pos: range) -> bool:
    """Whether `block` ``[L, 2, Hkv, bs, D]`` holds kv ``[n, Hkv, D]`` at offsets `pos`."""
    return torch.equal(block[layer, kind][:, list(pos)].transpose(0, 1), kv)


def prefill(client: KVCacheClient, ids: list[int], layer: int | None = None) -> tuple:
    h = client.create_sequence()
    layers = NL if layer is None else 1
    k = torch.randn(layers, len(ids), HKV, D, generator=GEN)
    v = torch.randn(layers, len(ids), HKV, D, generator=GEN)
    if layer is None:
        client.append(h.seq_id, ids, k, v)
    else:
        client.append(h.seq_id, ids, k[0], v[0], layer=layer)
    return h.seq_id, k, v


def test_freed_blocks_are_poisoned_cached_free_ones_are_not() -> None:
    workers = debug_workers(8)
    (w0,) = workers
    with (
        ServiceHarness(service_config(), workers) as svc,
        KVCacheClient(svc.address, timeout_s=20) as client,
    ):
        prompt = list(range(10, 16))  # block 0 full (published), block 1 holds 2 tokens
        a, k, v = prefill(client, prompt)
        assert svc.workers_of(a) == ("w0",)
        client.free(a)
        wait_poisoned(svc, w0, [1])
        cached = blocks_of(svc, w0, [0])[0]
        for layer in range(NL):
            assert slots(k[layer, :4], cached, layer, 0, range(4))
            assert slots(v[layer, :4], cached, layer, 1, range(4))
        # Still findable and correct: a prompt starting the same way adopts it.
        b = client.create_sequence([*prompt[:4], 99, 98])
        assert b.num_cached_tokens == 4
        mirror = Mirror(b.seq_id, NL)
        tail_k = torch.randn(NL, 2, HKV, D, generator=GEN)
        tail_v = torch.randn(NL, 2, HKV, D, generator=GEN)
        client.append(b.seq_id, [99, 98], tail_k, tail_v)
        for layer in range(NL):
            mirror.add(layer, torch.cat([k[layer, :4], tail_k[layer]]),
                       torch.cat([v[layer, :4], tail_v[layer]]))  # fmt: skip
            q = torch.randn(3, HQ, D, generator=GEN)
            (out,) = client.attend(layer, [AttendItem(b.seq_id, q)])
            ref, _ = mirror.reference(layer, q)
            assert torch.allclose(out.double(), ref, atol=1e-5)
        b.free()
        svc.check_integrity()

        # Reuse by eviction: the last block a 30-token prompt takes is the cached one
        # (every free block goes first). It is poisoned before the new owner writes its
        # first two slots, so the other two read NaN, not the old prompt's KV.
        stats = svc.stats()
        assert stats.workers["w0"].cached_free == 1 and stats.workers["w0"].free == 7
        c, ck, cv = prefill(client, list(range(200, 230)))
        assert svc.stats().evictions == stats.evictions + 1
        reused = blocks_of(svc, w0, [0])[0]
        for layer in range(NL):
            assert slots(ck[layer, 28:], reused, layer, 0, range(2))
            assert slots(cv[layer, 28:], reused, layer, 1, range(2))
        assert bool(torch.isnan(reused[:, :, :, 2:]).all())
        q = torch.randn(2, HQ, D, generator=GEN)
        (out,) = client.attend(1, [AttendItem(c, q)])
        mirror = Mirror(c, NL)
        mirror.add(1, ck[1], cv[1])
        ref, _ = mirror.reference(1, q)
        assert torch.allclose(out.double(), ref, atol=1e-5)
        svc.check_integrity()


def test_a_lost_workers_sequences_release_their_blocks_elsewhere() -> None:
    workers = debug_workers(4, 4)
    w0, w1 = workers
    with (
        ServiceHarness(service_config(), workers) as svc,
        KVCacheClient(svc.address, timeout_s=20, max_attempts=1) as client,
    ):
        # Layer 0 only: nothing is published, so every block of it can go free.
        s, _, _ = prefill(client, list(range(18)), layer=0)  # 5 blocks: 4 on w0, 1 on w1
        assert svc.workers_of(s) == ("w0", "w1")
        w1.kill()
        with pytest.raises(DataLossError):
            client.attend(0, [AttendItem(s, torch.randn(1, HQ, D, generator=GEN))])
        wait_poisoned(svc, w0, [0, 1, 2, 3])
        svc.check_integrity()
        client.free(s)
        w1.restart()  # lets the harness shut down cleanly


def test_an_import_that_evicts_is_never_poisoned_afterwards() -> None:
    workers = debug_workers(8)
    with (
        ServiceHarness(service_config(), workers) as svc,
        KVCacheClient(svc.address, timeout_s=20) as client,
    ):
        prompt = list(range(40, 48))
        e, k, v = prefill(client, prompt)
        exported = client.export_blocks(e)
        client.free(e)  # 2 cached-free blocks: the tail released first, so evicted first
        g, _, _ = prefill(client, list(range(60, 68)))
        client.free(g)
        # The last 4 free blocks; layer 0 only, so nothing of it stays cached once freed.
        f, _, _ = prefill(client, list(range(80, 96)), layer=0)
        assert svc.stats().workers["w0"].free == 0
        # The import adopts E's first block and takes a block for the rest: an eviction.
        imported = client.import_blocks(exported)
        assert svc.stats().evictions == 1
        client.free(f)  # any later release must not reach the imported blocks
        wait_poisoned(svc, workers[0], [4, 5, 6, 7])
        for layer in range(NL):
            q = torch.randn(2, HQ, D, generator=GEN)
            (out,) = client.attend(layer, [AttendItem(imported.seq_id, q)])
            mirror = Mirror(imported.seq_id, NL)
            mirror.add(layer, k[layer], v[layer])
            ref, _ = mirror.reference(layer, q)
            assert torch.allclose(out.double(), ref, atol=1e-5), layer
        svc.check_integrity()
