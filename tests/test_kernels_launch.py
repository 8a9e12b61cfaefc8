"""The cached launcher's specialization key (pure logic; the direct launch itself is
exercised by the GPU tests, whose repeated calls go through it)."""

from __future__ import annotations

import torch

from kernels.launch import CachedLauncher, _arg_key


def test_tensor_key_tracks_dtype_and_alignment() -> None:
    buf = torch.zeros(64, dtype=torch.float16)
    assert _arg_key(buf) == _arg_key(buf[8:])  # 16 bytes further: still aligned
    assert _arg_key(buf) != _arg_key(buf[1:])  # 2 bytes off
    assert _arg_key(buf) != _arg_key(buf.float())


def test_int_key_tracks_what_triton_specializes() -> None:
    assert _arg_key(32) == _arg_key(48)  # both multiples of 16
    assert _arg_key(1) != _arg_key(17)  # 1 is specialized as a constant
    assert _arg_key(16) != _arg_key(17)  # divisibility by 16
    assert _arg_key(2**31 - 16) != _arg_key(2**31 + 16)  # int32 vs int64
    assert _arg_key(True) != _arg_key(1)  # bool is not int


def test_float_key_ignores_value() -> None:
    assert _arg_key(0.125) == _arg_key(3.0)


def test_interpreter_always_goes_through_the_jit(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = []

    class FakeJit:
        arg_names = ("x", "N")

        def __getitem__(self, grid):
            return lambda *a, **k: calls.append((grid, a, k))

    launcher = CachedLauncher(FakeJit())
    for _ in range(3):
        launcher((1, 1, 1), (7,), {"N": 4}, num_warps=4)
    assert len(calls) == 3 and calls[0] == ((1, 1, 1), (7,), {"N": 4, "num_warps": 4})
