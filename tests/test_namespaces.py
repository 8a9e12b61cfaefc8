"""Prefix-cache namespaces: two models of one layout never share cached K/V.

The control plane (block manager, snapshot records, write-ahead log) and the gRPC API.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from cache_service.client import InvalidArgumentError, KVCacheClient
from cache_service.config import (
    LayoutConfig,
    MetricsConfig,
    ServerConfig,
    ServiceConfig,
    WorkersConfig,
)
from cache_service.control.block_manager import BlockManager, BlockManagerConfig, InvalidRequest
from cache_service.engine.recovery import DurableBlockManager, recover
from cache_service.engine.store import MetadataStore, StoreConfig
from cache_service.integrations.embedded import EmbeddedService

BS = 4
LAYERS = 2
PROMPT = list(range(1, 14))  # 3 full blocks of 4 and one token


def _manager() -> BlockManager:
    cfg = BlockManagerConfig(block_size=BS, num_layers=LAYERS, layout_fingerprint="fp")
    m = BlockManager(cfg)
    m.add_worker("w0", 32)
    return m


def _write_all(m: Any, tenant: str, seq_id: str, tokens: list[int]) -> None:
    m.prepare_write(tenant, seq_id, None, tokens)
    m.commit_write(tenant, seq_id, None, len(tokens))


def _cached_prompt(m: Any, namespace: str, tenant: str = "t") -> str:
    created = m.create_sequence(tenant, PROMPT, namespace=namespace)
    _write_all(m, tenant, created.seq_id, PROMPT[created.num_cached_tokens :])
    return created.seq_id


def test_a_prefix_is_found_only_in_its_own_namespace() -> None:
    m = _manager()
    _cached_prompt(m, "model-a")
    assert m.lookup("t", PROMPT, "model-a") == 12
    assert m.lookup("t", PROMPT, "model-b") == 0
    assert m.lookup("t", PROMPT) == 0  # the default namespace is a namespace too
    assert m.create_sequence("t", PROMPT, namespace="model-b").num_cached_tokens == 0
    assert m.create_sequence("t", PROMPT, namespace="model-a").num_cached_tokens == 12
    m.check_integrity()


def test_forks_and_public_blocks_keep_the_namespace() -> None:
    m = _manager()
    seq = _cached_prompt(m, "model-a")
    fork = m.fork("t", seq)
    _write_all(m, "t", fork, [99, 98, 97])  # completes block 3 of the fork: published
    longer = [*PROMPT, 99, 98, 97]
    assert m.lookup("t", [*longer, 1], "model-a") == 16
    assert m.lookup("t", [*longer, 1], "") == 0
    m.publish_public("t", seq)
    assert m.lookup("other", PROMPT, "model-a") == 12
    assert m.lookup("other", PROMPT, "model-b") == 0
    assert m.lookup("other", PROMPT) == 0
    m.check_integrity()


def test_pins_are_per_namespace() -> None:
    m = _manager()
    _cached_prompt(m, "model-a")
    assert m.pin("t", PROMPT, "model-b") == 0
    assert m.pin("t", PROMPT, "model-a") == 12
    with pytest.raises(InvalidRequest):
        m.unpin("t", PROMPT, "model-b")
    m.unpin("t", PROMPT, "model-a")
    m.check_integrity()


@pytest.mark.parametrize("bad", ["x" * 257, "tab\there", "nl\n", "\x00"])
def test_bad_namespaces_are_refused_and_change_nothing(bad: str) -> None:
    m = _manager()
    _cached_prompt(m, "")
    before = m.to_records()
    for call in (
        lambda: m.create_sequence("t", PROMPT, namespace=bad),
        lambda: m.lookup("t", PROMPT, bad),
        lambda: m.pin("t", PROMPT, bad),
    ):
        with pytest.raises(InvalidRequest, match="namespace"):
            call()
    assert m.to_records() == before


def test_records_and_log_recovery_keep_namespaces(tmp_path: Path) -> None:
    config = BlockManagerConfig(block_size=BS, num_layers=LAYERS, layout_fingerprint="fp")
    store = MetadataStore(StoreConfig(str(tmp_path / "s.db")))
    store.begin_generation()
    durable = DurableBlockManager(BlockManager(config), store)
    durable.add_worker("w0", 32)
    seq = _cached_prompt(durable, "model-a")
    durable.pin("t", PROMPT, "model-a")
    durable.publish_public("t", seq)
    durable.flush()
    expected = durable.manager.to_records()
    assert BlockManager.from_records(expected).to_records() == expected
    store.close()

    store = MetadataStore(StoreConfig(str(tmp_path / "s.db")))
    store.begin_generation()
    recovered = recover(store, config).manager
    assert recovered.to_records() == expected
    assert recovered.lookup("t", PROMPT, "model-a") == 12
    assert recovered.lookup("t", PROMPT) == 0
    recovered.unpin("t", PROMPT, "model-a")
    store.close()


def test_records_without_namespaces_restore_into_the_default_namespace() -> None:
    m = _manager()
    _cached_prompt(m, "")
    m.pin("t", PROMPT)
    records = m.to_records()
    for group in ("sequences", "index", "pins"):
        for item in records[group]:
            assert item.pop("namespace") == ""
    restored = BlockManager.from_records(records)
    assert restored.lookup("t", PROMPT) == 12
    restored.unpin("t", PROMPT)


@pytest.fixture(scope="module")
def service() -> Any:
    config = ServiceConfig(
        layout=LayoutConfig(
            num_layers=LAYERS, num_kv_heads=1, head_dim=8, block_size=BS, dtype="float32"
        ),
        workers=WorkersConfig(num_workers=1, blocks_per_worker=64, in_process=True),
        server=ServerConfig(host="127.0.0.1", port=0),
        metrics=MetricsConfig(enabled=False),
        log_level="WARNING",
    )
    with EmbeddedService(config) as svc:
        yield svc


def test_grpc_namespaces_separate_prefixes_and_refuse_bad_ones(service: Any) -> None:
    with KVCacheClient(service.address, timeout_s=30) as c:
        h = c.create_sequence(PROMPT, namespace="model-a")
        n = len(PROMPT)
        kv = torch.randn(LAYERS, n, 1, 8)
        c.append(h.seq_id, PROMPT, kv, kv)
        assert c.lookup([*PROMPT, 0], namespace="model-a") == 12
        assert c.lookup([*PROMPT, 0], namespace="model-b") == 0
        assert c.lookup([*PROMPT, 0]) == 0
        other = c.create_sequence(PROMPT, namespace="model-b")
        assert other.num_cached_tokens == 0
        c.pin(PROMPT, namespace="model-a")
        c.unpin(PROMPT, namespace="model-a")
        for call in (
            lambda: c.create_sequence(PROMPT, namespace="x" * 300),
            lambda: c.lookup(PROMPT, namespace="bad\n"),
            lambda: c.pin(PROMPT, namespace="bad\x01"),
        ):
            with pytest.raises(InvalidArgumentError, match="namespace"):
                call()
        c.free(h.seq_id)
        c.free(other.seq_id)
