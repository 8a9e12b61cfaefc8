"""server.gc_freeze: a started service freezes the collector's long-lived objects (full
collections then skip them) and the last one to stop hands them back."""

from __future__ import annotations

import gc

import torch
from service_support import HQ, LAYOUT, ServiceHarness, local_workers, service_config

from cache_service.client import KVCacheClient
from cache_service.config import ConfigError, ServiceConfig


def test_serving_freezes_and_stopping_unfreezes() -> None:
    assert gc.get_freeze_count() == 0
    first = ServiceHarness(service_config(**{"server.gc_freeze": True}), local_workers(1, 16))
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # torch, gRPC and the service's own objects
        second = ServiceHarness(service_config(**{"server.gc_freeze": True}), local_workers(1, 16))
        second.stop()
        assert gc.get_freeze_count() == frozen  # the first still serves: still frozen
        with KVCacheClient(first.address) as client:
            s = client.create_sequence().seq_id
            k = torch.randn(1, 1, LAYOUT.num_kv_heads, LAYOUT.head_dim)
            out = client.append_attend_batch(
                0, [s], [[1]], k, k, torch.randn(1, 1, HQ, LAYOUT.head_dim)
            )
            assert out.shape == (1, 1, HQ, LAYOUT.head_dim)
            client.free(s)
        first.check_integrity()
    finally:
        first.stop()
    assert gc.get_freeze_count() == 0


def test_gc_freeze_must_be_a_flag() -> None:
    import pytest

    with pytest.raises(ConfigError, match="gc_freeze must be true or false"):
        ServiceConfig().with_overrides({"server.gc_freeze": "yes"})
