"""Tensor <-> wire encoding: exact round trips, and clear errors for malformed tensors."""

from __future__ import annotations

import pytest
import torch

from cache_service._proto.kvcache.v1 import kvcache_pb2 as pb
from cache_service.tensor_codec import (
    TensorCodecError,
    tensor_from_bytes,
    tensor_from_proto,
    tensor_to_bytes,
    tensor_to_proto,
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
