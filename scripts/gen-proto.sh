#!/usr/bin/env bash
# Regenerate the Python gRPC stubs of proto/kvcache/v1 into cache_service/_proto/.
#
# Usage: scripts/gen-proto.sh [OUTPUT_ROOT]   (default: the repository root)
#
# The stubs are committed so installs need no protoc. They must come from grpcio-tools
# 1.84.0 exactly (pinned in requirements/constraints.txt): a generated *_grpc.py records its
# generator's version and refuses to import under an older grpcio, and the project supports
# every grpcio >= 1.84.0 (the GPU machine runs a 1.84 release).
#
# protoc's "-I<virtual>=<physical>" mapping names the file
# cache_service/_proto/kvcache/v1/kvcache.proto, so the generated imports read
# "from cache_service._proto.kvcache.v1 import kvcache_pb2" and resolve inside the installed
# package without touching sys.path.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${1:-$ROOT}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"

version="$("$PY" -c 'import grpc_tools, importlib.metadata as m; print(m.version("grpcio-tools"))')"
case "$version" in
  1.84.0) ;;
  *) echo "gen-proto: grpcio-tools $version found; 1.84.0 is required (see this script)" >&2; exit 1 ;;
esac

mkdir -p "$OUT/cache_service/_proto/kvcache/v1"
cd "$ROOT"
"$PY" -m grpc_tools.protoc \
  -Icache_service/_proto=proto \
  --python_out="$OUT" \
  --pyi_out="$OUT" \
  --grpc_python_out="$OUT" \
  proto/kvcache/v1/kvcache.proto
