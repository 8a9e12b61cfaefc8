"""A metadata store that stops taking writes makes the service answer UNAVAILABLE.

Through the real server: once the store file cannot be written, a mutation cannot be made
durable and must not be acknowledged; the client gets UNAVAILABLE with a message saying
the metadata store is the cause (not INTERNAL with an opaque reference), and so does
every later mutation, until the coordinator restarts and recovers from the file.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch
from service_support import LAYOUT, ServiceHarness, local_workers, service_config

from cache_service.api.status_mapping import status_for
from cache_service.client import KVCacheClient, UnavailableError
from cache_service.engine.store import StoreError, StoreLockedError

pytestmark = pytest.mark.timeout(60)


def test_store_errors_map_to_unavailable() -> None:
    for exc in (StoreError("could not log free: disk I/O error"), StoreLockedError("locked")):
        status = status_for(exc)
        assert status.code is grpc.StatusCode.UNAVAILABLE and not status.internal
        assert str(exc) in status.message and "metadata store" in status.message


def test_a_failed_store_answers_unavailable(tmp_path: Path) -> None:
    workers = local_workers(1, 8)
    config = service_config(store_path=str(tmp_path / "meta.db"))
    with (
        ServiceHarness(config, workers) as svc,
        KVCacheClient(svc.address, timeout_s=20, max_attempts=1) as client,
    ):
        seq = client.create_sequence()
        shape = (LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, LAYOUT.head_dim)
        client.append(seq.seq_id, [1, 2], torch.zeros(shape), torch.zeros(shape))
        # The file goes away under the coordinator (a disk gone read-only or full gives
        # the same StoreError from the next write).
        svc.call(svc.coordinator._store.close)
        for call in (
            client.create_sequence,
            lambda: client.free(seq.seq_id),
            lambda: client.append(seq.seq_id, [3], *(torch.zeros(2, 1, 2, 16),) * 2),
        ):
            with pytest.raises(UnavailableError) as info:
                call()
            assert "metadata store is unavailable" in info.value.message
