"""Attention requests written straight to wire bytes parse to the message the protobuf API
builds (and are byte-identical to its serialization), for the shapes clients send."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from cache_service._proto.kvcache.v1 import kvcache_pb2 as pb
from cache_service.wire.request_codec import (
    encode_append_attend,
    encode_append_attend_batch,
    encode_attend,
    encode_attend_batch,
)
from cache_service.wire.tensor_codec import TensorCodecError, tensor_to_proto

Batch = tuple[list[str], list[list[int]], list[torch.Tensor], list[torch.Tensor], list]


def _decode_batch(dtype: torch.dtype = torch.float16, n: int = 8) -> Batch:
    g = torch.Generator().manual_seed(n)
    k = torch.randn(n, 1, 4, 16, generator=g).to(dtype)  # a model's batch: rows of one tensor
    v = torch.randn(n, 1, 4, 16, generator=g).to(dtype)
    q = torch.randn(n, 1, 8, 16, generator=g).to(dtype)
    ids = [[(i * 7919) % 50000] for i in range(n)]
    return [f"seq-{i:04x}" for i in range(n)], ids, list(k), list(v), list(q)


def _ragged() -> Batch:
    g = torch.Generator().manual_seed(1)
    sizes = [3, 1, 5]
    k = [torch.randn(s, 2, 8, generator=g) for s in sizes]  # separate tensors
    v = [torch.randn(s, 2, 8, generator=g).bfloat16() for s in sizes]  # another dtype
    q = [torch.randn(2, 4, 8, generator=g).half().transpose(0, 1).contiguous().transpose(0, 1)]
    q += [torch.randn(1, 4, 8, generator=g), torch.randn(5, 4, 8, generator=g)]
    ids = [[0, 127, 128], [2**40], [-1, 2**63 - 1, -(2**63), 300, 5]]
    return ["a", "", "séquence-ü"], ids, k, v, q


CASES: dict[str, Callable[[], Batch]] = {
    "decode fp16": _decode_batch,
    "decode bf16 x32": lambda: _decode_batch(torch.bfloat16, 32),
    "decode fp32 x1": lambda: _decode_batch(torch.float32, 1),
    "ragged, mixed dtypes, non-contiguous, wide ids": _ragged,
    "empty query": lambda: (
        ["s"],
        [[1]],
        [torch.ones(1, 2, 4)],
        [torch.ones(1, 2, 4)],
        [torch.zeros(0, 2, 4)],
    ),
    "no items": lambda: ([], [], [], [], []),
}


def _api_append_attend(layer: int, b: Batch, lse: bool) -> Any:
    req = pb.AppendAttendRequest(layer=layer, return_lse=lse)
    for s, ids, k, v, q in zip(*b, strict=True):
        req.items.add(
            seq_id=s,
            token_ids=ids,
            key=tensor_to_proto(k),
            value=tensor_to_proto(v),
            query=tensor_to_proto(q),
        )
    return req


def _api_attend(layer: int, b: Batch, lse: bool) -> Any:
    req = pb.AttendRequest(layer=layer, return_lse=lse)
    for s, q in zip(b[0], b[4], strict=True):
        req.items.add(seq_id=s, query=tensor_to_proto(q))
    return req


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("layer", "lse"), [(0, False), (31, True), (2**32 - 1, False)])
def test_append_attend_bytes_equal_the_protobuf_api(case: str, layer: int, lse: bool) -> None:
    b = CASES[case]()
    raw = encode_append_attend(layer, *b, lse)
    want = _api_append_attend(layer, b, lse)
    assert pb.AppendAttendRequest.FromString(raw) == want
    if case != "empty query":  # protobuf leaves empty data out; the codec frames it
        assert raw == want.SerializeToString()


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("layer", "lse"), [(0, True), (7, False)])
def test_attend_bytes_equal_the_protobuf_api(case: str, layer: int, lse: bool) -> None:
    b = CASES[case]()
    raw = encode_attend(layer, b[0], b[4], lse)
    want = _api_attend(layer, b, lse)
    assert pb.AttendRequest.FromString(raw) == want
    if case != "empty query":
        assert raw == want.SerializeToString()


def test_what_cannot_travel_is_refused_before_anything_is_sent() -> None:
    s, ids, k, v, q = _decode_batch(n=2)
    with pytest.raises(TensorCodecError, match="cannot travel"):
        encode_append_attend(0, s, ids, [t.long() for t in k], v, q, False)
    with pytest.raises(TensorCodecError, match="cannot travel"):
        encode_attend(0, s, [t.double() for t in q], False)
    with pytest.raises(ValueError, match=r"items\[1\].token_ids holds 9223372036854775808"):
        encode_append_attend(0, s, [[1], [2**63]], k, v, q, False)
    with pytest.raises(ValueError, match="layer must be a uint32, got -1"):
        encode_append_attend(-1, s, ids, k, v, q, False)
    with pytest.raises(ValueError, match="differ in count"):
        encode_append_attend(0, s, ids, k[:1], v, q, False)


BATCH_CASES: dict[str, Callable[[], tuple]] = {
    "decode bf16 x32": lambda: _whole(torch.bfloat16, 32, 1, 1),
    "decode fp16 x1": lambda: _whole(torch.float16, 1, 1, 1),
    "chunk fp32: 3 tokens, 2 query rows, wide ids": lambda: _whole(torch.float32, 4, 3, 2),
    "non-contiguous batch tensors": lambda: _whole(torch.float16, 5, 2, 1, transpose=True),
}


def _whole(dtype: torch.dtype, b: int, n: int, m: int, transpose: bool = False) -> tuple:
    g = torch.Generator().manual_seed(b * 10 + n)
    k = torch.randn(b, n, 4, 16, generator=g).to(dtype)
    v = torch.randn(b, n, 4, 16, generator=g).to(dtype)
    q = torch.randn(b, m, 8, 16, generator=g).to(dtype)
    if transpose:
        k = torch.randn(b, 4, n, 16, generator=g).to(dtype).transpose(1, 2)
    ids = [[(i * 7919 + j) % 50000 for j in range(n)] for i in range(b)]
    if n > 1:
        ids[0] = [2**40, -1, 2**63 - 1][:n] + ids[0][3:]
    return [f"seq-{i:04x}-é" for i in range(b)], ids, k, v, q


@pytest.mark.parametrize("case", list(BATCH_CASES))
@pytest.mark.parametrize(("layer", "lse"), [(0, False), (31, True), (2**32 - 1, True)])
def test_batch_requests_equal_the_protobuf_api(case: str, layer: int, lse: bool) -> None:
    seq_ids, ids, k, v, q = BATCH_CASES[case]()
    raw = encode_append_attend_batch(layer, seq_ids, ids, k, v, q, lse)
    want = pb.AppendAttendBatchRequest(
        layer=layer,
        seq_ids=seq_ids,
        token_ids=[t for row in ids for t in row],
        key=tensor_to_proto(k),
        value=tensor_to_proto(v),
        query=tensor_to_proto(q),
        return_lse=lse,
    )
    assert pb.AppendAttendBatchRequest.FromString(raw) == want
    assert raw == want.SerializeToString()
    raw = encode_attend_batch(layer, seq_ids, q, lse)
    want = pb.AttendBatchRequest(
        layer=layer, seq_ids=seq_ids, query=tensor_to_proto(q), return_lse=lse
    )
    assert pb.AttendBatchRequest.FromString(raw) == want
    assert raw == want.SerializeToString()


def test_batch_request_refusals() -> None:
    seq_ids, ids, k, v, q = _whole(torch.float16, 2, 1, 1)
    with pytest.raises(TensorCodecError, match="cannot travel"):
        encode_append_attend_batch(0, seq_ids, ids, k.long(), v, q, False)
    with pytest.raises(TensorCodecError, match="cannot travel"):
        encode_attend_batch(0, seq_ids, q.double(), False)
    with pytest.raises(ValueError, match="token_ids holds 9223372036854775808"):
        encode_append_attend_batch(0, seq_ids, [[1], [2**63]], k, v, q, False)
    with pytest.raises(ValueError, match="layer must be a uint32"):
        encode_attend_batch(2**32, seq_ids, q, False)
