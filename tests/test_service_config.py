"""ServiceConfig: YAML files, dotted overrides, and errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from cache_service.config import ConfigError, ServiceConfig, load_config


def test_a_file_sets_sections_and_flags_override_it(tmp_path: Path) -> None:
    path = tmp_path / "svc.yaml"
    path.write_text(
        "layout: {num_layers: 32, num_kv_heads: 8, head_dim: 128, dtype: bfloat16}\n"
        "workers: {num_workers: 8, device: cuda, ray_address: auto}\n"
        "server: {port: 6000}\n"
        "coordinator: {batch_window_ms: 1}\n"
        "auth_file: tokens.yaml\n"
    )
    config = load_config(path)
    assert config.layout.kv_layout().num_layers == 32
    assert config.workers.device == "cuda" and config.workers.ray_address == "auto"
    assert config.coordinator.batch_window_ms == 1.0 and config.server.port == 6000
    assert config.auth_file == "tokens.yaml"
    changed = config.with_overrides({"server.port": 0, "workers.num_workers": None})
    assert changed.server.port == 0 and changed.workers.num_workers == 8
    with_tls = config.with_overrides({"tls.cert_file": "c.pem", "tls.key_file": "k.pem"})
    assert with_tls.tls is not None and with_tls.tls.client_ca_file is None


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("layout: {num_layers: 0}\n", "layout.num_layers must be a positive integer"),
        ("layout: {dtype: int8}\n", "layout.dtype must be one of"),
        ("server: {port: 70000}\n", "server.port must be a TCP port"),
        ("server: {bogus: 1}\n", "unknown key(s) ['bogus'] in server"),
        ("workers: {device: tpu}\n", "workers.device"),
        ("coordinator: {batch_window_ms: -1}\n", "batch_window_ms must be a number >= 0"),
        ("coordinator: {max_batch_items: yes}\n", "max_batch_items must be an integer"),
        ("metrics: {enabled: 3}\n", "metrics.enabled must be true or false"),
        ("metrics: {event_loop_lag_interval_s: -1}\n", "event_loop_lag_interval_s must be a"),
        (
            "metrics: {event_loop_lag_interval_s: .inf}\n",
            "event_loop_lag_interval_s must be a finite",
        ),
        ("metrics: {event_loop_lag_interval_s: often}\n", "event_loop_lag_interval_s must be"),
        ("server: {local_session_callbacks: 1}\n", "server.local_session_callbacks must be"),
        ("coordinator: {coalesce_layers: 2}\n", "coordinator.coalesce_layers must be true or"),
        ("coordinator: {overlap_rounds: 1}\n", "coordinator.overlap_rounds must be true or"),
        ("shared_memory: {idle_timeout_s: 0}\n", "shared_memory.idle_timeout_s must be > 0"),
        ("shared_memory: {max_regions_per_tenant: 0}\n", "max_regions_per_tenant must be"),
        ("tls: {cert_file: a.pem}\n", "tls"),
        ("- a list\n", "must be a mapping"),
        ("layout: [\n", "not valid YAML"),
    ],
)
def test_bad_files_name_the_key(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert needle in str(info.value) and str(path) in str(info.value)


def test_missing_file_and_unknown_override_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "absent.yaml")
    with pytest.raises(ConfigError, match="unknown"):
        ServiceConfig().with_overrides({"server.nope": 1})
    with pytest.raises(ConfigError, match="stream_chunk_bytes"):
        ServiceConfig().with_overrides({"server.max_message_bytes": 1024})


def test_server_torch_threads_default_depends_on_where_pools_run() -> None:
    from cache_service.api.server import server_torch_threads

    base = ServiceConfig()
    cpu_pools = base.with_overrides({"workers.in_process": True, "workers.device": "cpu"})
    gpu_pools = base.with_overrides({"workers.in_process": True, "workers.device": "cuda"})
    assert server_torch_threads(cpu_pools) is None  # their attention uses torch's threads
    assert server_torch_threads(gpu_pools) == 1
    assert server_torch_threads(base) == 1  # Ray workers: the server only copies and checks
    assert server_torch_threads(gpu_pools.with_overrides({"server.torch_threads": 3})) == 3
    with pytest.raises(ConfigError, match=r"server\.torch_threads"):
        base.with_overrides({"server.torch_threads": 0})
