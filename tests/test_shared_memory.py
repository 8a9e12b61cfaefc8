"""The shared-memory path of the batch calls: a real server on a loopback port, in-process
CPU pools, the client mapping the server's /dev/shm region.

Outputs through shared memory equal the bytes path's and dense attention; the client falls
back to bytes where it cannot map the region or the server turned it off; bad slices are
refused before anything changes (and the output range stays untouched); regions are
private to their tenant, limited, released, reaped when idle and deleted at stop; the
metrics gauges follow them. The registry's pure logic has unit tests at the end.
"""

from __future__ import annotations

import asyncio
import json
import mmap
import os
import re
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from service_support import (
    HQ,
    LAYOUT,
    Mirror,
    ServiceHarness,
    decode_with_twins,
    local_workers,
    service_config,
)

from cache_service._proto.kvcache.v1 import kvcache_pb2 as pb
from cache_service._proto.kvcache.v1 import kvcache_pb2_grpc as pb_grpc
from cache_service.client import (
    FailedPreconditionError,
    InvalidArgumentError,
    KVCacheClient,
    SharedMemoryUnavailable,
)
from cache_service.client import shared_memory as client_shared_memory
from cache_service.config import ConfigError, SharedMemoryConfig
from cache_service.errors import (
    InvalidRequest,
    SharedMemoryDisabled,
    SharedMemoryLimit,
    SharedRegionNotFound,
)
from cache_service.wire.format import shared_slice
from cache_service.wire.request_codec import SharedTensor, encode_append_attend_batch
from cache_service.wire.shared_regions import SharedRegions, default_directory
from cache_service.wire.tensor_codec import tensor_from_proto, tensor_to_proto

pytestmark = pytest.mark.timeout(120)

D, HKV, NL = LAYOUT.head_dim, LAYOUT.num_kv_heads, LAYOUT.num_layers
SERVICE = "kvcache.v1.KVCache"


@pytest.fixture(scope="module")
def svc():
    with ServiceHarness(service_config(), local_workers(2, 64)) as harness:
        yield harness


def _regions(harness: ServiceHarness) -> SharedRegions:
    regions = harness.service.shared_regions
    assert regions is not None
    return regions


def _gauge(harness: ServiceHarness, name: str) -> float | None:
    return harness.service.metrics.registry.get_sample_value(name)


def _rpc_count(harness: ServiceHarness, method: str) -> float:
    total = 0.0
    for family in harness.service.metrics.registry.collect():
        for sample in family.samples:
            if sample.name == "kvcache_rpc_requests_total" and sample.labels["method"] == method:
                total += sample.value
    return total


def _region_files(harness: ServiceHarness) -> set[str]:
    return {r.path for r in _regions(harness)._regions.values()}


# ------------------------------------------------------------------------- equality


def test_shared_memory_equals_the_bytes_path_and_dense_attention(svc) -> None:
    gen = torch.Generator().manual_seed(11)
    with (
        KVCacheClient(svc.address) as shm,
        KVCacheClient(svc.address, shared_memory=False) as plain,
    ):
        mirrors = [Mirror(shm.create_sequence().seq_id, NL) for _ in range(4)]
        twins = [plain.create_sequence().seq_id for _ in range(4)]
        ids = [m.seq_id for m in mirrors]
        for step in range(5):  # a short prefill, then decode across a block boundary
            n = 3 if step == 0 else 1
            m_rows = 2 if step == 2 else 1
            tokens = torch.randint(0, 50000, (4, n), generator=gen)
            for layer in range(NL):
                k = torch.randn(4, n, HKV, D, generator=gen)
                v = torch.randn(4, n, HKV, D, generator=gen)
                q = torch.randn(4, m_rows, HQ, D, generator=gen)
                with_lse = (step + layer) % 2 == 0
                got = shm.append_attend_batch(layer, ids, tokens, k, v, q, with_lse)
                want = plain.append_attend_batch(layer, twins, tokens, k, v, q, with_lse)
                assert shm.shared_memory_active
                out, lse = got if with_lse else (got, None)
                want_out, want_lse = want if with_lse else (want, None)
                assert torch.equal(out, want_out)
                assert out.shape == (4, m_rows, HQ, D) and out.dtype == torch.float32
                if with_lse:
                    assert torch.equal(lse, want_lse) and lse.shape == (4, m_rows, HQ)
                for i, m in enumerate(mirrors):
                    m.add(layer, k[i], v[i])
                    ref, ref_lse = m.reference(layer, q[i])
                    assert torch.allclose(out[i].double(), ref, atol=1e-5)
                    if with_lse:
                        assert torch.allclose(lse[i].double(), ref_lse, atol=1e-4)
        # attend_batch: float32 and float16 queries, with and without lse.
        for dtype, atol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
            q = torch.randn(4, 2, HQ, D, generator=gen).to(dtype)
            for with_lse in (False, True):
                got = shm.attend_batch(NL - 1, ids, q, with_lse)
                want = plain.attend_batch(NL - 1, twins, q, with_lse)
                out = got[0] if with_lse else got
                assert torch.equal(out, want[0] if with_lse else want)
                assert out.dtype == dtype
                if with_lse:
                    assert torch.equal(got[1], want[1])
                for i, m in enumerate(mirrors):
                    ref, _ = m.reference(NL - 1, q[i].float())
                    assert torch.allclose(out[i].double(), ref, atol=atol)
        for s in ids:
            shm.free(s)
        for s in twins:
            plain.free(s)
    svc.check_integrity()


def test_outputs_are_fresh_tensors_and_a_busy_region_sends_bytes(svc) -> None:
    gen = torch.Generator().manual_seed(12)
    with KVCacheClient(svc.address) as client:
        ids = [client.create_sequence().seq_id for _ in range(2)]
        k = torch.randn(2, 1, HKV, D, generator=gen)
        first = client.append_attend_batch(0, ids, [[1], [2]], k, k, torch.ones(2, 1, HQ, D))
        kept = first.clone()
        # The next call rewrites the region: the first output is not a view of it.
        client.attend_batch(0, ids, -torch.ones(2, 1, HQ, D))
        assert torch.equal(first, kept)
        # Another thread's call holds the region: this one sends bytes, same answer.
        shm = client._shm
        assert shm is not None
        assert shm._lock.acquire(blocking=False)
        try:
            before = _rpc_count(svc, "CreateSharedRegion")
            again = client.attend_batch(0, ids, torch.ones(2, 1, HQ, D))
            assert _rpc_count(svc, "CreateSharedRegion") == before
        finally:
            shm._lock.release()
        assert torch.equal(again, kept)
        for s in ids:
            client.free(s)


def test_concurrent_threads_share_one_client(svc) -> None:
    with KVCacheClient(svc.address) as client:
        seqs = [[client.create_sequence().seq_id for _ in range(2)] for _ in range(4)]
        k = torch.randn(2, 1, HKV, D)
        for ids in seqs:
            client.append_attend_batch(0, ids, [[1], [2]], k, k, torch.ones(2, 1, HQ, D))
        errors: list[BaseException] = []

        def work(ids: list[str], sign: float) -> None:
            try:
                for _ in range(20):
                    q = sign * torch.ones(2, 1, HQ, D)
                    out = client.attend_batch(0, ids, q)
                    # One key per sequence: the output is its value row, whatever q is.
                    assert torch.allclose(out[:, 0, ::2], k[:, 0], atol=1e-6)
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(ids, i + 1.0)) for i, ids in enumerate(seqs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        for ids in seqs:
            for s in ids:
                client.free(s)


def test_a_larger_call_replaces_the_region(svc, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_shared_memory, "_MIN_REGION", 1024)
    with KVCacheClient(svc.address) as client:
        ids = [client.create_sequence().seq_id for _ in range(2)]
        k = torch.randn(2, 1, HKV, D)
        client.append_attend_batch(0, ids, [[1], [2]], k, k, torch.ones(2, 1, HQ, D))
        shm = client._shm
        assert shm is not None and shm._region is not None
        small, small_size = shm._region.region_id, shm._region.size
        assert small_size == 2048  # 1536 bytes of tensors, in a power of two from 1024
        k3 = torch.randn(2, 3, HKV, D)
        q = torch.randn(2, 4, HQ, D)
        out = client.append_attend_batch(0, ids, [[3, 4, 5], [6, 7, 8]], k3, k3, q)
        assert shm._region.region_id != small and shm._region.size > small_size
        # The old region was released: one region for this client on the server.
        assert small not in _regions(svc)._regions
        for i in range(2):
            from workers_support import dense_attention

            ref, _ = dense_attention(q[i], torch.cat([k[i], k3[i]]), torch.cat([k[i], k3[i]]))
            assert torch.allclose(out[i].double(), ref, atol=1e-5)
        # The first kind of call again: its kept layout moves to the new region.
        q1 = torch.randn(2, 1, HQ, D)
        out1 = client.append_attend_batch(1, ids, [[1], [2]], k, k, q1)
        assert shm._region.region_id != small and shm.active
        assert all(lay.region is shm._region for lay in shm._layouts.values() if lay.region)
        for i in range(2):
            ref, _ = dense_attention(q1[i], k[i], k[i])
            assert torch.allclose(out1[i].double(), ref, atol=1e-5)
        for s in ids:
            client.free(s)


def test_a_forgotten_region_drops_the_kept_layouts(svc) -> None:
    with KVCacheClient(svc.address) as client:
        ids = [client.create_sequence().seq_id]
        k = torch.randn(1, 1, HKV, D)
        client.append_attend_batch(0, ids, [[1]], k, k, torch.randn(1, 1, HQ, D))
        shm = client._shm
        assert shm is not None and shm._layouts
        old = shm._region
        # What the client does when the server answers NOT_FOUND for the region.
        assert shm._lock.acquire(blocking=False)
        shm.forget()
        shm._lock.release()
        assert not shm._layouts and old is not None and not old._views
        assert old._mm.closed  # no kept view holds the mapping
        q = torch.randn(1, 1, HQ, D)
        out = client.append_attend_batch(1, ids, [[1]], k, k, q)  # a new region
        assert shm._region is not old and shm.active
        from workers_support import dense_attention

        ref, _ = dense_attention(q[0], k[0], k[0])
        assert torch.allclose(out[0].double(), ref, atol=1e-5)
        client.free(ids[0])


# ------------------------------------------------------------------------- fallbacks


def _cannot_open(*args: Any, **kwargs: Any) -> Any:
    raise FileNotFoundError(2, "No such file or directory (another host)")


def test_the_client_falls_back_when_it_cannot_map_the_region(
    svc, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client_shared_memory, "_Mapped", _cannot_open)
    regions = _regions(svc)
    held = regions.num_regions
    with KVCacheClient(svc.address) as client:
        ids = [client.create_sequence().seq_id for _ in range(2)]
        k = torch.randn(2, 1, HKV, D)
        before = _rpc_count(svc, "CreateSharedRegion")
        for _ in range(3):
            out = client.append_attend_batch(0, ids, [[1], [2]], k, -k, torch.ones(2, 1, HQ, D))
            assert torch.allclose(out[:, 0, ::2], -k[:, 0], atol=1e-6)
        # Asked once, released what it could not map, bytes for good.
        assert _rpc_count(svc, "CreateSharedRegion") == before + 1
        assert not client.shared_memory_active
        assert client._shm is not None and "cannot map" in client._shm.unusable_reason
        assert regions.num_regions == held
        for s in ids:
            client.free(s)
    with KVCacheClient(svc.address, shared_memory=True) as strict:
        with pytest.raises(SharedMemoryUnavailable, match="cannot map"):
            strict.attend_batch(0, ["whatever"], torch.ones(1, 1, HQ, D))
    assert regions.num_regions == held


def test_disabled_by_config_the_client_sends_bytes() -> None:
    config = service_config(**{"shared_memory.enabled": False})
    with ServiceHarness(config, local_workers(1, 32)) as harness:
        assert harness.service.shared_regions is not None
        assert not harness.service.shared_regions.enabled
        with KVCacheClient(harness.address) as client:
            ids = [client.create_sequence().seq_id]
            k = torch.randn(1, 1, HKV, D)
            out = client.append_attend_batch(0, ids, [[1]], k, k, torch.ones(1, 1, HQ, D))
            assert torch.allclose(out[:, 0, ::2], k[:, 0], atol=1e-6)
            client.attend_batch(0, ids, torch.ones(1, 1, HQ, D))
            assert not client.shared_memory_active
            assert _rpc_count(harness, "CreateSharedRegion") == 1  # asked once only
            with pytest.raises(FailedPreconditionError, match=r"shared_memory\.enabled"):
                client._create_region(1024, None)
        with KVCacheClient(harness.address, shared_memory=True) as strict:
            with pytest.raises(SharedMemoryUnavailable, match="does not offer"):
                strict.attend_batch(0, ids, torch.ones(1, 1, HQ, D))
        with KVCacheClient(harness.address, shared_memory=False) as never:
            never.attend_batch(0, ids, torch.ones(1, 1, HQ, D))
            assert _rpc_count(harness, "CreateSharedRegion") == 3  # not asked by this one


def test_bad_shared_memory_argument_is_refused() -> None:
    with pytest.raises(ValueError, match="shared_memory must be"):
        KVCacheClient("127.0.0.1:1", shared_memory="yes")


# ------------------------------------------------------------------------- refusals


class _RawRegion:
    """A region made through the raw stub and mapped by the test."""

    def __init__(self, stub: Any, size: int, metadata: tuple = ()) -> None:
        reply = stub.CreateSharedRegion(
            pb.CreateSharedRegionRequest(size_bytes=size), timeout=10, metadata=metadata
        )
        self.region_id = reply.region_id
        self.path = reply.path
        self.size = reply.size_bytes
        with open(reply.path, "r+b") as f:
            self.mm = mmap.mmap(f.fileno(), self.size)

    def put(self, offset: int, t: torch.Tensor) -> pb.Tensor:
        raw = t.contiguous().view(torch.uint8).numpy().tobytes()
        self.mm[offset : offset + len(raw)] = raw
        return self.ref(t, offset)

    def ref(self, t: torch.Tensor, offset: int) -> pb.Tensor:
        return pb.Tensor(
            dtype=tensor_to_proto(t[:0]).dtype,
            shape=list(t.shape),
            shared=pb.SharedSlice(region_id=self.region_id, offset=offset),
        )

    def read(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        n = torch.empty(shape, dtype=dtype).numel() * dtype.itemsize
        return torch.frombuffer(bytearray(self.mm[offset : offset + n]), dtype=dtype).view(shape)

    def close(self) -> None:
        self.mm.close()


def _status(fn: Any, request: Any, **kw: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        fn(request, timeout=10, **kw)
    return info.value.code(), info.value.details()


def test_bad_slices_are_refused_before_anything_changes(svc) -> None:
    gen = torch.Generator().manual_seed(13)
    k = torch.randn(2, 1, HKV, D, generator=gen)
    q = torch.randn(2, 1, HQ, D, generator=gen)
    with KVCacheClient(svc.address) as client, grpc.insecure_channel(svc.address) as channel:
        stub = pb_grpc.KVCacheStub(channel)
        seqs = [client.create_sequence().seq_id for _ in range(2)]
        region = _RawRegion(stub, 8192)
        try:
            key, value, query = region.put(0, k), region.put(1024, -k), region.put(2048, q)
            out_at, lse_at = 4096, 6144
            sentinel = b"\xab" * (region.size - out_at)
            region.mm[out_at:] = sentinel

            def request(**fields: Any) -> pb.AppendAttendBatchRequest:
                base: dict[str, Any] = {
                    "layer": 0,
                    "seq_ids": seqs,
                    "token_ids": [1, 2],
                    "key": key,
                    "value": value,
                    "query": query,
                    "return_lse": True,
                    "output_to": pb.SharedSlice(region_id=region.region_id, offset=out_at),
                    "lse_to": pb.SharedSlice(region_id=region.region_id, offset=lse_at),
                }
                base.update(fields)
                return pb.AppendAttendBatchRequest(**base)

            def at(offset: int) -> pb.SharedSlice:
                return pb.SharedSlice(region_id=region.region_id, offset=offset)

            before = svc.stats()
            near_end = region.size - 64  # k needs 256 bytes
            cases = [
                (request(key=region.ref(k, near_end)), r"key\.shared: 256 bytes at offset"),
                (request(key=region.ref(k, 2)), r"key\.shared\.offset 2 is not a multiple"),
                (request(query=region.ref(q, 2**64 - 4)), r"query\.shared: .* do not fit"),
                (request(output_to=at(near_end)), r"output_to: 512 bytes at offset"),
                (request(output_to=at(4098)), r"output_to\.offset 4098 is not a multiple"),
                (request(lse_to=at(2**64 - 4)), "lse_to: 32 bytes at offset"),
                (request(lse_to=at(out_at + 256)), "output_to .* and lse_to .* overlap"),
                (request(return_lse=False), "lse_to is set but return_lse is false"),
                # The bytes path's checks, named alike, for a tensor in shared memory.
                (request(key=region.ref(k[:, :, :1], 0)), "key: dimension 2 is 1"),
                (request(token_ids=[1, 2, 3]), "token_ids holds 3 ids"),
            ]
            for req, message in cases:
                code, details = _status(stub.AppendAttendBatch, req)
                assert code == grpc.StatusCode.INVALID_ARGUMENT, (message, details)
                assert re.search(message, details), (message, details)
            # Refusals from the coordinator (after the ranges were checked) write nothing
            # either: an unknown sequence, attending a layer not written yet.
            code, _ = _status(stub.AppendAttendBatch, request(seq_ids=[seqs[0], "nope"]))
            assert code == grpc.StatusCode.NOT_FOUND
            attend = pb.AttendBatchRequest(layer=1, seq_ids=seqs, query=query, output_to=at(out_at))
            code, _ = _status(stub.AttendBatch, attend)
            assert code == grpc.StatusCode.FAILED_PRECONDITION
            # A shared payload where only bytes are accepted.
            item = pb.AppendAttendItem(
                seq_id=seqs[0], token_ids=[1], key=region.ref(k[0], 0), value=key, query=query
            )
            code, details = _status(
                stub.AppendAttend, pb.AppendAttendRequest(layer=0, items=[item])
            )
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            assert "items[0].key: a shared-memory payload is accepted only by the batch" in details
            assert svc.stats() == before
            svc.check_integrity()
            assert region.mm[out_at:] == sentinel  # the output range is untouched
            # The valid call: outputs land in the region, the reply points at them.
            reply = stub.AppendAttendBatch(request(), timeout=10)
            assert reply.output.WhichOneof("payload") == "shared"
            assert reply.output.shared.region_id == region.region_id
            assert reply.output.shared.offset == out_at and list(reply.output.shape) == [
                2,
                1,
                HQ,
                D,
            ]
            assert reply.lse.shared.offset == lse_at and list(reply.lse.shape) == [2, 1, HQ]
            out = region.read(out_at, torch.float32, (2, 1, HQ, D))
            lse = region.read(lse_at, torch.float32, (2, 1, HQ))
            from workers_support import dense_attention

            for i in range(2):  # nothing was written before: each sequence's only token
                ref, ref_lse = dense_attention(q[i], k[i], -k[i])
                assert torch.allclose(out[i].double(), ref, atol=1e-5)
                assert torch.allclose(lse[i].double(), ref_lse, atol=1e-4)
            # Only the output gets shared: the lse comes back as bytes.
            only_out = request(token_ids=[3, 4], lse_to=None)
            only_out.ClearField("lse_to")
            reply = stub.AppendAttendBatch(only_out, timeout=10)
            assert reply.output.WhichOneof("payload") == "shared"
            assert tensor_from_proto(reply.lse, "lse").shape == (2, 1, HQ)
        finally:
            region.close()
            stub.ReleaseSharedRegion(pb.ReleaseSharedRegionRequest(region_id=region.region_id))
        for s in seqs:
            client.free(s)
    svc.check_integrity()


def test_the_hand_written_request_parses_to_the_protobuf_message() -> None:
    k = torch.randn(2, 1, HKV, D)
    shared = SharedTensor(torch.float32, (2, 1, HKV, D), "r1", 64)
    raw = encode_append_attend_batch(
        3, ["a", "b"], [[1], [2]], shared, k, shared, True, output_to=("r1", 0), lse_to=("r2", 8)
    )
    msg = pb.AppendAttendBatchRequest.FromString(raw)
    assert msg.key.shared.region_id == "r1" and msg.key.shared.offset == 64
    assert list(msg.key.shape) == [2, 1, HKV, D] and msg.key.dtype == pb.DTYPE_FLOAT32
    assert msg.value.WhichOneof("payload") == "data"
    assert msg.HasField("output_to") and msg.output_to.region_id == "r1"
    assert msg.lse_to.offset == 8
    assert raw == msg.SerializeToString()  # field order and defaults as protobuf writes them
    assert shared_slice("r", 0) == pb.SharedSlice(region_id="r").SerializeToString()


# ------------------------------------------------------------------------- tenants

TOKEN_A = "token-of-acme-0123456789"
TOKEN_B = "token-of-globex-abcdefgh"


@pytest.fixture(scope="module")
def tenants(tmp_path_factory: pytest.TempPathFactory):
    tokens = tmp_path_factory.mktemp("auth") / "tokens.json"
    tokens.write_text(json.dumps({"tokens": {TOKEN_A: "acme", TOKEN_B: "globex"}}))
    with ServiceHarness(service_config(auth_file=str(tokens)), local_workers(1, 32)) as h:
        yield h


def _bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def test_another_tenants_region_is_not_found_like_an_unknown_one(tenants) -> None:
    with (
        grpc.insecure_channel(tenants.address) as channel,
        KVCacheClient(tenants.address, token=TOKEN_B) as b,
    ):
        stub = pb_grpc.KVCacheStub(channel)
        region = _RawRegion(stub, 4096, _bearer(TOKEN_A))
        try:
            seq = b.create_sequence().seq_id
            q = torch.ones(1, 1, HQ, D)
            unknown = "0" * len(region.region_id)

            def attend(region_id: str, output: bool) -> tuple[grpc.StatusCode, str]:
                ref = pb.Tensor(
                    dtype=pb.DTYPE_FLOAT32,
                    shape=[1, 1, HQ, D],
                    shared=pb.SharedSlice(region_id=region_id),
                )
                req = pb.AttendBatchRequest(layer=0, seq_ids=[seq], query=ref)
                if output:
                    req.query.CopyFrom(tensor_to_proto(q))
                    req.output_to.region_id = region_id
                return _status(stub.AttendBatch, req, metadata=_bearer(TOKEN_B))

            for output in (False, True):
                theirs = attend(region.region_id, output)
                nobody = attend(unknown, output)
                assert theirs[0] == nobody[0] == grpc.StatusCode.NOT_FOUND
                assert theirs[1] == nobody[1].replace(unknown, region.region_id)
            release = pb.ReleaseSharedRegionRequest(region_id=region.region_id)
            theirs = _status(stub.ReleaseSharedRegion, release, metadata=_bearer(TOKEN_B))
            nobody = _status(
                stub.ReleaseSharedRegion,
                pb.ReleaseSharedRegionRequest(region_id=unknown),
                metadata=_bearer(TOKEN_B),
            )
            assert theirs[0] == nobody[0] == grpc.StatusCode.NOT_FOUND
            assert theirs[1] == nobody[1].replace(unknown, region.region_id)
            assert os.path.exists(region.path)  # B's attempts did nothing to A's region
            b.free(seq)
        finally:
            region.close()
            stub.ReleaseSharedRegion(
                pb.ReleaseSharedRegionRequest(region_id=region.region_id),
                metadata=_bearer(TOKEN_A),
            )
        assert not os.path.exists(region.path)


def test_each_tenants_client_uses_its_own_region(tenants) -> None:
    with (
        KVCacheClient(tenants.address, token=TOKEN_A) as a,
        KVCacheClient(tenants.address, token=TOKEN_B) as b,
    ):
        for client in (a, b):
            seq = client.create_sequence().seq_id
            k = torch.randn(1, 1, HKV, D)
            out = client.append_attend_batch(0, [seq], [[1]], k, k, torch.ones(1, 1, HQ, D))
            assert client.shared_memory_active
            assert torch.allclose(out[:, 0, ::2], k[:, 0], atol=1e-6)
            client.free(seq)
        owners = sorted(r.tenant for r in _regions(tenants)._regions.values())
        assert owners == ["acme", "globex"]
    assert _regions(tenants).num_regions == 0  # close released both


# ------------------------------------------------------------------------- lifecycle


def test_limits_are_resource_exhausted_naming_the_limit() -> None:
    config = service_config(
        **{
            "shared_memory.max_region_bytes": 8192,
            "shared_memory.max_regions_per_tenant": 2,
            "shared_memory.max_total_bytes": 12288,
        }
    )
    with (
        ServiceHarness(config, local_workers(1, 32)) as harness,
        grpc.insecure_channel(harness.address) as channel,
    ):
        stub = pb_grpc.KVCacheStub(channel)

        def create(size: int) -> Any:
            return stub.CreateSharedRegion(pb.CreateSharedRegionRequest(size_bytes=size))

        code, details = _status(
            stub.CreateSharedRegion, pb.CreateSharedRegionRequest(size_bytes=8193)
        )
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "shared_memory.max_region_bytes (8192)" in details
        code, details = _status(stub.CreateSharedRegion, pb.CreateSharedRegionRequest())
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "size_bytes must be >= 1" in details
        first = create(8192)
        code, details = _status(
            stub.CreateSharedRegion, pb.CreateSharedRegionRequest(size_bytes=8192)
        )
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "shared_memory.max_total_bytes (12288" in details
        create(4096)
        code, details = _status(stub.CreateSharedRegion, pb.CreateSharedRegionRequest(size_bytes=1))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "shared_memory.max_regions_per_tenant (2)" in details
        stub.ReleaseSharedRegion(pb.ReleaseSharedRegionRequest(region_id=first.region_id))
        create(1)  # room again
        # A client whose calls need more than the limit sends bytes, asking once.
        with KVCacheClient(harness.address) as client:
            seq = client.create_sequence().seq_id
            k = torch.randn(1, 1, HKV, D)
            for _ in range(2):
                client.append_attend_batch(0, [seq], [[1]], k, k, torch.ones(1, 1, HQ, D))
                client.attend_batch(0, [seq], torch.ones(1, 1, HQ, D))
            assert not client.shared_memory_active
            assert (
                harness.service.metrics.registry.get_sample_value(
                    "kvcache_rpc_requests_total",
                    {
                        "service": SERVICE,
                        "method": "CreateSharedRegion",
                        "code": "RESOURCE_EXHAUSTED",
                    },
                )
                == 5
            )  # three above, then the client's power of two and its exact size


def test_release_reap_and_stop_delete_the_files(monkeypatch: pytest.MonkeyPatch) -> None:
    config = service_config(**{"shared_memory.idle_timeout_s": 0.4})
    harness = ServiceHarness(config, local_workers(1, 32))
    try:
        regions = _regions(harness)
        assert _gauge(harness, "kvcache_shared_memory_regions") == 0
        with grpc.insecure_channel(harness.address) as channel:
            stub = pb_grpc.KVCacheStub(channel)
            made = stub.CreateSharedRegion(pb.CreateSharedRegionRequest(size_bytes=5000))
            assert made.size_bytes == 5000 and os.path.getsize(made.path) == 5000
            assert made.path.startswith(regions.directory)
            assert os.stat(made.path).st_mode & 0o777 == 0o600
            assert made.region_id not in made.path  # the id is not the file name
            assert _gauge(harness, "kvcache_shared_memory_regions") == 1
            assert _gauge(harness, "kvcache_shared_memory_bytes") == 5000
            stub.ReleaseSharedRegion(pb.ReleaseSharedRegionRequest(region_id=made.region_id))
            assert not os.path.exists(made.path)
            assert _gauge(harness, "kvcache_shared_memory_regions") == 0
            assert _gauge(harness, "kvcache_shared_memory_bytes") == 0
            code, _ = _status(
                stub.ReleaseSharedRegion, pb.ReleaseSharedRegionRequest(region_id=made.region_id)
            )
            assert code == grpc.StatusCode.NOT_FOUND
        with KVCacheClient(harness.address) as client:
            seq = client.create_sequence().seq_id
            k = torch.randn(1, 1, HKV, D)
            client.append_attend_batch(0, [seq], [[1]], k, k, torch.ones(1, 1, HQ, D))
            (path,) = _region_files(harness)
            # Idle past the timeout: the reaper deletes the region...
            for _ in range(100):
                if not os.path.exists(path):
                    break
                threading.Event().wait(0.05)
            assert not os.path.exists(path) and regions.num_regions == 0
            assert _gauge(harness, "kvcache_shared_memory_regions") == 0
            # ...and the client's next call notices (NOT_FOUND), sends bytes, then the
            # call after makes a new region.
            out = client.attend_batch(0, [seq], torch.ones(1, 1, HQ, D))
            assert torch.allclose(out[:, 0, ::2], k[:, 0], atol=1e-6)
            assert not client.shared_memory_active
            client.attend_batch(0, [seq], torch.ones(1, 1, HQ, D))
            assert client.shared_memory_active and regions.num_regions == 1
            client.free(seq)
            # Regions left at stop: a client that never closes, and a raw one.
            with grpc.insecure_channel(harness.address) as channel:
                stub = pb_grpc.KVCacheStub(channel)
                stub.CreateSharedRegion(pb.CreateSharedRegionRequest(size_bytes=100))
            paths = _region_files(harness)
            assert len(paths) == 2 and all(os.path.exists(p) for p in paths)
            harness.stop()
            assert not any(os.path.exists(p) for p in paths)
            assert regions.num_regions == 0
            client._shm = None  # the server is gone: nothing to release on close
    finally:
        if not harness.loop.is_closed():
            harness.stop()


# ------------------------------------------------------------------------- registry units


def _registry(tmp_path: Path, **limits: Any) -> SharedRegions:
    return SharedRegions(SharedMemoryConfig(**limits), directory=str(tmp_path))


def _create(regions: SharedRegions, tenant: str, size: int) -> Any:
    return asyncio.run(regions.create(tenant, size))


def test_registry_bounds_alignment_and_copy_in(tmp_path: Path) -> None:
    regions = _registry(tmp_path)
    info = _create(regions, "t", 1024)
    with open(info.path, "r+b") as f, mmap.mmap(f.fileno(), 1024) as mm:
        mm[1000:1024] = bytes(range(24))
        got = regions.read("t", info.region_id, 1000, torch.float16, [12], "key")
        assert got.view(torch.uint8).tolist() == list(range(24))  # the last byte is in
        mm[1000:1024] = b"\0" * 24
        assert got.view(torch.uint8).tolist() == list(range(24))  # a copy, not a view
    assert regions.read("t", info.region_id, 1024, torch.float32, [0], "key").numel() == 0
    with pytest.raises(InvalidRequest, match=r"key\.shared: 26 bytes at offset 1000"):
        regions.read("t", info.region_id, 1000, torch.float16, [13], "key")
    with pytest.raises(InvalidRequest, match=r"key\.shared\.offset 1002 is not a multiple .*4"):
        regions.read("t", info.region_id, 1002, torch.float32, [1], "key")
    with pytest.raises(InvalidRequest, match="do not fit"):
        regions.read("t", info.region_id, 2**64 - 4, torch.float32, [1], "key")
    with pytest.raises(InvalidRequest, match=r"output_to: 8 bytes at offset 1020"):
        regions.check_writable("t", info.region_id, 1020, torch.float32, [2], "output_to")
    with pytest.raises(SharedRegionNotFound, match=r"key\.shared: shared region 'nope' not found"):
        regions.read("t", "nope", 0, torch.float32, [1], "key")
    with pytest.raises(SharedRegionNotFound, match="not found"):
        regions.read("other", info.region_id, 0, torch.float32, [1], "key")
    regions.close()
    assert not os.listdir(tmp_path)


def test_registry_limits_and_disabled(tmp_path: Path) -> None:
    regions = _registry(
        tmp_path, max_region_bytes=100, max_regions_per_tenant=2, max_total_bytes=250
    )
    with pytest.raises(SharedMemoryLimit, match="max_region_bytes"):
        _create(regions, "a", 101)
    _create(regions, "a", 100)
    _create(regions, "a", 100)
    with pytest.raises(SharedMemoryLimit, match="max_regions_per_tenant"):
        _create(regions, "a", 1)
    with pytest.raises(SharedMemoryLimit, match="max_total_bytes"):
        _create(regions, "b", 51)
    _create(regions, "b", 50)
    assert (regions.num_regions, regions.total_bytes) == (3, 250)
    assert len(os.listdir(tmp_path)) == 3
    regions.close()
    assert not os.listdir(tmp_path) and regions.total_bytes == 0
    off = _registry(tmp_path, enabled=False)
    with pytest.raises(SharedMemoryDisabled, match=r"shared_memory\.enabled: false"):
        _create(off, "a", 1)
    for bad, message in (
        ({"max_region_bytes": 0}, "max_region_bytes must be a positive integer"),
        ({"max_region_bytes": 10, "max_total_bytes": 5}, "at most shared_memory.max_total"),
        ({"idle_timeout_s": 0}, "idle_timeout_s must be > 0"),
        ({"enabled": "yes"}, "enabled must be true or false"),
    ):
        with pytest.raises(ConfigError, match=message):
            SharedMemoryConfig(**bad)


def test_release_under_a_call_in_flight_defers_the_unmap(tmp_path: Path) -> None:
    now = [0.0]
    regions = SharedRegions(
        SharedMemoryConfig(idle_timeout_s=10), directory=str(tmp_path), clock=lambda: now[0]
    )
    changes: list[tuple[int, int]] = []
    regions._on_change = lambda n, b: changes.append((n, b))
    info = _create(regions, "t", 64)
    slot = regions.check_writable("t", info.region_id, 16, torch.float32, [4], "output_to")
    region = regions._regions[info.region_id]
    now[0] = 100.0
    assert regions.reap_idle() == 0  # a call is writing to it
    regions.release("t", info.region_id)
    assert not os.path.exists(info.path) and not region.mm.closed
    slot.write(torch.arange(4.0))  # the call that was in flight still completes
    assert torch.frombuffer(bytearray(region.mm[16:32]), dtype=torch.float32).tolist() == [
        0.0,
        1.0,
        2.0,
        3.0,
    ]
    slot.close()
    assert region.mm.closed
    other = _create(regions, "t", 64)
    now[0] = 105.0
    assert regions.reap_idle() == 0
    now[0] = 110.0
    assert regions.reap_idle() == 1 and not os.path.exists(other.path)
    assert changes == [(1, 64), (0, 0), (1, 64), (0, 0)]


def test_default_directory_falls_back_to_the_temporary_one(monkeypatch) -> None:
    assert default_directory() in ("/dev/shm", __import__("tempfile").gettempdir())
    monkeypatch.setattr(os.path, "isdir", lambda p: False)
    assert default_directory() == __import__("tempfile").gettempdir()


# -- zero-copy reads (servers whose pools are CUDA pools in their process) ------------------


def test_a_zero_copy_reader_gives_views_and_holds_their_region(tmp_path: Path) -> None:
    # On a machine without CUDA the registration is refused (logged) and the views are
    # of pageable memory: the reader's bookkeeping is the same.
    regions = SharedRegions(SharedMemoryConfig(), directory=str(tmp_path), pin_for_cuda=True)
    info = _create(regions, "t", 1024)
    region = regions._regions[info.region_id]
    with open(info.path, "r+b") as f, mmap.mmap(f.fileno(), 1024) as mm:
        mm[1000:1024] = bytes(range(24))
        reader = regions.reader("t")
        view = reader(info.region_id, 1000, torch.float16, [12], "key")
        assert view.view(torch.uint8).tolist() == list(range(24))
        mm[1000:1002] = b"\xff\xff"
        assert view.view(torch.uint8)[:2].tolist() == [255, 255]  # a view, not a copy
        # The same slice read again is the same tensor (views are kept per region).
        assert reader(info.region_id, 1000, torch.float16, [12], "key") is view
        # Bad slices fail as the copying read fails, and hold nothing.
        with pytest.raises(InvalidRequest, match=r"key\.shared: 26 bytes at offset 1000"):
            reader(info.region_id, 1000, torch.float16, [13], "key")
        with pytest.raises(SharedRegionNotFound, match="not found"):
            regions.reader("other")(info.region_id, 0, torch.float32, [1], "key")
        assert region.users == 2  # each read holds the region until the reader closes
        regions.release("t", info.region_id)  # released mid-call: stays mapped for the call
        assert not os.path.exists(info.path) and not region.mm.closed
        del view
        reader.close()
        assert region.users == 0 and region.mm.closed
        reader.close()  # idempotent
    regions.close()


def test_zero_copy_reads_answer_like_the_bytes_path(monkeypatch: pytest.MonkeyPatch) -> None:
    import cache_service.api.batch_decode_memo as memo_mod
    import cache_service.api.service as service_mod

    real = service_mod.SharedRegions
    monkeypatch.setattr(
        service_mod, "SharedRegions", lambda *a, **k: real(*a, **{**k, "pin_for_cuda": True})
    )
    import cache_service.wire.shared_regions as regions_mod

    copied = []  # outputs copied into a slot (not produced in place)
    real_payload = regions_mod.tensor_payload
    monkeypatch.setattr(
        regions_mod, "tensor_payload", lambda t: copied.append(1) or real_payload(t)
    )
    gen = torch.Generator().manual_seed(21)
    with ServiceHarness(service_config(), local_workers(1, 64)) as harness:
        assert _regions(harness)._pin_for_cuda
        with (
            KVCacheClient(harness.address) as shm,
            KVCacheClient(harness.address, shared_memory=False) as plain,
        ):
            ids, twins = decode_with_twins(shm, plain, 3, 3, gen)
            # Only each step's first layer (the full path) copied its output into the slot;
            # the other layers' outputs were produced in place by the worker.
            assert len(copied) == 3
            # A non-finite input read through a view is refused and changes nothing: on the
            # first layer (the full path) and on a later one (the short path, where the
            # worker checks and the output would be produced in place).
            slots: list[tuple[str, int, int]] = []
            real_outputs = memo_mod.shared_outputs

            def recorded(*args: Any) -> Any:
                outputs = real_outputs(*args)
                slots.append((outputs.out.region_id, outputs.out.offset, outputs.out.nbytes))
                return outputs

            monkeypatch.setattr(memo_mod, "shared_outputs", recorded)
            import workers.delivery as delivery_mod

            refused = []  # refusals by the worker's own check (the short path)
            real_refuse = delivery_mod.refuse_non_finite

            def counted(finite: Any) -> None:
                try:
                    real_refuse(finite)
                except Exception:
                    refused.append(1)
                    raise

            monkeypatch.setattr(delivery_mod, "refuse_non_finite", counted)
            mm = next(iter(_regions(harness)._regions.values())).mm
            for layer in range(NL):
                before = harness.stats()
                k, v = (torch.randn(3, 1, HKV, D, generator=gen) for _ in range(2))
                q = torch.randn(3, 1, HQ, D, generator=gen)
                bad = k.clone()
                bad[1, 0, 0, 0] = float("nan")
                _, at, size = slots[-1] if slots else ("", 0, 0)
                last_output = bytes(mm[at : at + size])
                with pytest.raises(InvalidArgumentError, match=r"items\[1\]\.key .*(NaN|fin)"):
                    shm.append_attend_batch(layer, ids, [[5]] * 3, bad, v, q)
                assert harness.stats() == before
                assert slots[-1][1:] == (at, size) or not size
                assert bytes(mm[at : at + size]) == last_output  # the slot as it was
                shm.append_attend_batch(layer, ids, [[5]] * 3, k, v, q)  # the good call
            assert len(refused) == NL - 1  # every layer after the first tried the short path
            region = next(iter(_regions(harness)._regions.values()))
            assert region.users == 0  # every call let its region go
            for s in ids:
                shm.free(s)
            for s in twins:
                plain.free(s)
        harness.check_integrity()


def test_shared_rounds_copy_each_callers_rows_into_its_slot(monkeypatch) -> None:
    # Clients calling in step share worker rounds; each caller's rows go straight into its
    # own output slot (no reply-side copy on the short path) and equal dense attention.
    import cache_service.api.service as service_mod
    import cache_service.wire.shared_regions as regions_mod

    real = service_mod.SharedRegions
    monkeypatch.setattr(
        service_mod, "SharedRegions", lambda *a, **k: real(*a, **{**k, "pin_for_cuda": True})
    )
    copied = []  # outputs the reply had to copy into a slot
    real_payload = regions_mod.tensor_payload
    monkeypatch.setattr(
        regions_mod, "tensor_payload", lambda t: copied.append(1) or real_payload(t)
    )
    clients, batch, steps = 3, 2, 3
    config = service_config(**{"coordinator.batch_window_ms": 200.0})
    with ServiceHarness(config, local_workers(1, 64)) as harness:
        rounds = []
        coord = harness.coordinator
        real_run = coord._rounds.run_parts

        async def run_parts(key: Any, parts: list[Any]) -> None:
            rounds.append(len(parts))
            await real_run(key, parts)

        coord._rounds.run_parts = run_parts  # type: ignore[method-assign]
        in_step = threading.Barrier(clients)
        errors: list[BaseException] = []

        def client(seed: int) -> None:
            gen = torch.Generator().manual_seed(seed)
            try:
                with KVCacheClient(harness.address) as c:
                    mirrors = [Mirror(c.create_sequence().seq_id, NL) for _ in range(batch)]
                    ids = [m.seq_id for m in mirrors]
                    for step in range(steps):
                        for layer in range(NL):
                            k, v = (torch.randn(batch, 1, HKV, D, generator=gen) for _ in "kv")
                            q = torch.randn(batch, 1, HQ, D, generator=gen)
                            in_step.wait(timeout=30)
                            got = c.append_attend_batch(layer, ids, [[step]] * batch, k, v, q)
                            assert c.shared_memory_active
                            for i, m in enumerate(mirrors):
                                m.add(layer, k[i], v[i])
                                ref, _ = m.reference(layer, q[i])
                                assert torch.allclose(got[i].double(), ref, atol=1e-5)
            except BaseException as exc:  # reported below, with the barrier broken
                errors.append(exc)
                in_step.abort()

        threads = [threading.Thread(target=client, args=(s,)) for s in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        harness.call(coord.block_manager.check_integrity)
    assert max(rounds) > 1  # some rounds were shared
    # Only each step's first layer (the full path) copied its output in the reply.
    assert len(copied) == clients * steps
