"""workers.host_bytes: small host copies with the GIL held, and when they decline."""

from __future__ import annotations

import pytest
import torch

from workers import host_bytes
from workers.host_bytes import MAX_HELD_BYTES, copy_from, copy_to, plain_host


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int64])
def test_copies_a_tensors_bytes_both_ways(dtype):
    src = (torch.randn(5, 3, 8) * 100).to(dtype)
    buf = torch.zeros(src.numel() * src.element_size() + 64, dtype=torch.uint8)
    assert copy_from(buf.data_ptr() + 32, src)
    view = buf[32 : 32 + src.numel() * src.element_size()].view(dtype).view(src.shape)
    assert torch.equal(view, src)
    assert torch.equal(buf[:32], torch.zeros(32, dtype=torch.uint8))  # nothing before
    assert torch.equal(buf[-32:], torch.zeros(32, dtype=torch.uint8))  # nor after
    dst = torch.zeros_like(src)
    assert copy_to(dst, buf.data_ptr() + 32)
    assert torch.equal(dst, src)


def test_declines_what_a_byte_copy_would_get_wrong_and_touches_nothing():
    buf = torch.zeros(1 << 12, dtype=torch.uint8)
    strided = torch.randn(8, 4).t()
    negated = torch._neg_view(torch.randn(4, 4))
    assert negated.is_neg() and not plain_host(negated)
    for t in (strided, negated):
        assert not copy_from(buf.data_ptr(), t)
        assert not copy_to(t, buf.data_ptr())
    assert torch.equal(buf, torch.zeros_like(buf))
    big = torch.ones(MAX_HELD_BYTES // 4 + 1)  # past the held-GIL limit: torch's to copy
    assert not copy_from(buf.data_ptr(), big)
    assert torch.equal(buf, torch.zeros_like(buf))


def test_empty_tensors_copy_nothing():
    buf = torch.zeros(16, dtype=torch.uint8)
    assert copy_from(buf.data_ptr(), torch.empty(0, 4))
    assert copy_to(torch.empty(0, 4), buf.data_ptr())
    assert torch.equal(buf, torch.zeros_like(buf))


def test_without_memmove_everything_is_left_to_torch(monkeypatch):
    monkeypatch.setattr(host_bytes, "_MEMMOVE", None)
    buf = torch.zeros(64, dtype=torch.uint8)
    assert not copy_from(buf.data_ptr(), torch.ones(4))
    assert not copy_to(torch.ones(4), buf.data_ptr())
    assert torch.equal(buf, torch.zeros_like(buf))
