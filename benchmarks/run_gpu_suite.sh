#!/usr/bin/env bash
# The project's GPU runs, by named phase; each writes its report and log under $OUT.
#
# On the lent GPU machine, from the repository root, with Ray carried (.device/, made once by
# ../shared/device/prepare.sh; see its README):
#   source .device/env.sh && bash benchmarks/run_gpu_suite.sh <phase> [<phase> ...]
# On any CUDA host with the project installed: bash benchmarks/run_gpu_suite.sh <phase>
#
# Phases (rough wall time on one H200; a device call may last at most 10 minutes):
#   env           versions, GPUs, CPUs (every phase prints them first)
#   tests         every gpu-marked test                                       ~3 min
#   kernels       bench_kernels.py: decode, prefill, write_kv vs SDPA/Flex     ~5 min
#   service       bench_service.py --h200: one client of batch 32, pools in the server's
#                 process (two transports) and behind a Ray actor              ~4 min
#   concurrency   bench_service.py --h200, the Ray row: batch 32, then 8 clients of batch 8
#                 against one, $PAIRS alternating pairs (default 8)          ~6 min
#   gate          the worker's GPU tests, then `concurrency` (the issue gates' call)
#   transformers  bench_transformers.py --h200 and --h200-8b: 1.1B and 8B Llama-shaped ~6 min
#   leases        the step-lease GPU tests, bench_leases.py --h200              ~3 min
#   load          bench_load.py: 64 clients for 60 s, Ray workers (CPU pools)  ~2 min
#   multigpu      bench_multigpu.py on every GPU of the host (kind *-x2 or more) ~4 min
#   smoke         tests/test_benchmarks_smoke.py (every benchmark's CPU run)  ~1 min
#   all           every phase above but gate, in that order (longer than one device call)
#
# Record what a phase measured as a new file in benchmarks/results/ (command, device, date
# are in each report) and update docs/performance.md.
set -uo pipefail
OUT=${OUT:-/tmp/kvcache-gpu-out}
PAIRS=${PAIRS:-8}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

usage="phases: env tests kernels service concurrency gate transformers leases load multigpu smoke all"
[ $# -ge 1 ] || { echo "usage: $0 <phase> [<phase> ...]; $usage" >&2; exit 2; }

# The service's health and reflection servicers: wheels carried in .device/wheels/ are
# installed when the GPU image lacks them (it has no network).
if [ -d .device/wheels ] && ! python3 -c "import grpc_health, grpc_reflection" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps .device/wheels/*.whl
fi

env_info() {
  echo "== $(date -u +%FT%TZ) $(git rev-parse --short HEAD 2>/dev/null || echo no-git)" \
    "$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
      | paste -sd';') / $(nproc) CPUs"
  python3 -c "import torch, triton, grpc; print('torch', torch.__version__, 'triton',
triton.__version__, 'grpc', grpc.__version__, 'gpus', torch.cuda.device_count())"
  python3 -c "import ray; print('ray', ray.__version__)" 2>/dev/null || echo "ray: absent"
}

# run NAME SECONDS COMMAND...: COMMAND bounded by SECONDS, its output in $OUT/NAME.log;
# prints the log's last lines and a line with the exit status.
run() {
  local name=$1 limit=$2
  shift 2
  echo "== $(date -u +%T) $name: $*"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 40 "$OUT/$name.log"
  echo "== $name: exit $rc"
  return $rc
}

gpu_tests() {
  run gpu-tests 300 python3 -m pytest -m gpu -q -p no:cacheprovider -n 4 tests/
}

worker_tests() {
  run worker-tests 150 python3 -m pytest -m gpu -q -p no:cacheprovider \
    tests/test_workers_pool.py tests/test_decode_graphs.py tests/test_workers_gpu.py
}

concurrency() {
  CUDA_VISIBLE_DEVICES=0 run concurrency-h200 480 python3 benchmarks/bench_service.py --h200 \
    --no-in-process --transports local-shm --pairs "$PAIRS" --out "$OUT/service-h200-ray.md"
}

phase() {
  case $1 in
  env) ;;
  tests) gpu_tests ;;
  kernels)
    run kernels-h200 330 python3 benchmarks/bench_kernels.py --out "$OUT/kernels" ;;
  service)
    CUDA_VISIBLE_DEVICES=0 run service-h200 300 python3 benchmarks/bench_service.py --h200 \
      --transports local-shm,session-shm --phases single --out "$OUT/service-h200.md" ;;
  concurrency) concurrency ;;
  gate) worker_tests; concurrency ;;
  transformers)
    CUDA_VISIBLE_DEVICES=0 run transformers-h200 240 python3 benchmarks/bench_transformers.py \
      --h200 --out "$OUT/transformers"
    CUDA_VISIBLE_DEVICES=0 run transformers-h200-8b 300 python3 benchmarks/bench_transformers.py \
      --h200-8b --repeats 1 --out "$OUT/transformers" ;;
  leases)
    CUDA_VISIBLE_DEVICES=0 run lease-tests 150 python3 -m pytest -m gpu -q -p no:cacheprovider \
      tests/test_step_leases_gpu.py tests/test_workers_gpu.py -k "lease or Lease"
    CUDA_VISIBLE_DEVICES=0 run leases-h200 120 python3 benchmarks/bench_leases.py --h200 ;;
  load)
    run load 180 python3 benchmarks/bench_load.py --out "$OUT/load.md" ;;
  multigpu)
    run multigpu 330 python3 benchmarks/bench_multigpu.py --out "$OUT/multigpu" ;;
  smoke)
    run smoke 240 python3 -m pytest -q -p no:cacheprovider tests/test_benchmarks_smoke.py ;;
  all)
    local p rc=0
    for p in tests kernels service concurrency transformers load multigpu smoke; do
      phase "$p" || rc=1
    done
    return $rc ;;
  *) echo "unknown phase '$1'; $usage" >&2; return 2 ;;
  esac
}

env_info
status=0
for p in "$@"; do
  phase "$p" || status=1
done
exit $status
