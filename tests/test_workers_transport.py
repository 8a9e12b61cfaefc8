"""workers.transport: tensors packed as raw-byte numpy arrays round-trip bit for bit,
in-process and through pickle protocol 5 with out-of-band, read-only buffers (what Ray's
object store hands the receiver)."""

from __future__ import annotations

import pickle
import warnings

import numpy as np
import pytest
import torch

from workers.transport import PackedTensor, pack, pack_result, unpack

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.int32, torch.int64]


def _sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
        if t.numel() > 3:  # special values survive too
            t.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -0.0]).to(dtype)
        return t
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=gen, dtype=dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _assert_bit_exact(got: torch.Tensor, want: torch.Tensor) -> None:
    assert isinstance(got, torch.Tensor)
    assert got.dtype == want.dtype and got.shape == want.shape and got.device.type == "cpu"
    assert torch.equal(_bits(got), _bits(want))


def _ray_like_round_trip(obj: object) -> object:
    """Pickle with out-of-band buffers, then load them back read-only (object store)."""
    buffers: list[pickle.PickleBuffer] = []
    payload = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    frozen = [memoryview(bytes(b.raw())) for b in buffers]  # read-only, like the store
    return pickle.loads(payload, buffers=frozen)


def _cases() -> list[tuple[str, torch.Tensor]]:
    cases = []
    for dtype in DTYPES:
        name = str(dtype).removeprefix("torch.")
        cases.append((f"{name}-3d", _sample(dtype, (5, 3, 8))))
        cases.append((f"{name}-noncontig", _sample(dtype, (6, 10)).t()[::2]))
        cases.append((f"{name}-empty", torch.empty(0, 4, dtype=dtype)))
        cases.append((f"{name}-scalar", _sample(dtype, (1,)).reshape(())))
    return cases


CASES = _cases()


@pytest.mark.parametrize("readonly", [False, True])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_round_trip_through_pickle_is_bit_exact(case, readonly):
    _, t = case
    packed = pack(t, readonly=readonly)
    assert isinstance(packed, PackedTensor)
    if t.numel():
        buffers: list[pickle.PickleBuffer] = []
        pickle.dumps(packed, protocol=5, buffer_callback=buffers.append)
        assert len(buffers) == 1 and buffers[0].raw().nbytes == t.numel() * t.element_size()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "non-writable array" warning leaks out
        got = _ray_like_round_trip(packed)
    _assert_bit_exact(got, t)
    if not readonly and t.numel():
        got.view(-1)[0] = got.view(-1)[-1]  # a writable copy: the frozen buffer is untouched


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_round_trip_in_process_is_bit_exact(case):
    _, t = case
    got = unpack(pack(t))
    _assert_bit_exact(got, t)
    assert torch.equal(_bits(unpack(pickle.loads(pickle.dumps(pack(t))))), _bits(t))


def test_contiguous_host_tensor_is_viewed_not_copied():
    t = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    packed = pack(t)
    assert packed.data.ctypes.data == t.data_ptr()
    assert unpack(packed).data_ptr() == t.data_ptr()


def test_readonly_receive_is_zero_copy():
    t = _sample(torch.bfloat16, (64, 32))
    buffers: list[pickle.PickleBuffer] = []
    payload = pickle.dumps(pack(t, readonly=True), protocol=5, buffer_callback=buffers.append)
    frozen = np.frombuffer(bytes(buffers[0].raw()), dtype=np.uint8)
    got = pickle.loads(payload, buffers=[frozen])
    assert got.data_ptr() == frozen.ctypes.data
    _assert_bit_exact(got, t)


def test_unpack_passes_other_values_through():
    t = torch.ones(2)
    assert unpack(t) is t
    assert unpack([1, 2]) == [1, 2]
    assert unpack(None) is None


def test_pack_result_packs_tensors_in_tuples_and_lists():
    out, lse = torch.ones(2, 3, dtype=torch.bfloat16), torch.zeros(2)
    packed = pack_result((out, None, [lse, "bad-slot"]))
    assert isinstance(packed[0], PackedTensor) and packed[1] is None
    assert isinstance(packed[2][0], PackedTensor) and packed[2][1] == "bad-slot"
    back = _ray_like_round_trip(packed)
    _assert_bit_exact(back[0], out)
    _assert_bit_exact(back[2][0], lse)
    assert pack_result(None) is None


def test_pack_rejects_non_tensors_and_unsupported_dtypes():
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        pack([1, 2])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dtype"):
        pack(torch.zeros(2, dtype=torch.complex64))
