"""All or nothing for a multi-sequence call, through the real server.

An AppendAttend whose last item cannot fit (the earlier items alone would, and one of them
needs a copy-on-write copy) is refused with RESOURCE_EXHAUSTED and changes nothing: the
control plane's full records, its stats and its integrity are as before, and a bystander's
attention output is bit-identical. A call that fails late (the worker refuses it after the
reservations were made) releases what it reserved, for AppendAttend and Append alike.

The write path also no longer copies a sequence's token list per call: `sequence_info` is
made to fail, and appends, their errors and the decode loop still behave.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from service_support import HQ, LAYOUT, Mirror, ServiceHarness, local_workers, service_config

from cache_service.client import (
    AppendAttendItem,
    AttendItem,
    InvalidArgumentError,
    KVCacheClient,
    NotFoundError,
    ResourceExhaustedError,
)
from workers.errors import InvalidWorkerRequest

pytestmark = pytest.mark.timeout(60)

D, HKV, NL = LAYOUT.head_dim, LAYOUT.num_kv_heads, LAYOUT.num_layers
GEN = torch.Generator().manual_seed(7)


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN)


@pytest.fixture
def svc():
    # Two pools of 8 blocks of 4 tokens.
    with ServiceHarness(service_config(), local_workers(2, num_blocks=8)) as harness:
        yield harness


@pytest.fixture
def client(svc):
    with KVCacheClient(svc.address, timeout_s=20, max_attempts=1) as c:
        yield c


def records(svc: ServiceHarness) -> dict[str, Any]:
    return svc.call(svc.coordinator.block_manager.to_records)


def prefill(client: KVCacheClient, ids: list[int]) -> Mirror:
    """A new sequence holding `ids` on every layer (one Append)."""
    h = client.create_sequence()
    m = Mirror(h.seq_id, NL)
    k, v = rand(NL, len(ids), HKV, D), rand(NL, len(ids), HKV, D)
    client.append(h.seq_id, ids, k, v)
    for layer in range(NL):
        m.add(layer, k[layer], v[layer])
    m.tokens = list(ids)
    return m


class Snapshot:
    """Everything that must not move: records, stats, integrity, a bystander's outputs."""

    def __init__(self, svc: ServiceHarness, client: KVCacheClient, bystander: Mirror) -> None:
        self.svc, self.client, self.bystander = svc, client, bystander
        self.query = rand(3, HQ, D)
        self.records = records(svc)
        self.stats = svc.stats()
        self.outputs = self._outputs()

    def _outputs(self) -> list[torch.Tensor]:
        return [
            self.client.attend(layer, [AttendItem(self.bystander.seq_id, self.query)])[0]
            for layer in range(NL)
        ]

    def assert_unchanged(self) -> None:
        self.svc.check_integrity()
        assert records(self.svc) == self.records
        assert self.svc.stats() == self.stats
        for now, before in zip(self._outputs(), self.outputs, strict=True):
            assert torch.equal(now, before)


def item(m: Mirror, ids: list[int], rows: int = 1) -> AppendAttendItem:
    n = len(ids)
    return AppendAttendItem(m.seq_id, ids, rand(n, HKV, D), rand(n, HKV, D), rand(rows, HQ, D))


def test_a_batch_whose_last_item_cannot_fit_changes_nothing(svc, client) -> None:
    bystander = prefill(client, list(range(100, 107)))  # 2 blocks
    a = prefill(client, [1, 2, 3])  # 1 block, partly filled
    parent = prefill(client, [4, 5, 6, 7, 8, 9])  # 2 blocks, the last partly filled
    fork = client.fork(parent.seq_id)  # shares both: its next write copies the last one
    big = Mirror(client.create_sequence().seq_id, NL)
    free = sum(w.free_blocks for w in client.stats().workers)
    # The last item alone would fit; after the first two (1 new block, 1 copy) it cannot.
    need = free - 1
    assert need * LAYOUT.block_size > 0
    batch = [
        item(a, [10, 11, 12, 13]),
        item(Mirror(fork.seq_id, NL), [14]),
        item(big, list(range(need * LAYOUT.block_size))),
    ]
    snap = Snapshot(svc, client, bystander)
    with pytest.raises(ResourceExhaustedError) as info:
        client.append_attend(0, batch)
    assert "write 3 of 3" in info.value.message and big.seq_id in info.value.message
    snap.assert_unchanged()

    # The same call without its last item goes through, correct against dense attention
    # (the copy-on-write copy included), and the last item alone fits too.
    outs = client.append_attend(0, batch[:2])
    fork_mirror = parent.fork(fork.seq_id)
    for m, it, out in zip((a, fork_mirror), batch[:2], outs, strict=True):
        m.add(0, it.key, it.value)
        ref, _ = m.reference(0, it.query)
        assert torch.allclose(out.double(), ref, atol=1e-5)
    assert client.stats().cow_copies == snap.stats.cow_copies + 1
    client.free(a.seq_id)
    client.append_attend(0, [batch[2]])
    svc.check_integrity()


def _refuse_on_workers(svc: ServiceHarness, method: str, monkeypatch) -> list[int]:
    """Make every worker refuse `method` (as a worker refuses a request it finds bad)."""
    calls: list[int] = []

    def refuse(*args: Any, **kwargs: Any) -> None:
        calls.append(1)
        raise InvalidWorkerRequest(f"{method} refused by the test")

    for w in svc.workers or []:
        monkeypatch.setattr(w.worker, method, refuse)
    return calls


def test_a_call_failing_on_the_worker_releases_what_it_reserved(svc, client, monkeypatch):
    bystander = prefill(client, list(range(100, 107)))
    a = prefill(client, [1, 2, 3])
    b = Mirror(client.create_sequence().seq_id, NL)
    snap = Snapshot(svc, client, bystander)
    calls = _refuse_on_workers(svc, "run_round", monkeypatch)
    # a grows by a block, b by two: reserved, sent, refused by the worker.
    with pytest.raises(InvalidArgumentError, match="refused by the test"):
        client.append_attend(0, [item(a, [4, 5, 6, 7, 8]), item(b, list(range(5)))])
    assert calls
    monkeypatch.undo()
    snap.assert_unchanged()
    # Nothing is left reserved: other token ids are welcome where the failed ones were.
    for m in (a, b):
        client.append_attend(0, [item(m, [77])])
    svc.check_integrity()

    c = prefill(client, [1, 2])
    refused = _refuse_on_workers(svc, "write", monkeypatch)
    snap = Snapshot(svc, client, bystander)
    with pytest.raises(InvalidArgumentError, match="refused by the test"):
        client.append(c.seq_id, list(range(9)), rand(NL, 9, HKV, D), rand(NL, 9, HKV, D))
    assert refused
    monkeypatch.undo()
    snap.assert_unchanged()


def test_appends_never_copy_the_token_list(svc, client, monkeypatch) -> None:
    """`sequence_info` copies every token id; the append paths must not need it."""
    manager = svc.coordinator.block_manager

    def no(*args: Any) -> None:
        raise AssertionError("sequence_info called on the write path")

    monkeypatch.setattr(manager, "sequence_info", no)
    m = prefill(client, list(range(9)))
    for step in range(3):
        for layer in range(NL):
            it = item(m, [50 + step], rows=2)
            (out,) = client.append_attend(layer, [it])
            m.add(layer, it.key, it.value)
            ref, _ = m.reference(layer, it.query)
            assert torch.allclose(out.double(), ref, atol=1e-5)
    # The refusals the removed call used to produce still come, word for word.
    with pytest.raises(NotFoundError):
        client.append("nope", [1], rand(NL, 1, HKV, D), rand(NL, 1, HKV, D))
    with pytest.raises(NotFoundError):
        client.append_attend(
            0, [AppendAttendItem("nope", [1], *(rand(1, HKV, D),) * 2, rand(1, HQ, D))]
        )
    client.append(m.seq_id, [60], rand(1, HKV, D), rand(1, HKV, D), layer=0)
    with pytest.raises(InvalidArgumentError, match="position 12 holds token 60, got 61"):
        client.append_attend(1, [item(m, [61])])
    svc.check_integrity()
