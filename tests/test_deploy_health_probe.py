"""`python -m cache_service.health_probe` (the image's HEALTHCHECK) against a real gRPC
health service on loopback: exit 0 only when SERVING."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cache_service.health_probe import check, main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def health_server() -> Iterator[tuple[str, health.HealthServicer]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        server.stop(None)


def run_probe(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cache_service.health_probe", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_probe_exit_codes(health_server) -> None:
    address, servicer = health_server
    serving = run_probe("--address", address, "--timeout", "5")
    assert serving.returncode == 0, serving.stderr
    assert "SERVING" in serving.stdout

    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    not_serving = run_probe("--address", address, "--timeout", "5")
    assert not_serving.returncode == 1
    assert "NOT_SERVING" in not_serving.stdout

    servicer.set("kvcache.v1.KVCache", health_pb2.HealthCheckResponse.SERVING)
    assert main(["--address", address, "--service", "kvcache.v1.KVCache"]) == 0
    assert check(address, "kvcache.v1.KVCache", 5) == "SERVING"
    # An unknown service is NOT_FOUND: unhealthy, with the reason on stderr.
    assert main(["--address", address, "--service", "nope", "--timeout", "5"]) == 1


def test_probe_unreachable_server_is_unhealthy() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # Nothing listens on the port any more: the probe must fail within its timeout.
    result = run_probe("--address", f"127.0.0.1:{port}", "--timeout", "1")
    assert result.returncode == 1
    assert "unhealthy" in result.stderr and "UNAVAILABLE" in result.stderr


def test_probe_rejects_bad_arguments() -> None:
    result = run_probe("--timeout", "0")
    assert result.returncode == 2 and "--timeout" in result.stderr
    with pytest.raises(ValueError, match="timeout_s"):
        check("127.0.0.1:1", "", 0)
