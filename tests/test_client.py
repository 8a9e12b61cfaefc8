"""The Python client's own logic against a scripted server: which calls are retried,
deadlines, error classes, sequence handles, export blobs, the bearer token."""

from __future__ import annotations

import time
from concurrent import futures
from typing import Any

import grpc
import pytest
import torch

from cache_service._proto.kvcache.v1 import kvcache_pb2 as pb
from cache_service._proto.kvcache.v1 import kvcache_pb2_grpc as pb_grpc
from cache_service.client import (
    AppendAttendItem,
    DataLossError,
    DeadlineExceededError,
    ExportedBlocks,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    KVCacheClient,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)
from cache_service.wire.tensor_codec import tensor_to_proto

LAYOUT = pb.KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, block_size=4,
                     kv_dtype=pb.DTYPE_FLOAT32, fingerprint="f", bytes_per_block=256)  # fmt: skip


class Scripted(pb_grpc.KVCacheServicer):
    """Answers from a script: per method, a list of status codes to fail with first."""

    def __init__(self) -> None:
        self.fail: dict[str, list[grpc.StatusCode]] = {}
        self.calls: dict[str, int] = {}
        self.metadata: list[Any] = []
        self.freed: list[str] = []
        self.request_ids: dict[str, list[str]] = {}
        self.delay_s = 0.0

    def _enter(self, name: str, context: grpc.ServicerContext) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        self.metadata.append(dict(context.invocation_metadata()))
        if self.delay_s:
            time.sleep(self.delay_s)
        script = self.fail.get(name)
        if script:
            context.abort(script.pop(0), f"scripted failure of {name}")

    def GetInfo(self, request, context):
        self._enter("GetInfo", context)
        return pb.GetInfoResponse(layout=LAYOUT, total_blocks=8, capacity_tokens=32)

    def Lookup(self, request, context):
        self._enter("Lookup", context)
        return pb.LookupResponse(num_cached_tokens=len(request.token_ids) // 4 * 4)

    def CreateSequence(self, request, context):
        self.request_ids.setdefault("CreateSequence", []).append(request.request_id)
        self._enter("CreateSequence", context)
        return pb.CreateSequenceResponse(seq_id="s1", num_cached_tokens=0)

    def FreeSequence(self, request, context):
        self._enter("FreeSequence", context)
        self.freed.append(request.seq_id)
        return pb.FreeSequenceResponse()

    def AppendAttend(self, request, context):
        self._enter("AppendAttend", context)
        self.last_request = request
        results = [pb.AttendResult(output=it.query) for it in request.items]
        return pb.AppendAttendResponse(results=results)


@pytest.fixture
def server():
    servicer = Scripted()
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_KVCacheServicer_to_server(servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    yield servicer, f"127.0.0.1:{port}"
    srv.stop(0)


def test_reads_are_retried_on_unavailable(server) -> None:
    servicer, address = server
    servicer.fail["GetInfo"] = [grpc.StatusCode.UNAVAILABLE] * 2
    servicer.fail["Lookup"] = [grpc.StatusCode.UNAVAILABLE]
    with KVCacheClient(address, max_attempts=4) as client:
        info = client.info()
        assert info.layout.num_layers == 2 and info.capacity_tokens == 32
        assert client.lookup(list(range(9))) == 8
    assert servicer.calls == {"GetInfo": 3, "Lookup": 2}


def test_retries_stop_after_max_attempts(server) -> None:
    servicer, address = server
    servicer.fail["GetInfo"] = [grpc.StatusCode.UNAVAILABLE] * 5
    with KVCacheClient(address, max_attempts=3) as client, pytest.raises(UnavailableError):
        client.info()
    assert servicer.calls["GetInfo"] == 3


def test_writes_are_never_retried_and_creates_only_with_their_request_id(server) -> None:
    servicer, address = server
    servicer.fail["CreateSequence"] = [grpc.StatusCode.UNAVAILABLE]
    servicer.fail["AppendAttend"] = [grpc.StatusCode.UNAVAILABLE]
    with KVCacheClient(address) as client:
        # A create is idempotent by its request id: retried with the same one.
        assert client.create_sequence([1, 2]).seq_id == "s1"
        ids = servicer.request_ids["CreateSequence"]
        assert len(ids) == 2 and ids[0] == ids[1] and ids[0]
        t = torch.ones(1, 1, 4)
        with pytest.raises(UnavailableError):
            client.append_attend(0, [AppendAttendItem("s1", [1], t, t, t)])
    assert servicer.calls == {"CreateSequence": 2, "AppendAttend": 1}


def test_reads_are_not_retried_on_other_statuses(server) -> None:
    servicer, address = server
    servicer.fail["Lookup"] = [grpc.StatusCode.INVALID_ARGUMENT]
    with KVCacheClient(address) as client, pytest.raises(InvalidArgumentError):
        client.lookup([1])
    assert servicer.calls == {"Lookup": 1}


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (grpc.StatusCode.NOT_FOUND, NotFoundError),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, ResourceExhaustedError),
        (grpc.StatusCode.FAILED_PRECONDITION, FailedPreconditionError),
        (grpc.StatusCode.DATA_LOSS, DataLossError),
        (grpc.StatusCode.INTERNAL, InternalError),
    ],
)
def test_statuses_become_error_classes_with_code_and_message(server, code, cls) -> None:
    servicer, address = server
    servicer.fail["CreateSequence"] = [code]
    with KVCacheClient(address) as client, pytest.raises(cls) as info:
        client.create_sequence()
    assert info.value.code == code
    assert info.value.message == "scripted failure of CreateSequence"


def test_every_call_has_a_deadline(server) -> None:
    servicer, address = server
    servicer.delay_s = 1.0
    with KVCacheClient(address, timeout_s=0.2) as client, pytest.raises(DeadlineExceededError):
        client.lookup([1, 2])
    assert servicer.calls == {"Lookup": 1}


def test_sequence_handles_free_on_exit_once(server) -> None:
    servicer, address = server
    with KVCacheClient(address) as client:
        with client.create_sequence() as seq:
            assert seq.seq_id == "s1"
        assert servicer.freed == ["s1"]
        seq.free()  # idempotent on the handle
        assert servicer.freed == ["s1"]
        servicer.fail["FreeSequence"] = [grpc.StatusCode.NOT_FOUND]
        with client.create_sequence():
            pass  # already gone server-side: exiting is still clean


def test_the_token_travels_as_bearer_metadata(server) -> None:
    servicer, address = server
    with KVCacheClient(address, token="t0ken-0123456789abcdef") as client:
        client.info()
    assert servicer.metadata[-1]["authorization"] == "Bearer t0ken-0123456789abcdef"


def test_unreachable_server_is_unavailable_within_the_deadline() -> None:
    t0 = time.monotonic()
    with KVCacheClient("127.0.0.1:1", timeout_s=2, max_attempts=2) as client:
        with pytest.raises(UnavailableError):
            client.info()
    assert time.monotonic() - t0 < 10  # bounded by the deadline, not hung


def test_export_blobs_round_trip_and_refuse_truncation() -> None:
    header = pb.ExportHeader(layout=LAYOUT, token_ids=[1, 2, 3], num_tokens=3,
                             block_shape=[1, 2, 2, 1, 4, 4], total_bytes=256)  # fmt: skip
    data = tensor_to_proto(torch.arange(64, dtype=torch.float32)).data
    blob = ExportedBlocks(header, data).to_bytes()
    back = ExportedBlocks.from_bytes(blob)
    assert back.token_ids == [1, 2, 3] and back.data == data
    assert back.blocks().shape == (1, 2, 2, 1, 4, 4)
    with pytest.raises(ValueError, match="data bytes"):
        ExportedBlocks.from_bytes(blob[:-1])
    with pytest.raises(ValueError):
        ExportedBlocks.from_bytes(b"\x01")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_append_attend_sends_each_tensor_as_is_and_decodes_writable_outputs(server, dtype) -> None:
    """The request carries exactly each item's tensors (rows of one batch tensor, encoded
    in one copy, or separate ones); the echoed outputs come back bit for bit, each its own
    writable tensor (views of one reply buffer, not of the immutable message bytes)."""
    servicer, address = server
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(3, 1, 1, 4, generator=gen).to(dtype)
    q = torch.randn(3, 2, 2, 4, generator=gen).to(dtype)
    batched = [AppendAttendItem(f"s{i}", [i], k[i], k[i], q[i]) for i in range(3)]
    separate = [
        AppendAttendItem(
            f"s{i}", [i], k[i].clone(), k[i] * 2, q[i].transpose(0, 1).contiguous().transpose(0, 1)
        )
        for i in range(3)
    ]
    with KVCacheClient(address) as client:
        for items in (batched, separate):
            outs = client.append_attend(1, items)
            sent = servicer.last_request
            assert sent.layer == 1 and [it.seq_id for it in sent.items] == ["s0", "s1", "s2"]
            for it, wire in zip(items, sent.items, strict=True):
                assert list(wire.token_ids) == list(it.token_ids)
                assert wire.key == tensor_to_proto(it.key)
                assert wire.value == tensor_to_proto(it.value)
                assert wire.query == tensor_to_proto(it.query)
            for out, it in zip(outs, items, strict=True):
                assert out.dtype == dtype and torch.equal(out, it.query)
            outs[0].fill_(7)  # writable, and its neighbours are not touched
            assert torch.equal(outs[1], items[1].query)
