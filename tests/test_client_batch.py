"""The client's batch calls (`append_attend_batch`, `attend_batch`) over a real port: a model's
``[batch, ...]`` tensors in, one ``[batch, ...]`` output out, equal to dense attention and to
the per-item calls; bad batches refused on the client or with INVALID_ARGUMENT, changing
nothing."""

from __future__ import annotations

import re

import grpc
import pytest
import torch
from service_support import (
    HQ,
    LAYOUT,
    Mirror,
    ServiceHarness,
    dense_attention,
    local_workers,
    service_config,
)

from cache_service._proto.kvcache.v1 import kvcache_pb2 as pb
from cache_service._proto.kvcache.v1 import kvcache_pb2_grpc as pb_grpc
from cache_service.client import (
    AppendAttendItem,
    InvalidArgumentError,
    KVCacheClient,
    NotFoundError,
)
from cache_service.wire.tensor_codec import tensor_from_proto, tensor_to_proto

D, HKV, NL = LAYOUT.head_dim, LAYOUT.num_kv_heads, LAYOUT.num_layers


@pytest.fixture(scope="module")
def svc():
    with ServiceHarness(service_config(), local_workers(2, 64)) as harness:
        yield harness


def test_batch_decode_equals_dense_and_the_per_item_call(svc) -> None:
    gen = torch.Generator().manual_seed(3)
    with KVCacheClient(svc.address) as client:
        mirrors = [Mirror(client.create_sequence().seq_id, NL) for _ in range(5)]
        twins = [Mirror(client.create_sequence().seq_id, NL) for _ in range(5)]
        ids = [m.seq_id for m in mirrors]
        for step in range(6):  # across a block boundary (block_size 4)
            n = 3 if step == 0 else 1  # a short prefill, then decode
            m_rows = 2 if step == 3 else 1  # speculative-style rows on one step
            tokens = torch.randint(0, 50000, (5, n), generator=gen)  # one step, every layer
            for layer in range(NL):
                k = torch.randn(5, n, HKV, D, generator=gen)
                v = torch.randn(5, n, HKV, D, generator=gen)
                q = torch.randn(5, m_rows, HQ, D, generator=gen)
                out, lse = client.append_attend_batch(layer, ids, tokens, k, v, q, True)
                assert out.shape == (5, m_rows, HQ, D) and lse.shape == (5, m_rows, HQ)
                items = [
                    AppendAttendItem(t.seq_id, tokens[i].tolist(), k[i], v[i], q[i])
                    for i, t in enumerate(twins)
                ]
                per_item = client.append_attend(layer, items)
                for i, m in enumerate(mirrors):
                    m.add(layer, k[i], v[i])
                    ref, ref_lse = m.reference(layer, q[i])
                    assert torch.allclose(out[i].double(), ref, atol=1e-5)
                    assert torch.allclose(lse[i].double(), ref_lse, atol=1e-4)
                    assert torch.equal(out[i], per_item[i])
        last = NL - 1
        q = torch.randn(5, 2, HQ, D, generator=gen).half()
        out = client.attend_batch(last, ids, q)
        assert out.dtype == torch.float16 and out.shape == (5, 2, HQ, D)
        for i, m in enumerate(mirrors):
            ref, _ = m.reference(last, q[i].float())
            assert torch.allclose(out[i].double(), ref, atol=2e-3)
        for m in mirrors + twins:
            client.free(m.seq_id)
    svc.check_integrity()


def test_bad_batches_are_refused_and_change_nothing(svc) -> None:
    gen = torch.Generator().manual_seed(4)
    with KVCacheClient(svc.address) as client:
        seqs = [client.create_sequence().seq_id for _ in range(2)]
        k = torch.randn(2, 1, HKV, D, generator=gen)
        q = torch.randn(2, 1, HQ, D, generator=gen)
        before = svc.stats()
        with pytest.raises(ValueError, match="key holds 2 sequences, seq_ids 3"):
            client.append_attend_batch(0, [*seqs, "x"], [[1], [2], [3]], k, k, q)
        with pytest.raises(ValueError, match="query must be a 4-D tensor"):
            client.attend_batch(0, seqs, q[:, 0])
        with pytest.raises(ValueError, match="token_ids holds 1 sequences"):
            client.append_attend_batch(0, seqs, [[1]], k, k, q)
        with pytest.raises(ValueError, match=r"token_ids must be \[batch, n\], got shape \(2,\)"):
            client.append_attend_batch(0, seqs, torch.tensor([1, 2]), k, k, q)
        with pytest.raises(
            ValueError, match=r"token_ids\[0\] must be the row's token ids, got int"
        ):
            client.append_attend_batch(0, seqs, [1, 2], k, k, q)
        k2 = torch.randn(2, 2, HKV, D, generator=gen)
        with pytest.raises(ValueError, match=r"token_ids\[0\] holds 3 ids but key has 2 new"):
            client.append_attend_batch(0, seqs, [[1, 2, 3], [4]], k2, k2, q)
        with pytest.raises(ValueError, match=r"token_ids\[1\] holds 1 ids but key has 2 new"):
            client.append_attend_batch(0, seqs, [[1, 2], [4]], k2, k2, q)
        with pytest.raises(InvalidArgumentError, match="seq_ids is empty: attend_batch needs"):
            client.attend_batch(0, [], q[:0])
        # The server's refusals: wrong head_dim, unknown sequence, duplicate sequence.
        with pytest.raises(InvalidArgumentError, match="key"):
            client.append_attend_batch(0, seqs, [[1], [2]], k[..., :-1], k[..., :-1], q)
        with pytest.raises(NotFoundError):
            client.append_attend_batch(0, [seqs[0], "no-such-seq"], [[1], [2]], k, k, q)
        with pytest.raises(InvalidArgumentError, match="appears twice"):
            client.append_attend_batch(0, [seqs[0], seqs[0]], [[1], [2]], k, k, q)
        assert svc.stats() == before
        svc.check_integrity()
        # Nothing was written: the first real write is each sequence's only token.
        out = client.append_attend_batch(0, seqs, [[1], [2]], k, -k, q)
        for i in range(2):
            ref, _ = dense_attention(q[i], k[i], -k[i])
            assert torch.allclose(out[i].double(), ref, atol=1e-5)
        for s in seqs:
            client.free(s)
    svc.check_integrity()


def _raw_batch(seq_ids, tokens, k, v, q, layer=0):
    return pb.AppendAttendBatchRequest(
        layer=layer,
        seq_ids=seq_ids,
        token_ids=tokens,
        key=tensor_to_proto(k),
        value=tensor_to_proto(v),
        query=tensor_to_proto(q),
    )


def test_batch_rpcs_refuse_malformed_requests_and_change_nothing(svc) -> None:
    """What the client would never send, sent raw: each refusal names the field, and no
    sequence, block or counter changes."""
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(2, 1, HKV, D, generator=gen)
    q = torch.randn(2, 1, HQ, D, generator=gen)
    with KVCacheClient(svc.address) as client, grpc.insecure_channel(svc.address) as channel:
        stub = pb_grpc.KVCacheStub(channel)
        seqs = [client.create_sequence().seq_id for _ in range(2)]
        client.append_attend_batch(0, seqs, [[5], [6]], k, k, q)  # layer 0 holds one token
        before = svc.stats()
        nan = k.clone()
        nan[1, 0, 0, 0] = float("nan")
        short = _raw_batch(seqs, [1, 2], k, k, q)
        short.key.data = short.key.data[:-2]
        bad_dtype = _raw_batch(seqs, [1, 2], k, k, q)
        bad_dtype.value.dtype = 99
        cases = [
            (_raw_batch([], [], k[:0], k[:0], q[:0]), "seq_ids is empty"),
            (_raw_batch([seqs[0], ""], [1, 2], k, k, q), r"seq_ids\[1\] is empty"),
            (_raw_batch(seqs, [1, 2, 3], torch.cat([k, k[:1]]), k, q), "key: dimension 0 is 3"),
            (_raw_batch(seqs, [1, 2], k, k[:, :, :1], q), "value: dimension 2 is 1"),
            (_raw_batch(seqs, [1, 2, 3], k, k, q), "token_ids holds 3 ids; 2 sequences x 1"),
            (_raw_batch(seqs, [], k[:, :0], k[:, :0], q), "no new tokens"),
            (_raw_batch(seqs, [1, 2], k, k, q[:, :0]), "no query rows"),
            (_raw_batch(seqs, [1, 2], k, k, q[..., :-1]), "query: dimension 3"),
            (_raw_batch(seqs, [1, 2], k, k, q[:, :, :3]), "3 heads"),
            (_raw_batch(seqs, [1, 2], nan, k, q), r"items\[1\]\.key contains NaN"),
            (short, "data bytes"),
            (bad_dtype, "value.dtype"),
            (_raw_batch(seqs, [1, 2], k, k, q, layer=NL), "layer must be in"),
            # Layer 1 is new for both, but layer 0 reserved tokens 5 and 6 at position 0.
            (_raw_batch(seqs, [5, 7], k, k, q, layer=1), r"items\[1\]: position 0 holds token 6"),
        ]
        for request, message in cases:
            with pytest.raises(grpc.RpcError) as info:
                stub.AppendAttendBatch(request, timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, message
            assert re.search(message, info.value.details()), (message, info.value.details())
        with pytest.raises(grpc.RpcError) as info:
            stub.AppendAttendBatch(_raw_batch([seqs[0], "nope"], [5, 1], k, k, q), timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        attend = pb.AttendBatchRequest(layer=1, seq_ids=seqs, query=tensor_to_proto(q))
        with pytest.raises(grpc.RpcError) as info:
            stub.AttendBatch(attend, timeout=10)  # layer 1 holds nothing yet
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        attend = pb.AttendBatchRequest(layer=0, seq_ids=seqs, query=tensor_to_proto(q[:1]))
        with pytest.raises(grpc.RpcError) as info:
            stub.AttendBatch(attend, timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "query: dimension 0 is 1, expected 2" in info.value.details()
        assert svc.stats() == before
        svc.check_integrity()
        # The raw batch RPC answers like the client's call: [batch, m, Hq, D] and lse.
        raw = _raw_batch(seqs, [5, 6], k, -k, q, layer=1)
        raw.return_lse = True
        reply = stub.AppendAttendBatch(raw, timeout=10)
        out = tensor_from_proto(reply.output, "output")
        lse = tensor_from_proto(reply.lse, "lse")
        assert out.shape == (2, 1, HQ, D) and lse.shape == (2, 1, HQ)
        for i in range(2):
            ref, ref_lse = dense_attention(q[i], k[i], -k[i])
            assert torch.allclose(out[i].double(), ref, atol=1e-5)
            assert torch.allclose(lse[i].double(), ref_lse, atol=1e-4)
        for s in seqs:
            client.free(s)
    svc.check_integrity()
