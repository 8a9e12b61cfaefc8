"""The committed gRPC stubs: regenerated output equals them, and they import as a package."""

from __future__ import annotations

import filecmp
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ("kvcache_pb2.py", "kvcache_pb2.pyi", "kvcache_pb2_grpc.py")


def test_regenerating_the_stubs_gives_the_committed_files(tmp_path: Path) -> None:
    if importlib.metadata.version("grpcio-tools") != "1.84.0":
        pytest.fail(
            "grpcio-tools 1.84.0 is pinned (requirements/constraints.txt): the stubs record "
            "their generator's version; install it to compare"
        )
    subprocess.run(
        ["bash", str(ROOT / "scripts" / "gen-proto.sh"), str(tmp_path)],
        check=True,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
    )
    fresh = tmp_path / "cache_service" / "_proto" / "kvcache" / "v1"
    committed = ROOT / "cache_service" / "_proto" / "kvcache" / "v1"
    for name in GENERATED:
        assert filecmp.cmp(fresh / name, committed / name, shallow=False), (
            f"{name} is stale: run `make proto` and commit the result"
        )


def test_stubs_import_inside_the_package_and_need_no_newer_grpcio() -> None:
    from cache_service._proto.kvcache.v1 import kvcache_pb2, kvcache_pb2_grpc

    text = (ROOT / "cache_service/_proto/kvcache/v1/kvcache_pb2_grpc.py").read_text()
    assert "from cache_service._proto.kvcache.v1 import kvcache_pb2" in text
    generated = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", text).group(1)
    pyproject = (ROOT / "pyproject.toml").read_text()
    minimum = re.search(r'"grpcio>=([\d.]+)"', pyproject).group(1)
    # A stub refuses to import under a grpcio older than its generator.
    assert tuple(map(int, generated.split("."))) <= tuple(map(int, minimum.split(".")))
    service = kvcache_pb2.DESCRIPTOR.services_by_name["KVCache"]
    assert service.full_name == "kvcache.v1.KVCache"
    assert hasattr(kvcache_pb2_grpc, "KVCacheStub")


def test_the_api_has_every_capability_of_the_issue() -> None:
    from cache_service._proto.kvcache.v1 import kvcache_pb2

    service = kvcache_pb2.DESCRIPTOR.services_by_name["KVCache"]
    methods = {m.name: m for m in service.methods}
    assert set(methods) == {
        "GetInfo", "CreateSequence", "CreateSequences", "ForkSequence", "FreeSequence",
        "FreeSequences", "Lookup", "Pin", "Unpin",
        "PublishPublic", "Append", "Attend", "AppendAttend", "AppendAttendBatch",
        "AttendBatch", "ExportBlocks", "ImportBlocks", "GetStats", "CreateSharedRegion",
        "ReleaseSharedRegion", "Session", "ListSequences", "SubscribeKvEvents",
    }  # fmt: skip
    # Large payloads stream: Append and ImportBlocks from the client, ExportBlocks back.
    assert methods["Append"].client_streaming and not methods["Append"].server_streaming
    assert methods["ImportBlocks"].client_streaming
    assert methods["ExportBlocks"].server_streaming
    assert [v.name for v in kvcache_pb2.DType.DESCRIPTOR.values] == [
        "DTYPE_UNSPECIFIED", "DTYPE_FLOAT16", "DTYPE_BFLOAT16", "DTYPE_FLOAT32",
    ]  # fmt: skip


def test_every_field_and_method_of_the_proto_is_documented() -> None:
    lines = (ROOT / "proto/kvcache/v1/kvcache.proto").read_text().splitlines()
    member = re.compile(r"^\s*((optional |repeated )?[\w.]+ \w+ = \d+;|rpc )")
    undocumented = [
        line.strip()
        for i, line in enumerate(lines)
        if member.match(line) and "//" not in line and not lines[i - 1].strip().startswith("//")
    ]
    assert not undocumented, f"members without a comment: {undocumented}"
