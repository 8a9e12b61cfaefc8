"""Tensor <-> wire encoding: exact round trips, and clear errors for malformed tensors."""

from __future__ import annotations

import pytest
import torch

from cache_service._proto.kvcache.v1 import kvcache_pb2 as pb
from cache_service.wire.tensor_codec import (
    TensorCodecError,
    joined_view,
    row_payloads,
    tensor_from_bytes,
    tensor_from_proto,
    tensor_payload,
    tensor_to_bytes,
    tensor_to_proto,
    tensors_from_protos,
)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(3, 2, 8), (0, 4, 8), (1,), (2, 3, 4, 5)])
def test_round_trip_is_bit_exact(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = (torch.randn(shape) * 1e3).to(dtype)
    back = tensor_from_proto(tensor_to_proto(t), "t")
    assert back.dtype == dtype and tuple(back.shape) == shape
    # Compare bits, so -0.0 / NaN payloads would also have to survive.
    assert torch.equal(back.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       t.view(torch.int16 if dtype != torch.float32 else torch.int32))  # fmt: skip


def test_bytes_are_little_endian_and_c_contiguous() -> None:
    t = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float32).t()  # non-contiguous
    data = tensor_to_bytes(t)
    assert data == torch.tensor([1.0, 3.0, 2.0, 4.0]).numpy().astype("<f4").tobytes()
    assert tensor_to_bytes(torch.tensor([1.0], dtype=torch.bfloat16)) == b"\x80\x3f"


def test_decoded_tensors_own_writable_memory() -> None:
    msg = tensor_to_proto(torch.ones(4))
    t = tensor_from_proto(msg, "t")
    t += 1  # would fail (or corrupt the message) on a view of the immutable bytes
    assert tensor_from_proto(msg, "t").sum() == 4


@pytest.mark.parametrize(
    ("msg", "kwargs", "needle"),
    [
        (pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[2, 2], data=b"\0" * 15), {}, "15 data bytes"),
        (pb.Tensor(dtype=pb.DTYPE_UNSPECIFIED, shape=[1], data=b"\0" * 4), {}, "unsupported dtype"),
        (pb.Tensor(dtype=99, shape=[1], data=b"\0" * 4), {}, "unsupported dtype"),
        (pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[-1, 2], data=b""), {}, "negative"),
        (
            pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[2, 2], data=b"\0" * 16),
            {"ndim": 3},
            "3 dimensions",
        ),
        (
            pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[2, 3], data=b"\0" * 24),
            {"shape": (2, 4)},
            "dimension 1 is 3, expected 4",
        ),
        (
            pb.Tensor(dtype=pb.DTYPE_FLOAT16, shape=[2], data=b"\0" * 4),
            {"dtypes": (torch.float32,)},
            "not allowed",
        ),
    ],
)
def test_malformed_tensors_are_refused_naming_the_field(msg, kwargs, needle) -> None:
    with pytest.raises(TensorCodecError, match=needle) as info:
        tensor_from_proto(msg, "items[3].query", **kwargs)
    assert "items[3].query" in str(info.value)


def test_unsupported_dtypes_cannot_be_sent() -> None:
    with pytest.raises(TensorCodecError, match="cannot travel"):
        tensor_to_proto(torch.ones(2, dtype=torch.int64))
    with pytest.raises(TensorCodecError, match="needs 8"):
        tensor_from_bytes(b"\0" * 7, torch.float32, [2])


# ---- batch forms: one field of every item of a request / reply


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_batch_decode_matches_one_by_one_and_shares_one_writable_buffer(dtype) -> None:
    ts = [(torch.randn(1, 4, 8) * 100).to(dtype) for _ in range(5)]
    msgs = [tensor_to_proto(t) for t in ts]
    got = tensors_from_protos(msgs, "items[{}].key", ndim=3)
    assert [tuple(g.shape) for g in got] == [(1, 4, 8)] * 5
    for g, t in zip(got, ts, strict=True):
        assert g.dtype == dtype and torch.equal(bits(g), bits(t))
    span = joined_view(got)  # one buffer, items in order: one tensor without a copy
    assert span is not None and span.numel() == 5 * 32
    assert span.data_ptr() == got[0].data_ptr()
    got[1] += 1  # its own memory, not the messages' bytes, and not its neighbours'
    assert torch.equal(bits(got[0]), bits(ts[0])) and torch.equal(bits(got[2]), bits(ts[2]))
    assert torch.equal(bits(tensor_from_proto(msgs[1], "t")), bits(ts[1]))


def test_batch_decode_of_different_shapes_and_dtypes() -> None:
    ts = [torch.randn(2, 4, 8), torch.randn(1, 4, 8), torch.randn(3, 4, 8)]
    got = tensors_from_protos([tensor_to_proto(t) for t in ts], "q{}", ndim=3)
    assert all(torch.equal(g, t) for g, t in zip(got, ts, strict=True))
    assert joined_view(got) is not None
    mixed = [torch.randn(1, 2), torch.randn(1, 2).half(), torch.randn(0, 2)]
    got = tensors_from_protos([tensor_to_proto(t) for t in mixed], "q{}")
    assert [g.dtype for g in got] == [t.dtype for t in mixed]
    assert all(torch.equal(g, t) for g, t in zip(got, mixed, strict=True))
    empty = tensors_from_protos([tensor_to_proto(torch.ones(0, 3))] * 2, "q{}")
    assert [tuple(e.shape) for e in empty] == [(0, 3), (0, 3)]
    assert tensors_from_protos([], "q{}") == []


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        (pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1, 4, 8], data=b"\0" * 12), "12 data bytes"),
        (pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[4, 8], data=b"\0" * 128), "3 dimensions"),
        (pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[-1, -4, 8], data=b"\0" * 128), "negative"),
        (pb.Tensor(dtype=99, shape=[1, 4, 8], data=b"\0" * 128), "unsupported dtype"),
    ],
)
def test_batch_decode_names_the_bad_message(bad, needle) -> None:
    good = tensor_to_proto(torch.randn(1, 4, 8))
    for msgs, index in (([good, good, bad, good], 2), ([bad, good], 0)):
        with pytest.raises(TensorCodecError, match=needle) as info:
            tensors_from_protos(msgs, "items[{}].key", ndim=3)
        assert f"items[{index}].key" in str(info.value)


def test_joined_view_only_for_tensors_back_to_back_in_one_storage() -> None:
    x = torch.arange(24.0).reshape(4, 2, 3)
    rows = list(x.unbind(0))
    span = joined_view(rows)
    assert span is not None and torch.equal(span, x.reshape(-1))
    assert span.data_ptr() == x.data_ptr()  # a view: nothing copied
    assert joined_view(rows[1:3]) is not None
    assert joined_view([rows[0], rows[2]]) is None  # a gap
    assert joined_view([rows[1], rows[0]]) is None  # out of order
    assert joined_view([x[:, :1], x[:, 1:]]) is None  # not contiguous
    assert joined_view([x[0], x.view(torch.int32)[1]]) is None  # another dtype
    assert joined_view([torch.ones(3), torch.ones(3)]) is None  # two storages
    assert joined_view([]) is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_row_and_whole_payloads_are_the_tensor_bytes(dtype: torch.dtype) -> None:
    batch = (torch.randn(5, 2, 3, 4) * 100).to(dtype).transpose(1, 2)  # not contiguous
    rows = row_payloads(batch)
    assert [bytes(r) for r in rows] == [tensor_to_bytes(b) for b in batch]
    assert bytes(tensor_payload(batch)) == tensor_to_bytes(batch)
    contiguous = batch.contiguous()
    view = tensor_payload(contiguous)
    assert isinstance(view, memoryview) and bytes(view) == tensor_to_bytes(batch)  # no copy
    assert tensor_payload(torch.empty(0, 3, dtype=dtype)) == b""
    with pytest.raises(TensorCodecError):
        tensor_payload(torch.ones(2, dtype=torch.int64))
