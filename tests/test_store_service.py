"""The metadata store inside the real service: a coordinator restarted on the same store
and the same (surviving) workers continues every sequence; a worker that restarted while
the coordinator was down fails exactly the sequences with blocks on it.

The workers are in-process pools owned by the test, standing in for the detached Ray
actors that outlive a coordinator.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from service_support import HQ, LAYOUT, Mirror, ServiceHarness, local_workers, service_config

from cache_service.client import (
    AppendAttendItem,
    AttendItem,
    DataLossError,
    KVCacheClient,
    NotFoundError,
)

pytestmark = pytest.mark.timeout(60)


def _start(path: Path, workers: list) -> ServiceHarness:
    return ServiceHarness(service_config(store_path=str(path)), workers=workers)


def _stop_keeping_workers(h: ServiceHarness) -> None:
    h.workers = None  # the pools outlive the coordinator, like detached actors
    h.stop()


def _kv(shape: tuple[int, ...], g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _prefill(
    c: KVCacheClient, tokens: list[int], g: torch.Generator, source: Mirror | None = None
) -> Mirror:
    """A sequence holding `tokens`; a cached prefix comes from `source` (its K/V)."""
    seq = c.create_sequence(tokens)
    n = seq.num_cached_tokens
    assert n == 0 or source is not None, "unexpected prefix hit"
    k, v = _kv((LAYOUT.num_layers, len(tokens) - n, LAYOUT.num_kv_heads, LAYOUT.head_dim), g)
    c.append(seq.seq_id, tokens[n:], k, v)
    m = Mirror(seq.seq_id, LAYOUT.num_layers)
    m.tokens = list(tokens)
    for layer in range(LAYOUT.num_layers):
        if n:
            assert source is not None
            m.add(layer, torch.cat(source.k[layer])[:n], torch.cat(source.v[layer])[:n])
        m.add(layer, k[layer], v[layer])
    return m


def _step(c: KVCacheClient, m: Mirror, token: int, g: torch.Generator) -> list[torch.Tensor]:
    """One decode step on every layer; checks each output against dense attention."""
    outs = []
    for layer in range(LAYOUT.num_layers):
        k, v = _kv((1, LAYOUT.num_kv_heads, LAYOUT.head_dim), g)
        q = torch.randn((1, HQ, LAYOUT.head_dim), generator=g)
        (out,) = c.append_attend(layer, [AppendAttendItem(m.seq_id, [token], k, v, q)])
        m.add(layer, k, v)
        ref, _ = m.reference(layer, q)
        torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)
        outs.append(out)
    m.tokens.append(token)
    return outs


def _attend_all(c: KVCacheClient, m: Mirror, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    outs = []
    for layer in range(LAYOUT.num_layers):
        q = torch.randn((2, HQ, LAYOUT.head_dim), generator=g)
        (out,) = c.attend(layer, [AttendItem(m.seq_id, q)])
        outs.append(out)
    return outs


def test_restarted_coordinator_continues_every_sequence(tmp_path: Path) -> None:
    path = tmp_path / "meta.db"
    workers = local_workers(2, 24)
    g = torch.Generator().manual_seed(0)
    h = _start(path, workers)
    try:
        assert h.coordinator.generation == 1
        with KVCacheClient(h.address, max_attempts=1) as c:
            a = _prefill(c, list(range(10, 23)), g)
            b = _prefill(c, list(range(10, 23)), g, source=a)  # shares a's first 3 blocks
            assert (
                h.call(h.coordinator.block_manager.sequence_info, "default", b.seq_id).written[0]
                == 13
            )
            _step(c, a, 99, g)
            fork = a.fork(c.fork(a.seq_id).seq_id)
            _step(c, fork, 98, g)  # copy-on-write of the shared partial block
            gone = _prefill(c, [1, 2, 3, 4, 5], g)
            c.free(gone.seq_id)
            before = {m.seq_id: _attend_all(c, m, 7) for m in (a, b, fork)}
        stats = h.stats()
        h.check_integrity()
    finally:
        _stop_keeping_workers(h)

    h = _start(path, workers)
    try:
        assert h.coordinator.generation == 2
        assert h.stats() == stats
        h.check_integrity()
        with KVCacheClient(h.address, max_attempts=1) as c:
            for m in (a, b, fork):
                after = _attend_all(c, m, 7)
                for x, y in zip(before[m.seq_id], after, strict=True):
                    assert torch.equal(x, y), "results differ from before the restart"
            for m, token in ((a, 50), (b, 51), (fork, 52), (a, 53)):
                _step(c, m, token, g)
            with pytest.raises(NotFoundError):
                c.attend(0, [AttendItem(gone.seq_id, torch.zeros(1, HQ, LAYOUT.head_dim))])
            # A new prompt still hits the prefix recovered from the store.
            assert c.create_sequence(list(range(10, 23))).num_cached_tokens == 12
        h.check_integrity()
    finally:
        h.workers = workers
        h.stop()


def test_a_worker_restarted_while_the_coordinator_was_down_loses_only_its_sequences(
    tmp_path: Path,
) -> None:
    path = tmp_path / "meta.db"
    workers = local_workers(2, 24)
    g = torch.Generator().manual_seed(1)
    h = _start(path, workers)
    try:
        with KVCacheClient(h.address, max_attempts=1) as c:
            mirrors = [_prefill(c, [100 + i] * 6, g) for i in range(4)]
        placed = {m.seq_id: h.workers_of(m.seq_id) for m in mirrors}
    finally:
        _stop_keeping_workers(h)
    on_w1 = [m for m in mirrors if "w1" in placed[m.seq_id]]
    elsewhere = [m for m in mirrors if "w1" not in placed[m.seq_id]]
    assert on_w1 and elsewhere, f"placement put everything on one worker: {placed}"

    workers[1].restart()  # new epoch, empty pool, while no coordinator runs
    h2 = _start(path, workers)
    try:
        with KVCacheClient(h2.address, max_attempts=1) as c:
            for m in on_w1:
                with pytest.raises(DataLossError):
                    _attend_all(c, m, 3)
                c.free(m.seq_id)
            for m in elsewhere:
                _step(c, m, 7, g)
        h2.check_integrity()
        assert h2.stats().workers["w1"].used == 0
    finally:
        h2.workers = workers
        h2.stop()
