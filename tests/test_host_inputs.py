"""InputReader: a forward's integer inputs on the host, in their shapes and dtypes."""

from __future__ import annotations

import pytest
import torch

from cache_service.integrations.host_inputs import InputReader


def test_host_tensors_and_none_pass_through() -> None:
    ids = torch.tensor([[3], [4]])
    mask = torch.ones(2, 5, dtype=torch.int32)[:, 4:]
    got_ids, got_none, got_mask = InputReader().read(ids, None, mask)
    assert got_none is None
    assert got_ids is not None and got_ids.data_ptr() == ids.data_ptr()
    assert got_mask is not None and got_mask.dtype == torch.int32
    assert torch.equal(got_mask, mask)


@pytest.mark.gpu
def test_device_tensors_read_in_their_shapes_dtypes_and_values() -> None:
    reader = InputReader()
    for batch in (2, 16, 200):  # the last one outgrows the first buffer
        ids = torch.randint(0, 50_000, (batch, 1), device="cuda")
        # A strided int32 column of a wider mask, as a forward's new mask column comes.
        mask = torch.randint(0, 2, (batch, 7), dtype=torch.int32, device="cuda")[:, 6:]
        positions = torch.arange(batch, device="cuda").view(1, batch)
        got = reader.read(ids, mask, None, positions)
        want = (ids.cpu(), mask.cpu(), None, positions.cpu())
        for g, w in zip(got, want, strict=True):
            if w is None:
                assert g is None
                continue
            assert g is not None and g.device.type == "cpu"
            assert g.dtype == w.dtype and g.shape == w.shape
            assert torch.equal(g, w)


@pytest.mark.gpu
def test_reads_wait_for_the_values_the_stream_computes() -> None:
    """A value the device is still computing when read is read once computed."""
    reader = InputReader()
    big = torch.randn(4096, 4096, device="cuda")
    for i in range(3):
        product = big @ big  # keeps the stream busy
        ids = (product[:4, :1] * 0).long() + i
        (got,) = reader.read(ids)
        assert got is not None and got.flatten().tolist() == [i] * 4
