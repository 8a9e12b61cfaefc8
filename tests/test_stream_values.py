"""Device-side counters (workers.stream_values): a stream waits for a value another stream
writes, without the host waiting; where the driver lacks them, a clear refusal."""

from __future__ import annotations

import time

import pytest
import torch

from workers import stream_values


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a CUDA driver")
def test_without_a_driver_the_counters_are_refused_clearly() -> None:
    assert not stream_values.available()
    with pytest.raises(stream_values.StreamValuesUnavailable, match="CUDA"):
        stream_values.wait(None, torch.zeros(1, dtype=torch.int32), 1)  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_stream_waits_for_the_value_another_stream_writes() -> None:
    assert stream_values.available()
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    data = torch.zeros(1 << 16, device="cuda")
    waiting, writing = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(waiting):
        stream_values.wait(waiting, counter, 3)
        data.add_(1)
    time.sleep(0.05)
    assert not waiting.query(), "the stream ran past a value nobody wrote"
    stream_values.write(writing, counter, 2)  # below the value: still waiting
    writing.synchronize()
    time.sleep(0.05)
    assert not waiting.query()
    stream_values.write(writing, counter, 3)
    waiting.synchronize()
    assert int(counter.item()) == 3 and float(data[0].item()) == 1.0
    # Cyclic comparison: a counter that wrapped past 2**32 still satisfies its wait.
    counter.fill_(-1)  # 0xFFFFFFFF
    with torch.cuda.stream(waiting):
        stream_values.wait(waiting, counter, 0xFFFFFFFF)
    waiting.synchronize()
    stream_values.write(writing, counter, 1 << 32 | 2)  # written as 2
    writing.synchronize()
    with torch.cuda.stream(waiting):
        stream_values.wait(waiting, counter, 0xFFFFFFFF)  # 2 is "after" 0xFFFFFFFF
    waiting.synchronize()
