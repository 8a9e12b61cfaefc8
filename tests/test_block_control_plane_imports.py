"""The control-plane modules stay pure: importing them loads no torch, ray or grpc."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PURE_MODULES = [
    "cache_service.errors",
    "cache_service.control.types",
    "cache_service.control.block_pool",
    "cache_service.control.prefix_index",
    "cache_service.control.sequence",
    "cache_service.control.placement",
    "cache_service.control.accounting",
    "cache_service.control.block_manager",
    "cache_service.control.integrity",
    "cache_service.control.records",
    "cache_service.control.state",
]
FORBIDDEN = ("torch", "triton", "ray", "grpc", "google.protobuf", "numpy")


def test_control_plane_imports_no_heavy_frameworks() -> None:
    # A fresh interpreter: this test process has torch loaded already (tests/conftest.py).
    code = (
        "import importlib, json, sys\n"
        f"for name in {PURE_MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    )
    loaded = json.loads(out.stdout)
    # The check must be able to fail: the modules under test were really imported.
    assert "cache_service.control.block_manager" in loaded
    bad = [m for m in loaded if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]
    assert bad == []
