"""Requests the service cannot honour are refused up front, with a message that says what
disagrees, before anything is counted or changed (issue 35, items 7 and 8), over a real
port on every transport:

- a prompt, lookup, pin or append longer than any sequence can hold (every block of every
  worker) is INVALID_ARGUMENT naming both lengths; the prefix-query counter, the pool and a
  bystander sequence are unchanged;
- token ids and key / value rows that disagree are named as such, not as a shape error;
- an empty Attend / AppendAttend is INVALID_ARGUMENT, as empty batch calls are (unary,
  Session stream and local session); the client SDK refuses every empty call itself,
  before sending, with the error class the server's INVALID_ARGUMENT maps to.
"""

from __future__ import annotations

import socket

import grpc
import pytest
import torch
from service_support import HQ, LAYOUT, ServiceHarness, local_workers, service_config
from test_service_errors import Bystander

from cache_service._proto.kvcache.v1 import kvcache_pb2 as pb
from cache_service._proto.kvcache.v1 import kvcache_pb2_grpc as pb_grpc
from cache_service.client import AppendAttendItem, InvalidArgumentError, KVCacheClient
from cache_service.client.local_session_stream import LocalSessionStream

D, HKV = LAYOUT.head_dim, LAYOUT.num_kv_heads
WORKERS, BLOCKS = 2, 16
CAPACITY = WORKERS * BLOCKS * LAYOUT.block_size  # tokens one sequence could ever hold
GEN = torch.Generator().manual_seed(3)


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN)


@pytest.fixture(scope="module")
def svc():
    with ServiceHarness(service_config(), local_workers(WORKERS, num_blocks=BLOCKS)) as harness:
        yield harness


@pytest.fixture
def client(svc):
    with KVCacheClient(svc.address, timeout_s=20) as c:
        yield c


def refused(svc, bystander, fn, *needles: str) -> str:
    """fn() is INVALID_ARGUMENT whose message holds every needle; nothing changed."""
    before = svc.stats()
    with pytest.raises(InvalidArgumentError) as info:
        fn()
    message = info.value.message
    for needle in needles:
        assert needle in message, message
    svc.check_integrity()
    assert svc.stats() == before
    bystander.assert_unchanged()
    return message


def test_prompts_and_appends_longer_than_the_service_holds_are_refused(svc, client) -> None:
    by = Bystander(client)
    seq = client.create_sequence()
    cap = str(CAPACITY)
    huge = list(range(1_000_000))
    # The case: a million-token prompt on a service that holds CAPACITY tokens.
    refused(svc, by, lambda: client.create_sequence(huge), "prompt_token_ids", "1000000", cap)
    over = list(range(CAPACITY + 1))
    refused(svc, by, lambda: client.create_sequence(over), str(CAPACITY + 1), cap)
    refused(svc, by, lambda: client.lookup(over), "token_ids", str(CAPACITY + 1), cap)
    refused(svc, by, lambda: client.pin(over), "token_ids", str(CAPACITY + 1), cap)
    n = CAPACITY + 1
    k, v = rand(n, HKV, D), rand(n, HKV, D)
    refused(svc, by, lambda: client.append(seq.seq_id, over, k, v, layer=0), str(n), cap)
    item = AppendAttendItem(seq.seq_id, over, k, v, rand(1, HQ, D))
    refused(svc, by, lambda: client.append_attend(0, [item]), seq.seq_id, str(n), cap)
    kb, qb = rand(1, n, HKV, D), rand(1, 1, HQ, D)
    refused(svc, by, lambda: client.append_attend_batch(0, [seq.seq_id], [over], kb, kb, qb), cap)
    # An append that would only end past the capacity, on a sequence that holds tokens.
    client.append(seq.seq_id, [1, 2, 3], rand(3, HKV, D), rand(3, HKV, D), layer=0)
    rest = list(range(CAPACITY - 2))
    k, v = rand(len(rest), HKV, D), rand(len(rest), HKV, D)
    message = refused(svc, by, lambda: client.append(seq.seq_id, rest, k, v, layer=0), cap)
    assert str(CAPACITY + 1) in message, message
    # Exactly the capacity is a length the service accepts (the prompt is only looked up).
    assert client.lookup(list(range(CAPACITY))) == 0
    client.free(seq.seq_id)


def test_token_and_row_counts_that_disagree_are_named(svc, client) -> None:
    by = Bystander(client)
    seq = client.create_sequence()
    one, two = rand(1, HKV, D), rand(2, HKV, D)
    q = rand(1, HQ, D)
    refused(
        svc, by,
        lambda: client.append_attend(0, [AppendAttendItem(seq.seq_id, [1, 2], one, one, q)]),
        "items[0].token_ids has 2 entries but items[0].key has 1 row",
    )  # fmt: skip
    refused(
        svc, by,
        lambda: client.append_attend(0, [AppendAttendItem(seq.seq_id, [1, 2], two, one, q)]),
        "items[0].token_ids has 2 entries but items[0].value has 1 row",
    )  # fmt: skip
    refused(
        svc, by, lambda: client.append(seq.seq_id, [1, 2], one, one, layer=0),
        "token_ids has 2 entries but key has 1 row",
    )  # fmt: skip
    all_layers = rand(LAYOUT.num_layers, 3, HKV, D)
    refused(
        svc, by, lambda: client.append(seq.seq_id, [1, 2], all_layers, all_layers),
        "token_ids has 2 entries but key has 3 rows",
    )  # fmt: skip
    client.free(seq.seq_id)


def test_empty_calls_are_invalid_on_every_transport(svc, client) -> None:
    by = Bystander(client)
    channel = grpc.insecure_channel(svc.address)
    stub = pb_grpc.KVCacheStub(channel)
    with channel:
        for method, request in (
            (stub.Attend, pb.AttendRequest(layer=0)),
            (stub.AppendAttend, pb.AppendAttendRequest(layer=0)),
            (stub.AttendBatch, pb.AttendBatchRequest(layer=0)),
            (stub.AppendAttendBatch, pb.AppendAttendBatchRequest(layer=0)),
        ):
            with pytest.raises(grpc.RpcError) as info:
                method(request, timeout=20)
            assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "empty" in info.value.details(), info.value.details()
    refused(svc, by, lambda: client.attend(0, []), "items is empty")
    refused(svc, by, lambda: client.append_attend(0, []), "items is empty")
    refused(svc, by, lambda: client.attend_batch(0, [], rand(0, 1, HQ, D)), "seq_ids is empty")
    # The other transports (the client refuses an empty call itself, so the requests go
    # raw): the gRPC Session stream and the same-host local session.
    empty = [
        pb.SessionRequest(call_id=1, attend_batch=pb.AttendBatchRequest(layer=0)),
        pb.SessionRequest(call_id=2, append_attend_batch=pb.AppendAttendBatchRequest(layer=0)),
    ]
    channel = grpc.insecure_channel(svc.address)
    with channel:
        replies = list(pb_grpc.KVCacheStub(channel).Session(iter(empty), timeout=20))
    local = LocalSessionStream(client.info().local_session_socket, "", 1 << 20)
    try:
        replies += [
            pb.SessionResponse.FromString(local.call(r.SerializeToString(), 20)) for r in empty
        ]
    finally:
        local.close()
    assert len(replies) == 4
    for reply in replies:
        assert reply.WhichOneof("result") == "error", reply
        assert reply.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "empty" in reply.error.message, reply.error.message
    svc.check_integrity()
    by.assert_unchanged()


def test_the_client_refuses_every_empty_call_before_sending() -> None:
    """Every form of the per-layer call, empty, raises InvalidArgumentError (the class
    of the server's INVALID_ARGUMENT) from the client itself: its server's port has no
    listener, so a call that was sent would end UNAVAILABLE instead."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    q, kv = rand(0, 1, HQ, D), rand(0, 1, HKV, D)
    with KVCacheClient(f"127.0.0.1:{port}", timeout_s=20, max_attempts=1) as nowhere:
        for call, needle in (
            (lambda: nowhere.attend(0, []), "items is empty: attend needs at least one item"),
            (lambda: nowhere.append_attend(0, []), "items is empty: append_attend needs"),
            (lambda: nowhere.attend_batch(0, [], q), "seq_ids is empty: attend_batch needs"),
            (
                lambda: nowhere.append_attend_batch(0, [], [], kv, kv, q),
                "seq_ids is empty: append_attend_batch needs at least one sequence",
            ),
        ):
            with pytest.raises(InvalidArgumentError) as info:
                call()
            assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
            assert needle in info.value.message, info.value.message
            assert "nothing was sent" in info.value.message
