"""End to end over a real port with real Ray CPU workers: many sequences of ragged lengths,
GQA, prefill then decode layer by layer, batches, forks, frees, prefix hits across clients;
every output equals dense attention, and after all frees no block is referenced."""

from __future__ import annotations

import os
import random
import threading
import uuid

import pytest
import ray
import torch
from service_support import HQ, LAYOUT, Mirror, ServiceHarness, decode_with_twins, service_config

from cache_service.client import AppendAttendItem, AttendItem, InvalidArgumentError, KVCacheClient
from workers.ray_startup import start_local_ray

D, HKV, NL = LAYOUT.head_dim, LAYOUT.num_kv_heads, LAYOUT.num_layers


@pytest.fixture(scope="module")
def svc():
    start_local_ray("e2e", num_cpus=2)
    prefix = f"e2e-{uuid.uuid4().hex[:6]}-"
    config = service_config(
        **{
            "workers.in_process": False,
            "workers.num_workers": 2,
            "workers.blocks_per_worker": 96,
            "workers.name_prefix": prefix,
            "workers.namespace": "e2e",
            "coordinator.batch_window_ms": 2.0,
        }
    )
    harness = ServiceHarness(config)
    try:
        yield harness
    finally:
        harness.stop()
        ray.shutdown()


def check(out: torch.Tensor, m: Mirror, layer: int, q: torch.Tensor, lse=None) -> None:
    ref, ref_lse = m.reference(layer, q)
    assert torch.allclose(out.double(), ref, atol=2e-5), (out.double() - ref).abs().max()
    if lse is not None:
        assert torch.allclose(lse.double(), ref_lse, atol=1e-4)


def run_client(address: str, seed: int, prompt: list[int], results: dict, errors: list) -> None:
    """One client: create with a shared-prefix prompt, prefill what is not cached (ragged
    chunks, layer by layer), decode a few tokens in batches of its sequences, fork one,
    free everything. The prefix's K/V are a function of the prompt, as with a real model."""
    try:
        rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        with KVCacheClient(address, timeout_s=60) as client:
            mirrors = []
            for s in range(3):
                ids = prompt + [rng.randrange(1000) for _ in range(rng.randrange(1, 9))]
                h = client.create_sequence(ids)
                m = Mirror(h.seq_id, NL)
                cached = h.num_cached_tokens
                results.setdefault("cached", []).append(cached)
                for layer in range(NL):
                    if cached:
                        k, v = prefix_kv(layer, cached)
                        m.add(layer, k, v)
                m.tokens = ids[:cached]
                rest = ids[cached:]
                # Chunked prefill of ragged chunk sizes.
                while rest:
                    n = min(len(rest), rng.randrange(1, 7))
                    chunk, rest = rest[:n], rest[n:]
                    start = len(m.tokens)
                    for layer in range(NL):
                        k, v = token_kv(layer, chunk, start, s + 10 * seed)
                        q = torch.randn(n, HQ, D, generator=gen)
                        (out,) = client.append_attend(
                            layer, [AppendAttendItem(m.seq_id, chunk, k, v, q)]
                        )
                        m.add(layer, k, v)
                        check(out, m, layer, q)
                    m.tokens += chunk
                mirrors.append(m)
            # Batched decode: one call per layer for all of this client's sequences.
            for t in range(4):
                for layer in range(NL):
                    items, qs = [], []
                    for m in mirrors:
                        k = torch.randn(1, HKV, D, generator=gen)
                        v = torch.randn(1, HKV, D, generator=gen)
                        q = torch.randn(1, HQ, D, generator=gen)
                        items.append(AppendAttendItem(m.seq_id, [500 + t], k, v, q))
                        qs.append(q)
                        m.add(layer, k, v)
                    outs = client.append_attend(layer, items, return_lse=True)
                    for m, q, (o, lse) in zip(mirrors, qs, outs, strict=True):
                        check(o, m, layer, q, lse)
                for m in mirrors:
                    m.tokens.append(500 + t)
            # Fork the first sequence, diverge both (copy-on-write of the partial block).
            f = client.fork(mirrors[0].seq_id)
            fm = mirrors[0].fork(f.seq_id)
            assert f.num_cached_tokens == len(fm.tokens)
            for m, tok in ((mirrors[0], 900), (fm, 901)):
                for layer in range(NL):
                    k = torch.randn(1, HKV, D, generator=gen)
                    q = torch.randn(2, HQ, D, generator=gen)
                    (out,) = client.append_attend(
                        layer, [AppendAttendItem(m.seq_id, [tok], k, k, q)]
                    )
                    m.add(layer, k, k)
                    check(out, m, layer, q)
            # Multi-row attend (e.g. speculative verification) on every sequence at once.
            for layer in range(NL):
                qs = [torch.randn(3, HQ, D, generator=gen) for _ in [*mirrors, fm]]
                outs = client.attend(
                    layer,
                    [AttendItem(m.seq_id, q) for m, q in zip([*mirrors, fm], qs, strict=True)],
                )
                for m, q, o in zip([*mirrors, fm], qs, outs, strict=True):
                    check(o, m, layer, q)
            for m in [*mirrors, fm]:
                client.free(m.seq_id)
    except BaseException as exc:  # surfaced by the test thread
        errors.append(exc)


PREFIX_SEED = 1234


def prefix_kv(layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of the first n shared-prompt positions (a function of the prompt only)."""
    g = torch.Generator().manual_seed(PREFIX_SEED + layer)
    k = torch.randn(64, HKV, D, generator=g)
    v = torch.randn(64, HKV, D, generator=g)
    return k[:n], v[:n]


def token_kv(
    layer: int, ids: list[int], start: int, salt: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of prompt positions: the shared prefix's are fixed, the rest random."""
    k, v = prefix_kv(layer, 64)
    n = len(ids)
    g = torch.Generator().manual_seed(salt * 1000 + start * 10 + layer)
    rk, rv = torch.randn(n, HKV, D, generator=g), torch.randn(n, HKV, D, generator=g)
    rows = [i for i in range(n) if start + i < SHARED]
    for i in rows:
        rk[i], rv[i] = k[start + i], v[start + i]
    return rk, rv


SHARED = 18  # shared prompt tokens: 4 full blocks of 4, then 2 more


def test_clients_sharing_a_prefix_over_ray_workers(svc) -> None:
    prompt = list(range(1, SHARED + 1))
    results: dict = {}
    errors: list = []
    # A first client computes the shared prefix; then three run concurrently.
    run_client(svc.address, 1, prompt, results, errors)
    assert not errors, errors
    threads = [
        threading.Thread(target=run_client, args=(svc.address, seed, prompt, results, errors))
        for seed in (2, 3, 4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    # The first sequence computes everything; every later one finds the 4 full shared blocks.
    assert results["cached"][0] == 0
    assert all(c == 16 for c in results["cached"][1:]), results["cached"]
    stats = svc.stats()
    svc.check_integrity()
    assert stats.active_sequences == 0
    assert all(w.used == 0 for w in stats.workers.values()), stats.workers
    assert stats.prefix_hit_tokens["default"] == 16 * (len(results["cached"]) - 1)
    assert stats.cow_copies >= 4
    # The per-layer calls reached the workers (on this node) over their worker channels.
    clients = svc.coordinator._clients.values()
    calls = [(c.channel_calls, c.ray_data_calls) for c in clients]
    assert sum(c for c, _ in calls) > 0 and all(r == 0 for _, r in calls), calls
    # GetInfo says how each worker is reached: over its channel once one was opened.
    with KVCacheClient(svc.address) as client:
        paths = {w.worker_id: w.data_path for w in client.info().workers}
    for c in clients:
        assert paths[c.worker_id] == ("channel_unix" if c.channel_calls else ""), paths
    # ... and the service counted them so (kvcache_worker_data_calls_total).
    registry = svc.service.metrics.registry
    for c in clients:
        for path, n in (("channel", c.channel_calls), ("ray", c.ray_data_calls)):
            got = registry.get_sample_value(
                "kvcache_worker_data_calls_total", {"worker": c.worker_id, "path": path}
            )
            assert (got or 0) == n, (c.worker_id, path, got, n)


def test_export_import_and_all_layer_append_through_ray(svc) -> None:
    gen = torch.Generator().manual_seed(7)
    with KVCacheClient(svc.address) as client:
        src = client.create_sequence()
        kv = torch.randn(NL, 23, HKV, D, generator=gen)
        ids = list(range(3000, 3023))
        assert client.append(src.seq_id, ids, kv, -kv) == 0
        exported = client.export_blocks(src.seq_id, chunk_bytes=1000)
        assert exported.num_tokens == 23 and exported.token_ids == ids
        blocks = exported.blocks()
        assert blocks.shape == (6, NL, 2, HKV, LAYOUT.block_size, D)
        # The exported bytes hold exactly what was appended.
        flat_k = blocks[:, :, 0].permute(1, 0, 3, 2, 4).reshape(NL, -1, HKV, D)[:, :23]
        assert torch.equal(flat_k, kv)
        copy = client.import_blocks(exported.to_bytes())
        assert copy.num_cached_tokens == 23
        q = torch.randn(5, HQ, D, generator=gen)
        for layer in range(NL):
            a, b = client.attend(layer, [AttendItem(src.seq_id, q), AttendItem(copy.seq_id, q)])
            assert torch.equal(a, b)
        # The import shared the source's published full blocks instead of writing them.
        assert svc.stats().prefix_hit_tokens["default"] >= 20
        client.free(src.seq_id)
        client.free(copy.seq_id)
    svc.check_integrity()


def _mapped_by(handle, path: str) -> bool:
    """Whether the Ray worker's process maps `path` (its /proc/<pid>/maps)."""
    pid = ray.get(handle.__ray_call__.remote(lambda w: os.getpid()))
    with open(f"/proc/{pid}/maps") as maps:
        return any(path in line for line in maps)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc (Linux)")
def test_shared_memory_tensors_reach_the_ray_workers_in_place(svc, monkeypatch) -> None:
    # A same-host client's shared region: the workers map its file over their channels and
    # read its key, value and query (and write its outputs) where they lie. Results equal
    # the bytes path's, bit for bit; a non-finite input is still refused with nothing
    # changed, its output slot included.
    import cache_service.api.batch_decode_memo as memo_mod

    slots: list[tuple[int, int]] = []
    real_outputs = memo_mod.shared_outputs

    def recorded(*args):
        outputs = real_outputs(*args)
        if outputs.out is not None:  # the shared-memory client's calls
            slots.append((outputs.out.offset, outputs.out.nbytes))
        return outputs

    monkeypatch.setattr(memo_mod, "shared_outputs", recorded)
    gen = torch.Generator().manual_seed(7)
    with (
        KVCacheClient(svc.address, timeout_s=60) as shm,
        KVCacheClient(svc.address, timeout_s=60, shared_memory=False) as plain,
    ):
        ids, twins = decode_with_twins(shm, plain, 4, 3, gen)
        regions = svc.service.shared_regions
        (path,) = [r.path for r in regions._regions.values()]
        handles = [c.handle for c in svc.coordinator._clients.values()]
        assert any(_mapped_by(h, path) for h in handles)
        before = svc.stats()
        mm = next(iter(regions._regions.values())).mm
        for layer in (0, 1):  # the full path, then a repeated layer's short one
            k, v = (torch.randn(4, 1, HKV, D, generator=gen) for _ in range(2))
            q = torch.randn(4, 1, HQ, D, generator=gen)
            bad = k.clone()
            bad[2, 0, 0, 0] = float("inf")
            at, size = slots[-1]
            last_output = bytes(mm[at : at + size])
            with pytest.raises(InvalidArgumentError, match=r"items\[2\]\.key"):
                shm.append_attend_batch(layer, ids, [[5]] * 4, bad, v, q)
            assert svc.stats() == before
            assert slots[-1] == (at, size) and bytes(mm[at : at + size]) == last_output
            shm.append_attend_batch(layer, ids, [[5]] * 4, k, v, q)
            plain.append_attend_batch(layer, twins, [[5]] * 4, k, v, q)
            before = svc.stats()
        for s in ids:
            shm.free(s)
        for s in twins:
            plain.free(s)
    svc.check_integrity()


def test_a_step_lease_on_a_ray_worker(svc) -> None:
    # The step's first layer by call, then its other layers run here on the pool of the
    # Ray actor holding the batch (a process of its own: its pool is a memory file this
    # process maps); the next call commits them. What the layers answer is dense
    # attention over all, and the next call sees the leased writes.
    from workers.lease_client import LeaseClient

    gen = torch.Generator().manual_seed(11)
    with KVCacheClient(svc.address, timeout_s=60) as client:
        mirrors = []
        for s in range(2):
            tokens = [900 + s, 901, 902 + s]
            m = Mirror(client.create_sequence(tokens).seq_id, NL)
            for layer in range(NL):
                k, v = torch.randn(2, 3, HKV, D, generator=gen)
                client.append(m.seq_id, tokens, k, v, layer)
                m.add(layer, k, v)
            mirrors.append(m)
        if len({svc.workers_of(m.seq_id) for m in mirrors}) != 1:
            # On two workers the batch has no one-worker step: no lease, by design.
            seq_ids = [mirrors[0].seq_id]
            mirrors = mirrors[:1]
        else:
            seq_ids = [m.seq_id for m in mirrors]
        b = len(seq_ids)
        step = {layer: torch.randn(3, b, 1, HQ, D, generator=gen) for layer in range(NL)}

        def kvq(layer):
            k, v, q = step[layer]
            return k[..., :HKV, :].contiguous(), v[..., :HKV, :].contiguous(), q

        k, v, q = kvq(0)
        client.append_attend_batch(0, seq_ids, [[7]] * b, k, v, q)
        for i, m in enumerate(mirrors):
            m.add(0, k[i], v[i])
        lease = client.lease_step(seq_ids, HQ)
        assert lease.granted, lease.reason
        leases = LeaseClient(lease.socket, torch.device("cpu"))
        opened = leases.open(lease.lease_id)
        for layer in lease.layers:
            k, v, q = kvq(layer)
            out = leases.run_layer(opened, layer, k, v, q).view(q.shape)
            for i, m in enumerate(mirrors):
                m.add(layer, k[i], v[i])
                check(out[i], m, layer, q[i])
        assert leases.end(opened).written == tuple(lease.layers)
        # The next call on the batch ends the lease: every layer holds the new token,
        # read by the worker from the pool this process wrote.
        out = client.attend_batch(NL - 1, seq_ids, q)
        for i, m in enumerate(mirrors):
            check(out[i], m, NL - 1, q[i])
        assert leases.open(lease.lease_id) is None
        # Naming the connection, the actor's grant opens the next lease for it and the
        # plan comes back through Ray with the answer: no OPEN.
        step = {layer: torch.randn(3, b, 1, HQ, D, generator=gen) for layer in range(NL)}
        k, v, q = kvq(0)
        client.append_attend_batch(0, seq_ids, [[8]] * b, k, v, q)
        for i, m in enumerate(mirrors):
            m.add(0, k[i], v[i])
        lease = client.lease_step(seq_ids, HQ, lease_connections={leases.path: leases.connection})
        assert lease.granted and lease.plan, lease.reason
        opened = leases.open(lease.lease_id, lease.plan)
        for layer in lease.layers:
            k, v, q = kvq(layer)
            leases.run_layer(opened, layer, k, v, q)
            for i, m in enumerate(mirrors):
                m.add(layer, k[i], v[i])
        assert leases.end(opened).written == tuple(lease.layers)
        out = client.attend_batch(NL - 1, seq_ids, q)
        for i, m in enumerate(mirrors):
            check(out[i], m, NL - 1, q[i])
        # Three decode steps under one lease planned for the first step's tokens: the
        # actor reserves their positions at once, this process runs them one after the
        # other, and its report (through the actor) names the later steps' tokens.
        lease = client.lease_step(
            seq_ids, HQ, [[20 + i] for i in range(b)], steps=3,
            lease_connections={leases.path: leases.connection},
        )  # fmt: skip
        assert lease.granted and lease.steps == 3, lease.reason
        opened = leases.open(lease.lease_id, lease.plan)
        for n in range(3):
            if n:
                leases.advance(opened, [20 + 10 * n + i for i in range(b)])
            step = {layer: torch.randn(3, b, 1, HQ, D, generator=gen) for layer in range(NL)}
            for layer in range(NL):
                k, v, q = kvq(layer)
                out = leases.run_layer(opened, layer, k, v, q).view(q.shape)
                for i, m in enumerate(mirrors):
                    m.add(layer, k[i], v[i])
                    check(out[i], m, layer, q[i])
        assert leases.end(opened).steps == 3
        out = client.attend_batch(NL - 1, seq_ids, q)  # ends the lease: all three committed
        for i, m in enumerate(mirrors):
            check(out[i], m, NL - 1, q[i])
            exported = client.export_blocks(m.seq_id).token_ids
            assert exported[-3:] == [20 + i, 30 + i, 40 + i]
        leases.close()
        for m in mirrors:
            client.free(m.seq_id)
    svc.check_integrity()
