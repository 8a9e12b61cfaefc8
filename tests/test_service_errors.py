"""Every error status over a real port, each leaving the service as it was: the control
plane passes check_integrity, its stats are unchanged, and a bystander sequence's attention
output is bit-identical before and after."""

from __future__ import annotations

import time

import grpc
import pytest
import torch
from service_support import HQ, LAYOUT, Mirror, ServiceHarness, local_workers, service_config

from cache_service._proto.kvcache.v1 import kvcache_pb2 as pb
from cache_service._proto.kvcache.v1 import kvcache_pb2_grpc as pb_grpc
from cache_service.client import (
    AppendAttendItem,
    AttendItem,
    DataLossError,
    FailedPreconditionError,
    InvalidArgumentError,
    KVCacheClient,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)

D, HKV = LAYOUT.head_dim, LAYOUT.num_kv_heads
GEN = torch.Generator().manual_seed(0)


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN)


def step(client: KVCacheClient, m: Mirror, ids: list[int], layers=None) -> list[torch.Tensor]:
    """append_attend the tokens on every layer (or `layers`); check against dense."""
    outs = []
    for layer in layers if layers is not None else range(LAYOUT.num_layers):
        k, v, q = rand(len(ids), HKV, D), rand(len(ids), HKV, D), rand(len(ids), HQ, D)
        (out,) = client.append_attend(layer, [AppendAttendItem(m.seq_id, ids, k, v, q)])
        m.add(layer, k, v)
        ref, _ = m.reference(layer, q)
        assert torch.allclose(out.double(), ref, atol=1e-5), f"layer {layer}"
        outs.append(out)
    m.tokens += ids
    return outs


@pytest.fixture
def svc():
    workers = local_workers(2, num_blocks=16)
    with ServiceHarness(service_config(), workers) as harness:
        yield harness


@pytest.fixture
def client(svc):
    with KVCacheClient(svc.address, timeout_s=20) as c:
        yield c


class Bystander:
    """A sequence that must not notice other calls' failures."""

    def __init__(self, client: KVCacheClient) -> None:
        self.client = client
        handle = client.create_sequence()
        self.mirror = Mirror(handle.seq_id, LAYOUT.num_layers)
        step(client, self.mirror, list(range(100, 107)))
        self.query = rand(2, HQ, D)
        self.before = self.outputs()

    def outputs(self) -> list[torch.Tensor]:
        return [
            self.client.attend(layer, [AttendItem(self.mirror.seq_id, self.query)])[0]
            for layer in range(LAYOUT.num_layers)
        ]

    def assert_unchanged(self) -> None:
        for a, b in zip(self.outputs(), self.before, strict=True):
            assert torch.equal(a, b)


def assert_refused(svc, bystander, stats_before, error, fn, *needles) -> None:
    with pytest.raises(error) as info:
        fn()
    for needle in needles:
        assert needle in info.value.message, info.value.message
    svc.check_integrity()
    assert svc.stats() == stats_before
    bystander.assert_unchanged()


def test_invalid_argument_not_found_exhausted_and_precondition_change_nothing(svc, client):
    by = Bystander(client)
    seq = client.create_sequence()
    m = Mirror(seq.seq_id, LAYOUT.num_layers)
    step(client, m, [1, 2, 3], layers=[0])  # layer 0 written, layer 1 not yet
    before = svc.stats()
    sid = seq.seq_id

    def aa(layer, ids, k, v, q, seq_id=sid):
        return client.append_attend(layer, [AppendAttendItem(seq_id, ids, k, v, q)])

    # INVALID_ARGUMENT
    assert_refused(svc, by, before, InvalidArgumentError,
                   lambda: aa(1, [1, 2, 3], rand(3, 3, D), rand(3, 3, D), rand(1, HQ, D)),
                   "items[0].key", "[3, 3, 16]")  # fmt: skip
    assert_refused(svc, by, before, InvalidArgumentError,
                   lambda: aa(1, [1, 2], rand(3, HKV, D), rand(3, HKV, D), rand(1, HQ, D)),
                   "items[0].key")  # fmt: skip
    assert_refused(svc, by, before, InvalidArgumentError,
                   lambda: aa(7, [1, 2, 3], rand(3, HKV, D), rand(3, HKV, D), rand(1, HQ, D)),
                   "layer must be in [0, 2)")  # fmt: skip
    assert_refused(svc, by, before, InvalidArgumentError,
                   lambda: aa(1, [1, 2, 3], rand(3, HKV, D), rand(3, HKV, D), rand(1, 3, D)),
                   "not a positive multiple")  # fmt: skip
    assert_refused(svc, by, before, InvalidArgumentError,
                   lambda: aa(1, [1, 9, 3], rand(3, HKV, D), rand(3, HKV, D), rand(1, HQ, D)),
                   "position 1 holds token 2, got 9")  # fmt: skip
    assert_refused(svc, by, before, InvalidArgumentError,
                   lambda: aa(1, [1, 2, 3], rand(3, HKV, D), rand(3, HKV, D), rand(5, HQ, D)),
                   "5 query rows")  # fmt: skip
    nan = rand(3, HKV, D)
    nan[1, 0, 0] = float("nan")
    assert_refused(svc, by, before, InvalidArgumentError,
                   lambda: aa(1, [1, 2, 3], nan, rand(3, HKV, D), rand(1, HQ, D)), "NaN")  # fmt: skip
    item = AppendAttendItem(sid, [1, 2, 3], rand(3, HKV, D), rand(3, HKV, D), rand(1, HQ, D))
    assert_refused(svc, by, before, InvalidArgumentError,
                   lambda: client.append_attend(1, [item, item]), "appears twice")  # fmt: skip
    # Items of one call are checked before any is written: a bad second item keeps the
    # good first one from being written too.
    bad = AppendAttendItem(
        by.mirror.seq_id, [5], rand(1, HKV, D), rand(1, HKV, D), rand(1, HQ, D * 2)
    )
    assert_refused(svc, by, before, InvalidArgumentError,
                   lambda: client.append_attend(1, [item, bad]), "items[1].query")  # fmt: skip
    # A malformed tensor on the wire (bytes that do not fill the shape).
    stub = pb_grpc.KVCacheStub(grpc.insecure_channel(svc.address))
    raw = pb.AttendRequest(layer=0, items=[pb.AttendItem(
        seq_id=sid, query=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1, HQ, D], data=b"\0" * 12))])  # fmt: skip
    with pytest.raises(grpc.RpcError) as info:
        stub.Attend(raw, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "items[0].query: 12 data bytes" in info.value.details()
    # The streamed Append: all-layer shape and token count must agree.
    assert_refused(svc, by, before, InvalidArgumentError,
                   lambda: client.append(sid, [4], rand(1, HKV, D), rand(1, HKV, D)),
                   "key has shape [1, 2, 16], expected [2, 1, 2, 16]")  # fmt: skip

    # NOT_FOUND
    assert_refused(svc, by, before, NotFoundError,
                   lambda: client.attend(0, [AttendItem("nope", rand(1, HQ, D))]), "nope")  # fmt: skip
    assert_refused(svc, by, before, NotFoundError, lambda: client.free("nope"))
    assert_refused(svc, by, before, NotFoundError, lambda: client.fork("nope"))
    assert_refused(svc, by, before, NotFoundError,
                   lambda: aa(0, [4], rand(1, HKV, D), rand(1, HKV, D), rand(1, HQ, D), seq_id="x"))  # fmt: skip

    # FAILED_PRECONDITION: layer 1 has nothing written; layer 0 has 3 tokens, not 4.
    assert_refused(svc, by, before, FailedPreconditionError,
                   lambda: client.attend(1, [AttendItem(sid, rand(1, HQ, D))]), "layer 1")  # fmt: skip
    assert_refused(svc, by, before, FailedPreconditionError,
                   lambda: client.attend(0, [AttendItem(sid, rand(4, HQ, D))]), "4 query rows")  # fmt: skip

    # RESOURCE_EXHAUSTED: more tokens than the pools have free (2 x 16 blocks x 4 slots, 3
    # held by the other sequences); INVALID_ARGUMENT: more than they hold at all.
    big = rand(LAYOUT.num_layers, 124, HKV, D)
    fresh = client.create_sequence()
    before = svc.stats()
    assert_refused(svc, by, before, ResourceExhaustedError,
                   lambda: client.append(fresh.seq_id, list(range(124)), big, big), "blocks")  # fmt: skip
    huge = rand(LAYOUT.num_layers, 200, HKV, D)
    assert_refused(svc, by, before, InvalidArgumentError,
                   lambda: client.append(fresh.seq_id, list(range(200)), huge, huge), "128 tokens")  # fmt: skip

    # After all that, the sequence still continues where it was.
    step(client, m, [1, 2, 3], layers=[1])
    step(client, m, [4])


def lose_and_wait(svc, worker_id: str, timeout_s: float = 10.0) -> None:
    """Wait until the coordinator has re-registered `worker_id` after a loss."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = {w.worker_id: w for w in svc.call(svc.coordinator.workers)}
        if states[worker_id].up:
            return
        time.sleep(0.05)
    raise AssertionError(f"{worker_id} did not come back")


def test_a_restarted_worker_fails_its_sequences_with_data_loss_and_only_those(svc, client):
    by = Bystander(client)
    home = svc.workers_of(by.mirror.seq_id)
    assert len(home) == 1
    victim_worker = next(w for w in svc.workers if w.worker_id not in home)
    # A sequence placed on the other worker (placement picks the one with most room).
    victim = client.create_sequence()
    vm = Mirror(victim.seq_id, LAYOUT.num_layers)
    step(client, vm, [1, 2, 3, 4, 5])
    assert svc.workers_of(victim.seq_id) == (victim_worker.worker_id,)
    old_epoch = svc.call(svc.coordinator.workers)[1].epoch

    victim_worker.restart()  # new epoch, empty pool: what a Ray restart does
    with pytest.raises(DataLossError) as info:
        step(client, vm, [6])
    assert victim.seq_id in info.value.message and "recompute" in info.value.message
    svc.check_integrity()
    by.assert_unchanged()
    step(client, by.mirror, [7])  # the other worker keeps serving
    # The sequence stays failed until its client frees it.
    with pytest.raises(DataLossError, match="free it and recompute"):
        client.attend(0, [AttendItem(victim.seq_id, rand(1, HQ, D))])
    assert svc.stats().lost_sequences == 1
    client.free(victim.seq_id)
    assert svc.stats().lost_sequences == 0
    # The coordinator re-registers the worker (empty, new epoch) and uses it again.
    lose_and_wait(svc, victim_worker.worker_id)
    assert svc.call(svc.coordinator.workers)[1].epoch != old_epoch
    again = client.create_sequence()
    step(client, Mirror(again.seq_id, LAYOUT.num_layers), list(range(20)))
    svc.check_integrity()


def test_no_worker_left_is_unavailable_until_one_returns(svc, client):
    seq = client.create_sequence()
    m = Mirror(seq.seq_id, LAYOUT.num_layers)
    step(client, m, [1, 2])
    for w in svc.workers:
        w.kill()
    svc.run(svc.coordinator.check_workers())  # what the periodic probe does
    with pytest.raises(UnavailableError, match="no worker is serving"):
        client.create_sequence([1, 2, 3])
    empty = None
    with pytest.raises(DataLossError):
        client.attend(0, [AttendItem(seq.seq_id, rand(1, HQ, D))])
    svc.check_integrity()
    assert svc.stats().workers == {}
    for w in svc.workers:
        w.restart()
    for w in svc.workers:
        lose_and_wait(svc, w.worker_id)
    empty = client.create_sequence()
    step(client, Mirror(empty.seq_id, LAYOUT.num_layers), [1, 2, 3])
    client.free(seq.seq_id)
    client.free(empty.seq_id)
    svc.check_integrity()
    assert all(w.used == 0 for w in svc.stats().workers.values())
