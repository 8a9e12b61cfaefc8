"""The registry of page-locked host ranges (workers.pinned_ranges): its range logic and
thread safety on any machine, that workers.cuda_pinning keeps it (with a fake CUDA
runtime), and the pool's pinned test (workers.delivery) answering from it; on a GPU, against the driver."""

from __future__ import annotations

import mmap
import threading
from typing import Any

import pytest
import torch

import workers.delivery as delivery_mod
from workers import cuda_pinning
from workers.pinned_ranges import REGISTERED, PinnedRanges


def test_covers_only_spans_inside_one_range():
    ranges = PinnedRanges()
    assert len(ranges) == 0 and not ranges.covers(100, 1)
    ranges.add(1000, 100)  # [1000, 1100)
    ranges.add(5000, 10)  # [5000, 5010)
    assert len(ranges) == 2
    assert ranges.covers(1000, 100) and ranges.covers(1050, 50) and ranges.covers(1099, 1)
    assert not ranges.covers(999, 1)  # starts before
    assert not ranges.covers(1050, 51)  # ends past the range
    assert not ranges.covers(1100, 1)  # just past the end
    assert not ranges.covers(1090, 4000)  # over the gap into the next range
    assert ranges.covers(5000, 10) and not ranges.covers(4999, 2)
    ranges.remove(1000)
    assert not ranges.covers(1050, 1) and ranges.covers(5005, 5) and len(ranges) == 1
    ranges.remove(1000)  # unknown: nothing happens
    ranges.remove(5000)
    assert len(ranges) == 0 and not ranges.covers(5005, 1)


def test_overlapping_or_empty_ranges_are_not_recorded():
    ranges = PinnedRanges()
    ranges.add(1000, 100)
    ranges.add(1099, 10)  # overlaps the last byte: a caller's mistake, ignored
    ranges.add(900, 101)
    assert len(ranges) == 1 and not ranges.covers(1099, 2)
    ranges.add(1100, 10)  # adjacent: fine, but a span over both is not in one range
    assert ranges.covers(1100, 10) and not ranges.covers(1095, 10)
    with pytest.raises(ValueError, match="nbytes >= 1"):
        ranges.add(2000, 0)
    with pytest.raises(ValueError, match="start >= 0"):
        ranges.add(-1, 5)


def test_readers_see_whole_snapshots_while_ranges_change():
    ranges = PinnedRanges()
    ranges.add(0, 10)  # always there: every read must see it
    stop = threading.Event()
    errors: list[str] = []

    def churn() -> None:
        i = 0
        while not stop.is_set():
            start = 1000 + (i % 50) * 100
            ranges.add(start, 100)
            ranges.remove(start)
            i += 1

    threads = [threading.Thread(target=churn) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        for _ in range(20000):
            if not ranges.covers(5, 5):
                errors.append("lost the steady range")
                break
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert errors == []


class _FakeCudart:
    """cudaHostRegister / cudaHostUnregister that record calls and what the registry held
    at each (the registry must never name memory CUDA does not pin)."""

    def __init__(self, code: int = 0) -> None:
        self.code = code
        self.calls: list[tuple[str, int, bool]] = []

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        self.calls.append(("register", ptr, REGISTERED.covers(ptr, nbytes)))
        return self.code

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr, REGISTERED.covers(ptr, 1)))
        return 0


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, code: int = 0) -> _FakeCudart:
    fake = _FakeCudart(code)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    return fake


def test_pin_records_the_range_after_registering_and_unpin_forgets_it_first(monkeypatch):
    fake = _fake_cuda(monkeypatch)
    buffer = torch.zeros(4096, dtype=torch.uint8)
    ptr = buffer.data_ptr()
    assert cuda_pinning.pin(buffer)
    assert REGISTERED.covers(ptr, 4096) and not REGISTERED.covers(ptr, 4097)
    cuda_pinning.unpin(buffer)
    assert not REGISTERED.covers(ptr, 1)
    # Not in the registry while CUDA did not (yet, or any more) pin it.
    assert fake.calls == [("register", ptr, False), ("unregister", ptr, False)]


def test_a_refused_registration_is_not_recorded(monkeypatch):
    _fake_cuda(monkeypatch, code=1)
    buffer = torch.zeros(4096, dtype=torch.uint8)
    assert not cuda_pinning.pin(buffer)
    assert not REGISTERED.covers(buffer.data_ptr(), 1)


def _counting_is_pinned(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count calls of Tensor.is_pinned (the driver query the registry spares)."""
    asked: list[int] = []
    real = torch.Tensor.is_pinned

    def is_pinned(self: torch.Tensor, *args: Any, **kwargs: Any) -> bool:
        asked.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "is_pinned", is_pinned)
    return asked


def test_the_pools_pinned_test_answers_registered_memory_without_asking(monkeypatch):
    asked = _counting_is_pinned(monkeypatch)
    base = torch.zeros(8192, dtype=torch.uint8)
    key = base[256:1280].view(torch.float16).view(8, 64)  # contiguous, inside
    strided = base[:4096].view(torch.float16).view(32, 64)[:, ::2]  # not contiguous
    empty = base[:0]
    REGISTERED.add(base.data_ptr(), 8192)
    try:
        # (A CPU-only machine pins nothing: True can only come from the registry.)
        assert delivery_mod.is_pinned_host(key) and asked == []
        assert not delivery_mod.is_pinned_host(strided) and len(asked) == 1  # asked
        assert not delivery_mod.is_pinned_host(empty) and len(asked) == 2  # asked
        outside = torch.zeros(64, dtype=torch.float16)
        assert not delivery_mod.is_pinned_host(outside) and len(asked) == 3
    finally:
        REGISTERED.remove(base.data_ptr())
    assert not delivery_mod.is_pinned_host(key) and len(asked) == 4  # forgotten: asked


def test_a_range_ending_inside_a_tensor_does_not_cover_it():
    base = torch.zeros(4096, dtype=torch.uint8)
    REGISTERED.add(base.data_ptr(), 1024)
    try:
        assert delivery_mod.is_pinned_host(base[:1024])
        assert not delivery_mod.is_pinned_host(base[512:1536])  # half outside: asked
    finally:
        REGISTERED.remove(base.data_ptr())


# -- on a GPU ------------------------------------------------------------------------------


@pytest.mark.gpu
def test_registered_memory_is_pinned_to_the_driver_too_until_unpinned(monkeypatch):
    with mmap.mmap(-1, 1 << 20) as mm:  # pages of its own, as a shared region's
        buffer = torch.frombuffer(mm, dtype=torch.uint8)
        views = [
            buffer[i << 16 : (i + 1) << 16].view(torch.float16).view(256, 128) for i in range(3)
        ]
        assert not any(delivery_mod.is_pinned_host(v) for v in views)
        assert cuda_pinning.pin(buffer)
        try:
            assert all(v.is_pinned() for v in views)  # what the registry answers for
            asked = _counting_is_pinned(monkeypatch)
            assert all(delivery_mod.is_pinned_host(v) for v in views) and asked == []
            monkeypatch.undo()
        finally:
            cuda_pinning.unpin(buffer)
        # Unregistered: the registry has forgotten it and the driver says pageable.
        assert not REGISTERED.covers(buffer.data_ptr(), 1)
        assert not any(v.is_pinned() for v in views)
        assert not any(delivery_mod.is_pinned_host(v) for v in views)
        del views, buffer  # (the mapping closes once nothing views it)
    # A pinned tensor torch allocated (not registered here) is still found pinned.
    assert delivery_mod.is_pinned_host(torch.empty(64, pin_memory=True))
    assert not delivery_mod.is_pinned_host(torch.empty(64, device="cuda"))
