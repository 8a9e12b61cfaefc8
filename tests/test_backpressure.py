"""Backpressure through the real server: a full pool evicts cached-free blocks before it
refuses with RESOURCE_EXHAUSTED; one client may have only so many calls in flight; a call
whose deadline passes gets DEADLINE_EXCEEDED and leaves nothing half-applied."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from service_support import (
    LAYOUT,
    Mirror,
    Recording,
    ServiceHarness,
    local_workers,
    service_config,
)

from cache_service.client import (
    AppendAttendItem,
    AttendItem,
    DeadlineExceededError,
    KVCacheClient,
    ResourceExhaustedError,
)

HQ, HKV, D = 4, LAYOUT.num_kv_heads, LAYOUT.head_dim
L = LAYOUT.num_layers


def kv(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(L, n, HKV, D), torch.randn(L, n, HKV, D)


def append_all(client: KVCacheClient, m: Mirror, ids: list[int], **kw) -> None:
    """Append `ids` on every layer at once and mirror them."""
    k, v = kv(len(ids))
    client.append(m.seq_id, ids, k, v, **kw)
    m.tokens += ids
    for layer in range(L):
        m.add(layer, k[layer], v[layer])


def outputs(client: KVCacheClient, m: Mirror, q: torch.Tensor) -> list[torch.Tensor]:
    outs = [client.attend(layer, [AttendItem(m.seq_id, q)])[0] for layer in range(L)]
    for layer, out in enumerate(outs):
        assert torch.allclose(out.double(), m.reference(layer, q)[0], atol=1e-5)
    return outs


def worker_stats(client: KVCacheClient):
    (w,) = client.stats().workers
    return w


def seq_state(svc: ServiceHarness, seq_id: str):
    info = svc.call(svc.coordinator.block_manager.sequence_info, "default", seq_id)
    return tuple(info.token_ids), tuple(info.written), info.num_blocks


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s} s"
        time.sleep(0.02)


def test_a_full_pool_evicts_cached_free_blocks_first_then_refuses():
    # One worker of 8 blocks of 4 slots.
    with (
        ServiceHarness(service_config(), local_workers(1, num_blocks=8)) as svc,
        KVCacheClient(svc.address, timeout_s=20) as client,
    ):
        bystander = Mirror(client.create_sequence().seq_id, L)
        append_all(client, bystander, [7, 7, 7])  # 1 block, partly filled: never cached
        q = torch.randn(2, HQ, D)
        before_out = outputs(client, bystander, q)

        prompt = list(range(100, 116))  # 4 full blocks, published once every layer is written
        a = Mirror(client.create_sequence(prompt).seq_id, L)
        append_all(client, a, prompt)
        client.free(a.seq_id)
        w = worker_stats(client)
        assert (w.used_blocks, w.cached_free_blocks, w.free_blocks) == (1, 4, 3)
        assert client.lookup(prompt) > 0

        # 5 blocks: the 3 free ones first, then the 2 least recently freed cached ones.
        b = Mirror(client.create_sequence().seq_id, L)
        append_all(client, b, list(range(20)))
        w = worker_stats(client)
        assert (w.used_blocks, w.cached_free_blocks, w.free_blocks) == (6, 2, 0)
        assert client.stats().evictions == 2
        # A freed sequence releases its blocks last-first, so the tail of the prompt went
        # first and the head of the chain is still found.
        assert client.lookup(prompt) == 8

        # 3 blocks: only 2 evictable left: refused, all or nothing.
        c = client.create_sequence()
        stats_before = client.stats()
        with pytest.raises(ResourceExhaustedError, match="blocks") as info:
            client.append(c.seq_id, list(range(12)), *kv(12))
        assert "free sequences or retry later" in info.value.message
        after = client.stats()
        assert after.workers == stats_before.workers and after.evictions == stats_before.evictions
        assert seq_state(svc, c.seq_id) == ((), (0,) * L, 0)
        svc.check_integrity()
        assert all(
            torch.equal(x, y)
            for x, y in zip(outputs(client, bystander, q), before_out, strict=True)
        )

        # Room again once a sequence is freed.
        client.free(b.seq_id)
        cm = Mirror(c.seq_id, L)
        append_all(client, cm, list(range(12)))
        outputs(client, cm, q)
        for s in (bystander.seq_id, c.seq_id):
            client.free(s)
        svc.check_integrity()
        assert worker_stats(client).used_blocks == 0


def test_a_client_with_too_many_calls_in_flight_is_refused_and_others_are_not():
    config = service_config(
        **{"server.max_in_flight_per_client": 2, "coordinator.batch_window_ms": 1000.0}
    )
    # Every data call takes 1 s on the worker, and a call arriving meanwhile waits for it
    # (and for the 1 s batching window): all seven calls below are in flight together.
    slow = [Recording(w, delay_s=1.0) for w in local_workers(1, num_blocks=16)]
    with (
        ServiceHarness(config, slow) as svc,
        KVCacheClient(svc.address, timeout_s=20) as greedy,
        KVCacheClient(svc.address, timeout_s=20) as polite,
    ):
        mirrors = []
        for client in (greedy, polite):
            m = Mirror(client.create_sequence().seq_id, L)
            append_all(client, m, [1, 2, 3])
            mirrors.append(m)
        q = torch.randn(1, HQ, D)
        ref = mirrors[0].reference(0, q)[0]
        results: list[object] = []
        lock = threading.Lock()
        barrier = threading.Barrier(7)

        def call(client: KVCacheClient, m: Mirror) -> None:
            barrier.wait()
            try:
                out = client.attend(0, [AttendItem(m.seq_id, q)])[0]
                outcome: object = ("ok", client is polite, out)
            except ResourceExhaustedError as exc:
                outcome = ("refused", client is polite, exc.message)
            with lock:
                results.append(outcome)

        # Six of the greedy client's calls are in flight together, plus one of the polite
        # client's.
        threads = [threading.Thread(target=call, args=(greedy, mirrors[0])) for _ in range(6)]
        threads.append(threading.Thread(target=call, args=(polite, mirrors[1])))
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        refused = [r for r in results if r[0] == "refused"]
        accepted = [r for r in results if r[0] == "ok"]
        assert len(results) == 7
        assert refused and all(not polite for _, polite, _ in refused)
        assert len([r for r in accepted if not r[1]]) == 2  # the greedy client's limit
        assert any(r[1] for r in accepted)  # the other client was served meanwhile
        for _, _, msg in refused:
            assert "too many requests in flight" in msg and "2 allowed" in msg
        for _, polite_client, out in accepted:
            if not polite_client:
                assert torch.allclose(out.double(), ref, atol=1e-5)
        # Its calls done, the greedy client is served again.
        greedy.attend(0, [AttendItem(mirrors[0].seq_id, q)])
        svc.check_integrity()


def test_a_call_past_its_deadline_is_exceeded_and_leaves_nothing_half_applied():
    # Each worker call takes 1 s (a lone caller pays no batching window): a 0.2 s deadline
    # passes while the call is inside the coordinator, after its blocks were reserved.
    slow = [Recording(w, delay_s=1.0) for w in local_workers(1, num_blocks=16)]
    with (
        ServiceHarness(service_config(), slow) as svc,
        KVCacheClient(svc.address, timeout_s=20) as client,
    ):
        m = Mirror(client.create_sequence().seq_id, L)
        append_all(client, m, [1, 2, 3, 4, 5])  # a full block and one token
        state = seq_state(svc, m.seq_id)
        used = worker_stats(client).used_blocks
        k, v, q = torch.randn(4, HKV, D), torch.randn(4, HKV, D), torch.randn(4, HQ, D)
        item = AppendAttendItem(m.seq_id, [6, 7, 8, 9], k, v, q)

        t0 = time.monotonic()
        with pytest.raises(DeadlineExceededError):
            client.append_attend(0, [item], timeout_s=0.2)
        assert time.monotonic() - t0 < 0.9  # the client got its answer at its deadline
        # The server finishes the worker round it started, then drops the reservation.
        wait_for(lambda: seq_state(svc, m.seq_id) == state, 10, "the reservation to go")
        assert worker_stats(client).used_blocks == used
        svc.check_integrity()

        # A tiny deadline on the other calls: refused, nothing changes.
        with pytest.raises(DeadlineExceededError):
            client.attend(0, [AttendItem(m.seq_id, q)], timeout_s=0.001)
        with pytest.raises(DeadlineExceededError):
            client.append(m.seq_id, [6], *kv(1), timeout_s=0.001)
        wait_for(lambda: seq_state(svc, m.seq_id) == state, 10, "state to settle")

        # The same call again, with time to finish: exactly what an undisturbed call gives.
        (out,) = client.append_attend(0, [item])
        m.add(0, k, v)
        assert torch.allclose(out.double(), m.reference(0, q)[0], atol=1e-5)
        tokens, written, _ = seq_state(svc, m.seq_id)
        assert tokens == (1, 2, 3, 4, 5, 6, 7, 8, 9) and written == (9, 5)
        client.free(m.seq_id)
        svc.check_integrity()
        assert worker_stats(client).used_blocks == 0
