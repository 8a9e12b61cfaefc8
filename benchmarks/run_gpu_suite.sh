#!/usr/bin/env bash
# The GPU runs of the project, grouped into device calls (see benchmarks/results/*-h200*.md).
# Usage on the GPU machine, from the repo root, with Ray carried (../shared/device/README.md):
#   source .device/env.sh && bash benchmarks/run_gpu_suite.sh tests-multigpu-workers
#   source .device/env.sh && bash benchmarks/run_gpu_suite.sh service-transformers
#   source .device/env.sh && bash benchmarks/run_gpu_suite.sh kernels-service
#   source .device/env.sh && bash benchmarks/run_gpu_suite.sh kernels-service-breakdown
#   source .device/env.sh && bash benchmarks/run_gpu_suite.sh service-transports
# Every phase is bounded by `timeout` and writes under $OUT (at most 8 files per call).
set -uo pipefail
OUT=${OUT:-/tmp/kvcache-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
phase=${1:?phase: tests-multigpu-workers | service-transformers | kernels-service | kernels-service-breakdown | service-transports | merge-kernels-service | graphs-service | profile-concurrency | profile-server | local-sessions | profile-local-concurrency | final-local-sessions | warm-up-profile | batching-callers | batch-trace | final-callers | joined-check | tail-check | callers-pairs | ray-pairs | ray-channel | channel-diag | channel-final | ray-breakdown | files-final | ray-profile | wire-final | locks-final | overlap | overlap-final | default-pairs | decode-memo | decode-memo-pairs | profile-memo | pages-plans | timeline | timeline-spy | timeline-worker | repeats | refills | refills-final | loop-idle | loop-idle-check | check-cost | checks-after | checks-final | pairs-no-check | uvloop | uvloop-diag | pairs-four | p99-check | check-unlocked | local-pairs | check-interference | rows-final | callbacks | profile-concurrent | pinned-loop | threads | gc-runs | forks-pairs | loop-split | checks-ab | graphs-beside-checks | kernels-v10 | kernels-table | parts | worker-busy | layers | final-layers | host-copies | final-copies}

echo "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | paste -sd';')"
python3 -c "import torch, triton, ray, grpc; print('torch', torch.__version__, 'triton', triton.__version__, 'ray', ray.__version__, 'grpc', grpc.__version__, 'gpus', torch.cuda.device_count())"

# The worker channel's GPU tests (shared arena, TCP, shared file), to $OUT/gpu-tests.log:
#   channel_tests SECONDS
channel_tests() {
  CUDA_VISIBLE_DEVICES=0 timeout "$1" python3 -m pytest -m gpu -q -p no:cacheprovider \
    tests/test_workers_gpu.py -k "channel" 2>&1 | tee "$OUT/gpu-tests.log" | tail -3
}

# The Ray row of bench_service.py (the pool behind a Ray actor, local-shm clients):
#   ray_row SECONDS PAIRS NAME [more bench_service arguments]
# writes $OUT/NAME.md (the report) and $OUT/NAME.log, and prints the report's tail.
ray_row() {
  local limit=$1 pairs=$2 name=$3
  shift 3
  CUDA_VISIBLE_DEVICES=0 timeout "$limit" python3 benchmarks/bench_service.py --h200 \
    --no-in-process --transports local-shm --pairs "$pairs" "$@" --out "$OUT/$name.md" \
    > "$OUT/$name.log" 2>&1
  tail -12 "$OUT/$name.md"
}

# The GPU tests of a worker's shared rounds (pool, decode graphs, stager, worker channel).
worker_round_tests() {
  timeout "$1" python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_workers_pool.py \
    tests/test_decode_graphs.py tests/test_workers_gpu.py \
    -k "parts or layers or stager or page or checked or channel or graph" 2>&1 | tail -3
}

# One concurrent run with the Ray worker's time per call kind (diag_worker_busy.py); $2
# lines of its report shown.
worker_busy() {
  CUDA_VISIBLE_DEVICES=0 timeout "$1" python3 benchmarks/diag_worker_busy.py --h200 \
    --no-in-process --transports local-shm --pairs 1 --phases concurrent \
    --out "$OUT/worker-busy.md" > "$OUT/worker-busy.log" 2>&1
  grep -h "^\[" "$OUT/worker-busy.log"; tail -"$2" "$OUT/worker-busy.log"
}

case $phase in
kernels-v10)
  # Kernel notes v10: the kernels' GPU tests (and the pool's, which call them); host time
  # per call and the split cases' diagnostic, after and (with V9_TREE, a tree holding the
  # v9 kernels/ package) before, in one call so the host and the GPU are the same.
  timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider -p no:benchmark -n 8 \
    tests/test_kernels_attention.py tests/test_kernels_io.py tests/test_kernels_validation.py \
    tests/test_kernels_launch.py tests/test_kernels_fingerprints.py tests/test_workers_gpu.py \
    2>&1 | tee "$OUT/gpu-tests.log" | tail -6
  timeout 40 python3 benchmarks/host_time.py --label v10 --json "$OUT/host-v10.json"
  if [ -n "${V9_TREE:-}" ]; then
    PYTHONPATH=$V9_TREE:$PYTHONPATH timeout 40 python3 benchmarks/host_time.py --label v9 \
      --json "$OUT/host-v9.json"
  fi
  timeout 110 python3 benchmarks/diag_split_v10.py --out "$OUT/v10.json"
  if [ -n "${V9_TREE:-}" ]; then
    PYTHONPATH=$V9_TREE:$PYTHONPATH timeout 50 python3 benchmarks/diag_split_v10.py \
      --default-only --out "$OUT/v9.json"
  fi
  ;;
kernels-table)
  # The kernel benchmark's table alone (results/kernels-h200.md).
  timeout 280 python3 benchmarks/bench_kernels.py --out "$OUT/kernels" 2>&1 \
    | tee "$OUT/kernels.log" | tail -45
  ;;
tests-multigpu-workers)
  timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider -p no:benchmark -n 4 \
    tests/test_kernels_attention.py tests/test_kernels_io.py tests/test_kernels_validation.py \
    tests/test_workers_gpu.py tests/test_integration_transformers_gpu.py tests/test_multigpu_gpu.py \
    2>&1 | tee "$OUT/gpu-tests.log" | tail -15
  timeout 200 python3 benchmarks/bench_multigpu.py --out "$OUT/multigpu" 2>&1 | tee "$OUT/multigpu.log" | tail -60
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 benchmarks/bench_workers.py --out "$OUT/workers" 2>&1 \
    | tee "$OUT/workers.log" | tail -25
  ;;
service-transformers)
  CUDA_VISIBLE_DEVICES=0 timeout 290 python3 benchmarks/bench_service.py --h200 --out "$OUT/service-h200.md" 2>&1 \
    | tee "$OUT/service.log" | tail -40
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 benchmarks/bench_transformers.py --h200 --out "$OUT/transformers" 2>&1 \
    | tee "$OUT/transformers.log" | tail -30
  ;;
kernels-service)
  # The single-GPU tests of the kernels and the pool, the service on one GPU (pools in the
  # server process, with a server profile), then the kernel benchmark; each phase bounded.
  timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -p no:benchmark -n 8 \
    tests/test_kernels_attention.py tests/test_kernels_io.py tests/test_kernels_validation.py \
    tests/test_workers_gpu.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -15
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 benchmarks/bench_service.py --h200 --no-ray \
    --profile "$OUT/service-profile.txt" --out "$OUT/service-h200.md" 2>&1 \
    | tee "$OUT/service.log" | tail -40
  timeout 230 python3 benchmarks/bench_kernels.py --out "$OUT/kernels" 2>&1 \
    | tee "$OUT/kernels.log" | tail -40
  ;;
kernels-service-breakdown)
  # The single-GPU tests, the kernel benchmark, the service (pools in the server process)
  # and where one service call's time goes; fits one 10-minute device call.
  timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider -p no:benchmark -n 8 \
    tests/test_kernels_attention.py tests/test_kernels_io.py tests/test_kernels_validation.py \
    tests/test_workers_gpu.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -4
  timeout 220 python3 benchmarks/bench_kernels.py --out "$OUT/kernels" 2>&1 \
    | tee "$OUT/kernels.log" | grep -v "^  sweep" | tail -32
  CUDA_VISIBLE_DEVICES=0 timeout 190 python3 benchmarks/bench_service.py --h200 --no-ray \
    --out "$OUT/service-h200.md" > "$OUT/service.log" 2>&1; tail -22 "$OUT/service.log"
  CUDA_VISIBLE_DEVICES=0 timeout 60 python3 benchmarks/service_breakdown.py --device cuda \
    2>&1 | tee "$OUT/breakdown.log" | tail -5
  ;;
service-transports)
  # The pool's GPU tests and the session / shared-memory / step-reuse tests (CPU workers,
  # this host's Python and grpcio); the service over two client transports; where one
  # call's time goes (both transports); the stages of the in-process pool call (with and
  # without the step's metadata key); the block-placement diagnostic of the split-KV kernels.
  timeout 120 python3 -m pytest -q -p no:cacheprovider -p no:benchmark -n 4 \
    tests/test_workers_gpu.py tests/test_session.py tests/test_shared_memory.py \
    tests/test_layer_steps.py 2>&1 | tee "$OUT/tests.log" | tail -4
  CUDA_VISIBLE_DEVICES=0 timeout 300 python3 benchmarks/bench_service.py --h200 --no-ray \
    --transports session-shm,unary --out "$OUT/service-h200.md" > "$OUT/service.log" 2>&1
  tail -24 "$OUT/service.log"
  for t in session-shm unary; do
    CUDA_VISIBLE_DEVICES=0 timeout 70 python3 benchmarks/service_breakdown.py --device cuda \
      --layers 32 --transport $t 2>&1 | tee -a "$OUT/breakdown.log" | tail -7
  done
  for flag in "" --no-key; do
    CUDA_VISIBLE_DEVICES=0 timeout 90 python3 benchmarks/pool_call_breakdown.py $flag 2>&1 \
      | tee -a "$OUT/pool-breakdown.log" | tail -9
  done
  CUDA_VISIBLE_DEVICES=0 timeout 60 python3 benchmarks/diag_placement.py 2>&1 \
    | tee "$OUT/placement.log" | tail -3
  ;;
profile-concurrency)
  # The service benchmark; its concurrency runs again without CUDA graphs (A/B in one
  # call); py-spy profiles (every thread, every process) of the single and the concurrent
  # runs. PYSPY: the py-spy binary.
  CUDA_VISIBLE_DEVICES=0 timeout 170 python3 benchmarks/bench_service.py --h200 --no-ray \
    --transports session-shm --out "$OUT/service-h200.md" > "$OUT/bench-service.log" 2>&1
  tail -14 "$OUT/service-h200.md"
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 benchmarks/bench_service.py --h200 --no-ray \
    --transports session-shm --phases one_small,concurrent --no-graphs \
    --out "$OUT/service-no-graphs.md" > "$OUT/bench-no-graphs.log" 2>&1
  tail -4 "$OUT/service-no-graphs.md"
  for run in single concurrent; do
    CUDA_VISIBLE_DEVICES=0 timeout 150 "$PYSPY" record --nonblocking --threads --subprocesses \
      -r 1000 -f raw -o "$OUT/spy-$run.raw" -- python3 benchmarks/bench_service.py --h200 \
      --no-ray --transports session-shm --phases $run --steps 20 \
      --out "$OUT/service-spy-$run.md" > "$OUT/spy-$run.log" 2>&1
    tail -4 "$OUT/service-spy-$run.md"
  done
  ;;
local-sessions)
  # The service benchmark over a local session (Unix socket) and over the gRPC stream, both
  # with shared-memory tensors; one call's timeline over each.
  CUDA_VISIBLE_DEVICES=0 timeout 330 python3 benchmarks/bench_service.py --h200 --no-ray \
    --transports local-shm,session-shm --out "$OUT/service-h200.md" > "$OUT/bench-service.log" 2>&1
  tail -16 "$OUT/service-h200.md"
  for t in local-shm session-shm; do
    CUDA_VISIBLE_DEVICES=0 timeout 100 python3 benchmarks/service_breakdown.py --device cuda \
      --layers 32 --steps 20 --transport $t 2>&1 | tail -14 | tee "$OUT/breakdown-$t.log"
  done
  ;;
profile-local-concurrency)
  # py-spy of the server's process through the concurrency runs over local sessions; then
  # those runs again with a shorter batching window.
  CUDA_VISIBLE_DEVICES=0 timeout 150 "$PYSPY" record --nonblocking --threads -r 500 -f raw \
    -o "$OUT/spy-concurrent.raw" -- python3 benchmarks/bench_service.py --h200 --no-ray \
    --transports local-shm --phases one_small,concurrent \
    --out "$OUT/service-spy.md" > "$OUT/spy.log" 2>&1
  tail -4 "$OUT/service-spy.md"
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 benchmarks/bench_service.py --h200 --no-ray \
    --transports local-shm --phases one_small,concurrent --batch-window-ms 0.2 \
    --out "$OUT/service-window.md" > "$OUT/window.log" 2>&1
  tail -4 "$OUT/service-window.md"
  ;;
final-local-sessions)
  # GPU tests of the changed kernels, pools, decode graphs and pinned regions; the decode
  # kernel table without FlexAttention; the service benchmark over a local session and
  # over the gRPC stream.
  timeout 150 python3 -m pytest -q -p no:cacheprovider -p no:benchmark -n 8 -m gpu \
    tests/test_decode_graphs.py tests/test_pinned_ranges.py tests/test_workers_gpu.py \
    tests/test_shared_memory.py tests/test_workers_pool.py tests/test_kernels_attention.py \
    tests/test_kernels_io.py tests/test_kernels_fingerprints.py tests/test_kernels_launch.py \
    > "$OUT/gpu-tests.log" 2>&1
  tail -8 "$OUT/gpu-tests.log"
  timeout 90 python3 benchmarks/bench_kernels.py --no-flex --only decode,write_kv \
    --out "$OUT/kernels" > "$OUT/kernels.log" 2>&1
  tail -22 "$OUT/kernels.log"
  CUDA_VISIBLE_DEVICES=0 timeout 300 python3 benchmarks/bench_service.py --h200 --no-ray \
    --transports local-shm,session-shm --out "$OUT/service-h200.md" > "$OUT/bench-service.log" 2>&1
  tail -16 "$OUT/service-h200.md"
  ;;
warm-up-profile)
  # The GPU tests of the kernel warm-up and the decode graphs; the service benchmark over a
  # local session (every run) and over the gRPC stream (one client of batch 32), pools
  # warmed and the collector frozen; py-spy of the server's process (wall time, idle kept)
  # through the concurrency runs over local sessions. PYSPY: the py-spy binary.
  timeout 100 python3 -m pytest -q -p no:cacheprovider -p no:benchmark -n 4 -m gpu \
    tests/test_kernel_warmup.py tests/test_decode_graphs.py > "$OUT/gpu-tests.log" 2>&1
  tail -4 "$OUT/gpu-tests.log"
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 benchmarks/bench_service.py --h200 --no-ray \
    --transports local-shm --out "$OUT/service-local.md" > "$OUT/bench-local.log" 2>&1
  tail -12 "$OUT/service-local.md"
  CUDA_VISIBLE_DEVICES=0 timeout 90 python3 benchmarks/bench_service.py --h200 --no-ray \
    --transports session-shm --phases single --out "$OUT/service-grpc.md" > "$OUT/bench-grpc.log" 2>&1
  grep "service," "$OUT/service-grpc.md"
  CUDA_VISIBLE_DEVICES=0 timeout 150 "$PYSPY" record --nonblocking --threads --idle -r 1000 \
    -f raw -o "$OUT/spy-concurrent.raw" -- python3 benchmarks/bench_service.py --h200 --no-ray \
    --transports local-shm --phases one_small,concurrent \
    --out "$OUT/service-spy.md" > "$OUT/spy.log" 2>&1
  tail -4 "$OUT/service-spy.md"
  ;;
batching-callers)
  # The servicer's and coordinator's CPU per part of coalesced rounds on this host (stubbed
  # pools, then the real CUDA pools); the concurrency runs over local sessions with the
  # batcher's expected callers, at three batching windows, and over the gRPC stream.
  for c in 1 8; do
    timeout 60 python3 benchmarks/diag_round_cost.py --clients $c --pinned 2>&1 | tail -1
  done
  timeout 90 python3 benchmarks/diag_round_cost.py --clients 8 --pinned --device cuda 2>&1 | tail -1
  for w in 0.5 0.2 0; do
    CUDA_VISIBLE_DEVICES=0 timeout 120 python3 benchmarks/bench_service.py --h200 --no-ray \
      --transports local-shm --phases one_small,concurrent --batch-window-ms $w \
      --out "$OUT/service-window-$w.md" > "$OUT/window-$w.log" 2>&1
    echo "window $w ms:"; grep "service," "$OUT/service-window-$w.md"
  done
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 benchmarks/bench_service.py --h200 --no-ray \
    --transports session-shm --phases one_small,concurrent \
    --out "$OUT/service-grpc.md" > "$OUT/grpc.log" 2>&1
  grep "service," "$OUT/service-grpc.md"
  ;;
batch-trace)
  # How the batcher forms rounds in the concurrency runs, over a local session and over
  # the gRPC stream (diag_batch_trace.py: every part's arrival, every batch's departure).
  for t in local-shm session-shm; do
    CUDA_VISIBLE_DEVICES=0 timeout 150 python3 benchmarks/diag_batch_trace.py \
      --trace "$OUT/trace-$t.jsonl" -- --h200 --no-ray --transports $t \
      --phases one_small,concurrent --out "$OUT/service-$t.md" > "$OUT/trace-$t.log" 2>&1
    grep "service," "$OUT/service-$t.md"; tail -5 "$OUT/trace-$t.log"
  done
  ;;
final-callers)
  # The service benchmark with the batcher's expected callers: pools in the server's
  # process over a local session and over the gRPC stream; then the pool behind a Ray actor
  # (the same GPU), over a local session to the coordinator.
  CUDA_VISIBLE_DEVICES=0 timeout 330 python3 benchmarks/bench_service.py --h200 --no-ray \
    --transports local-shm,session-shm --out "$OUT/service-h200.md" > "$OUT/bench-service.log" 2>&1
  tail -16 "$OUT/service-h200.md"
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 benchmarks/bench_service.py --h200 --no-in-process \
    --transports local-shm --out "$OUT/service-h200-ray.md" > "$OUT/bench-ray.log" 2>&1
  tail -12 "$OUT/service-h200-ray.md"; tail -3 "$OUT/bench-ray.log"
  ;;
joined-check)
  # The concurrency runs again after the round's joined finite check (one pass over a
  # shared round's inputs instead of three per part): over a local session, over gRPC.
  for t in local-shm session-shm; do
    CUDA_VISIBLE_DEVICES=0 timeout 95 python3 benchmarks/bench_service.py --h200 --no-ray \
      --transports $t --phases one_small,concurrent --out "$OUT/service-$t.md" \
      > "$OUT/bench-$t.log" 2>&1
    grep "service," "$OUT/service-$t.md"
  done
  ;;
tail-check)
  # Whether one client's p99 at batch 32 is the online correctness check (by default 1% of
  # worker rounds answer only once their reference is computed): the single-client run
  # with the service's default, without the check, and with checks of 2 sequences each,
  # alternating, over a local session.
  for f in default 0 seq2 default 0 seq2; do
    extra=""; [ "$f" = 0 ] && extra="--correctness-check-fraction 0"
    [ "$f" = seq2 ] && extra="--correctness-check-sequences 2"
    CUDA_VISIBLE_DEVICES=0 timeout 100 python3 benchmarks/bench_service.py --h200 --no-ray \
      --transports local-shm --phases single --steps 30 $extra \
      --out "$OUT/service-check-$f.md" > /dev/null 2>&1
    echo "check $f:"; grep "service," "$OUT/service-check-$f.md"
  done
  ;;
callers-pairs)
  # The service benchmark after the eighth session's last changes (connection callers, the
  # shared rounds' slot copy), the concurrency ratio as the lower of 2 alternating
  # pairs per transport.
  CUDA_VISIBLE_DEVICES=0 timeout 560 python3 benchmarks/bench_service.py --h200 --no-ray \
    --transports local-shm,session-shm --pairs 2 --out "$OUT/service-h200.md" \
    > "$OUT/bench-service.log" 2>&1
  tail -16 "$OUT/service-h200.md"
  ;;
ray-pairs)
  # The pool behind a Ray actor after the extra window for callers coming back from the
  # worker (rounds of everyone instead of two groups taking turns): 2 alternating pairs.
  CUDA_VISIBLE_DEVICES=0 timeout 400 python3 benchmarks/bench_service.py --h200 \
    --no-in-process --transports local-shm --pairs 2 --out "$OUT/service-h200-ray.md" \
    > "$OUT/bench-ray.log" 2>&1
  tail -12 "$OUT/service-h200-ray.md"
  ;;
ray-channel)
  # The worker channel (a Ray worker's per-layer calls over a Unix socket and shared memory,
  # not through Ray): its GPU test and the Ray actor tests on the GPU, then the service with
  # its pool behind a Ray actor, with the channel and without it (every call through Ray).
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider \
    tests/test_workers_gpu.py -k "channel or one_worker_per_gpu" 2>&1 | tee "$OUT/gpu-tests.log" \
    | tail -4
  CUDA_VISIBLE_DEVICES=0 timeout 400 python3 benchmarks/bench_service.py --h200 \
    --no-in-process --transports local-shm --ray-without-channel \
    --out "$OUT/service-h200-ray.md" > "$OUT/bench-ray.log" 2>&1
  tail -14 "$OUT/service-h200-ray.md"; grep "worker calls" "$OUT/service-h200-ray.md"
  ;;
channel-diag)
  # Where a worker-channel call's time goes on this host (benchmarks/diag_channel.py): the
  # call inside the actor, the channel's round trip, the server's answer and the call
  # within it, a no-op call's round trip, and the same call through Ray.
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 benchmarks/diag_channel.py --h200 --calls 640 \
    2>&1 | grep -v "WARNING\|INFO" | tee "$OUT/diag-channel.log"
  ;;
channel-final)
  # The worker channel with TCP and in-place region reads: its GPU tests (shared memory and
  # TCP), diag_channel both ways, one client at batch 32 with the pool in the server process
  # (the same host's reference), then the pool behind a Ray actor, 2 alternating pairs.
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider \
    tests/test_workers_gpu.py -k "channel or one_worker_per_gpu" 2>&1 | tee "$OUT/gpu-tests.log" \
    | tail -3
  for tcp in "" --tcp; do
    CUDA_VISIBLE_DEVICES=0 timeout 80 python3 benchmarks/diag_channel.py --h200 --calls 1000 \
      $tcp 2>&1 | grep -v "WARNING\|INFO" | tee -a "$OUT/diag-channel.log" | tail -8
  done
  CUDA_VISIBLE_DEVICES=0 timeout 100 python3 benchmarks/bench_service.py --h200 --no-ray \
    --transports local-shm --phases single --steps 20 --out "$OUT/service-single.md" \
    > "$OUT/bench.log" 2>&1
  grep "service,\|in-process" "$OUT/service-single.md"
  CUDA_VISIBLE_DEVICES=0 timeout 300 python3 benchmarks/bench_service.py --h200 --no-in-process \
    --transports local-shm --pairs 2 --out "$OUT/service-h200-ray.md" >> "$OUT/bench.log" 2>&1
  tail -12 "$OUT/service-h200-ray.md"
  ;;
ray-breakdown)
  # Where one per-layer call's time goes (service_breakdown.py, batch 32 at 2048, one client
  # over a local session), the pool in the server's process against the pool behind a Ray
  # actor over its worker channel, with the real pool and with a zero-cost one; then
  # diag_channel with the in-actor call timed back to back and 1 ms apart, on the actor's
  # thread and on a new one (is the channel's slower call the thread or the pause?).
  for stub in "" --stub; do
    for ray in "" --ray; do
      echo "== breakdown ${ray:-in-process} ${stub:-real}"
      CUDA_VISIBLE_DEVICES=0 timeout 150 python3 benchmarks/service_breakdown.py --device cuda \
        --layers 32 --steps 20 --transport local-shm $ray $stub 2>&1 | grep -v "WARNING\|INFO"
    done
  done 2>&1 | tee "$OUT/breakdown.log"
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 benchmarks/diag_channel.py --h200 --calls 1000 \
    2>&1 | grep -v "WARNING\|INFO" | tee "$OUT/diag-channel.log"
  ;;
ray-profile)
  # The channel's GPU tests (the shared-file case fixed after files-final); then where the
  # Ray path's time goes on this host: the breakdown behind the Ray actor with py-spy on
  # the server and the actor (needs .kern/py-spy carried), the same with the online
  # correctness check on (slot fingerprints recorded), and the Ray row's one-client run.
  channel_tests 150
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 benchmarks/service_breakdown.py --device cuda \
    --layers 32 --steps 100 --transport local-shm --ray --py-spy .kern/py-spy \
    --py-spy-out "$OUT" --py-spy-seconds 5 2>&1 | grep -v "WARNING\|INFO" \
    | tee "$OUT/breakdown.log"
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 benchmarks/service_breakdown.py --device cuda \
    --layers 32 --steps 40 --transport local-shm --ray --check-fraction 0.01 2>&1 \
    | grep -v "WARNING\|INFO" | tee "$OUT/breakdown-check.log"
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 benchmarks/bench_service.py --h200 --no-in-process \
    --transports local-shm --phases single --out "$OUT/service-ray-single.md" \
    > "$OUT/bench.log" 2>&1
  grep "service,\|in-process" "$OUT/service-ray-single.md"
  ;;
wire-final)
  # Tensor references as plain tuples on the worker channel (channel_wire.split / join):
  # the channel's GPU tests (shared arena, TCP, shared file), one call's breakdown behind
  # the Ray actor, then the Ray row with 2 alternating concurrency pairs.
  channel_tests 150
  CUDA_VISIBLE_DEVICES=0 timeout 100 python3 benchmarks/service_breakdown.py --device cuda \
    --layers 32 --steps 40 --transport local-shm --ray 2>&1 | grep -v "WARNING\|INFO" \
    | tee "$OUT/breakdown.log"
  ray_row 330 2 service-h200-ray
  ;;
decode-memo-pairs)
  # The Ray row alone with 3 alternating pairs, on one more host, after the decode memo
  # (02:39: cut at 330 s with no report, so the time limit is wider and each run prints
  # its figures as it ends).
  ray_row 450 3 service-h200-ray
  ;;
pages-plans)
  # The Ray row (2 alternating pairs) once rounds over pages of several layers reuse
  # their recorded steps' plan (the profile-memo call found them planning every round).
  ray_row 300 2 service-h200-ray
  grep '^\[' "$OUT/service-h200-ray.log"
  ;;
timeline)
  # Where a lone batch-32 call's wall time goes behind the Ray actor: the server's
  # probes (diag_call_timeline.py: before the worker, the worker, after it, the client's
  # turn), then py-spy (.kern/py-spy carried) over every process of the same run
  # (server, Ray actor, client), idle samples included, to split the worker's and the
  # client's stretches.
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 benchmarks/diag_call_timeline.py --h200 \
    --no-in-process --transports local-shm --phases single --steps 20 \
    --out "$OUT/timeline.md" > "$OUT/timeline.log" 2>&1
  tail -9 "$OUT/timeline.log"
  CUDA_VISIBLE_DEVICES=0 timeout 170 .kern/py-spy record --subprocesses --idle --nonblocking \
    --threads -r 250 -f raw -o "$OUT/spy-all.raw" -- python3 benchmarks/bench_service.py \
    --h200 --no-in-process --transports local-shm --phases single --steps 20 \
    --out "$OUT/service-spy.md" > "$OUT/spy.log" 2>&1
  grep '^\[' "$OUT/spy.log"; ls -la "$OUT"
  ;;
timeline-spy)
  # The timeline's run (150 steps) under py-spy (.kern/py-spy carried) over every process
  # (server, Ray actor, client), idle samples included; the raw profile comes back
  # gzipped, with its per-thread summary and the trees below the worker channel's answer
  # (in the actor) and the client's exchange.
  CUDA_VISIBLE_DEVICES=0 timeout 240 .kern/py-spy record --subprocesses --idle --nonblocking \
    --threads -r 200 -f raw -o "$OUT/spy-all.raw" -- python3 benchmarks/diag_call_timeline.py \
    --h200 --no-in-process --transports local-shm --phases single --steps 150 \
    --out "$OUT/timeline.md" > "$OUT/timeline.log" 2>&1
  tail -9 "$OUT/timeline.log"
  python3 benchmarks/spy_summary.py "$OUT/spy-all.raw" --top 40 --min-samples 500 > "$OUT/spy-summary.txt"
  for f in _answer _exchange _run_once; do
    python3 benchmarks/spy_summary.py "$OUT/spy-all.raw" --under $f --depth 7 --min-share 0.005
  done > "$OUT/spy-trees.txt"
  gzip -f "$OUT/spy-all.raw"; ls -la "$OUT"
  ;;
timeline-worker)
  # The timeline with the worker's own marks (diag_call_timeline.py installs probes in
  # the Ray actor's process): the worker's stretch split into the hops, its reading, the
  # pool's call and the reply.
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 benchmarks/diag_call_timeline.py --h200 \
    --no-in-process --transports local-shm --phases single --steps 60 \
    --out "$OUT/timeline.md" > "$OUT/timeline.log" 2>&1
  tail -24 "$OUT/timeline.log"
  ;;
repeats|refills)
  # The Ray row (2 alternating pairs) once a decode step's other layers go over the
  # worker channel as repeats of its first call (workers.channel_wire, "repeat"; repeats:
  # files and index tensors only), and once repeats also refill tensors copied into the
  # arena (rounds of several callers), carry changed slots and keywords, and the pool of
  # channels hands a call the connection whose last call it repeats (refills).
  ray_row 330 2 service-h200-ray
  grep '^\[\|repeats' "$OUT/service-h200-ray.log"
  ;;
loop-idle)
  # Why the coordinator's loop sits idle in the Ray row's concurrency pair
  # (diag_loop_idle.py: each idle stretch put down to what the loop waited for), then the
  # same pair under py-spy (.kern/py-spy carried) of the server's process, its threads
  # apart, gzipped, with the trees below the local session's call and the loop's turn.
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 benchmarks/diag_loop_idle.py --h200 \
    --no-in-process --transports local-shm --phases concurrent --pairs 1 \
    --out "$OUT/idle.md" > "$OUT/idle.log" 2>&1
  sed -n '/^## Concurrency/,$p' "$OUT/idle.log" | grep -v '^$'
  CUDA_VISIBLE_DEVICES=0 timeout 200 .kern/py-spy record --nonblocking --threads -r 1000 \
    -f raw -o "$OUT/spy-server.raw" -- python3 benchmarks/bench_service.py --h200 \
    --no-in-process --transports local-shm --phases concurrent --pairs 1 \
    --out "$OUT/service-spy.md" > "$OUT/spy.log" 2>&1
  tail -5 "$OUT/service-spy.md"
  python3 benchmarks/spy_summary.py "$OUT/spy-server.raw" --top 40 --min-samples 500 \
    > "$OUT/spy-summary.txt"
  for f in _run_once _Connection._call _run_parts; do
    python3 benchmarks/spy_summary.py "$OUT/spy-server.raw" --under $f --depth 14 \
      --min-share 0.004
  done > "$OUT/spy-trees.txt"
  gzip -f "$OUT/spy-server.raw"; ls -la "$OUT"
  ;;
loop-idle-check)
  # diag_loop_idle.py's concurrency pair with the service's default correctness check
  # (0.01 of rounds) and without it (0): idle by cause, where the clients were, the worker
  # channel's stretches.
  for f in 0.01 0; do
    CUDA_VISIBLE_DEVICES=0 timeout 160 python3 benchmarks/diag_loop_idle.py --h200 \
      --no-in-process --transports local-shm --phases concurrent --pairs 1 \
      --correctness-check-fraction $f --out "$OUT/idle-$f.md" > "$OUT/idle-$f.log" 2>&1
    echo "== check fraction $f"; grep '^\[' "$OUT/idle-$f.log"
    sed -n '/^## Where/,$p' "$OUT/idle-$f.log" | grep -v '^$'
  done
  ;;
check-cost)
  # The online correctness check's recomputation batched over sequences on CUDA
  # (kernels.attention_torch): its GPU test, the check's cost per round against the
  # per-sequence loop (diag_check_cost.py, in process), then diag_loop_idle.py's
  # concurrency run with the service's default check (0.01 of rounds).
  timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider \
    tests/test_kernels_attention_torch.py 2>&1 | tail -2
  timeout 200 python3 benchmarks/diag_check_cost.py 2>&1 | tee "$OUT/check-cost.md"
  CUDA_VISIBLE_DEVICES=0 timeout 160 python3 benchmarks/diag_loop_idle.py --h200 \
    --no-in-process --transports local-shm --phases concurrent --pairs 1 \
    --out "$OUT/idle.md" > "$OUT/idle.log" 2>&1
  grep '^\[' "$OUT/idle.log"; sed -n '/^## Where/,$p' "$OUT/idle.log" | grep -v '^$'
  ;;
checks-after)
  # Online correctness checks after the answer (cache_service.running_checks): the GPU
  # tests of the batched torch path and of the channel, then the Ray row with 2 pairs.
  timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider \
    tests/test_kernels_attention_torch.py 2>&1 | tail -1
  channel_tests 110
  ray_row 330 2 service-h200-ray
  grep '^\[\|repeats' "$OUT/service-h200-ray.log"
  ;;
checks-final)
  # The check's worker side on the device (fingerprints built there, the batched
  # reference): the GPU tests of both, the check's cost per round in process with a
  # profile of reference_attend, then the Ray row with 2 pairs.
  timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider \
    tests/test_kernels_attention_torch.py tests/test_kernels_fingerprints.py 2>&1 | tail -1
  timeout 120 python3 benchmarks/diag_check_cost.py --batches 8,32 --profile 32 2>&1 \
    | tee "$OUT/check-cost.md" | head -4
  ray_row 320 2 service-h200-ray
  grep '^\[\|repeats' "$OUT/service-h200-ray.log"
  ;;
pairs-no-check)
  # The Ray row's concurrency pairs with the online correctness check off (fraction 0):
  # what the check costs the concurrent runs, on the time left.
  ray_row 225 2 service-h200-nocheck --phases one_small,concurrent \
    --correctness-check-fraction 0
  grep '^\[' "$OUT/service-h200-nocheck.log"
  ;;
refills-final)
  # The channel's GPU tests (repeats over a CUDA pool's shared files and arena), then the
  # Ray row with one concurrency pair, on the time left.
  channel_tests 110
  ray_row 190 1 service-h200-ray
  grep '^\[\|repeats' "$OUT/service-h200-ray.log"
  ;;
profile-memo)
  # Where the coordinator's CPU goes in the Ray row's concurrent run after the decode memo:
  # py-spy (.kern/py-spy carried) on the server's process, samples of the thread holding
  # the GIL only, through one concurrent run (8 clients of batch 8).
  CUDA_VISIBLE_DEVICES=0 timeout 240 .kern/py-spy record --nonblocking --gil -r 500 -f raw \
    -o "$OUT/spy-server.raw" -- python3 benchmarks/bench_service.py --h200 --no-in-process \
    --transports local-shm --phases concurrent --out "$OUT/service-spy.md" > "$OUT/spy.log" 2>&1
  grep '^\[' "$OUT/spy.log"
  ;;
locks-final|default-pairs)
  # The Ray row alone (2 alternating concurrency pairs), on whatever time is left: after
  # the batch locks (cache_service.sequence_locks, locks-final); with the default
  # configuration on one more host (default-pairs).
  ray_row 270 2 service-h200-ray
  ;;
overlap)
  # Two groups of callers taking turns on the worker (coordinator.overlap_rounds) against
  # one round for all: the batching simulation at costs near this host's, then the Ray
  # row's concurrency pairs with overlap on, then the whole Ray row with it off (as
  # locks-final). The reports carry the server loop's CPU per call and busy share.
  for o in "" --overlap; do
    timeout 40 python3 benchmarks/diag_batching_sim.py --clients 8 --part-us 230 \
      --reply-us 50 --round-us 830 --round-part-us 0 --async-worker --think-us 100 \
      --jitter-us 50 --calls 400 $o 2>&1 | tail -3 | tee -a "$OUT/sim.log"
  done
  ray_row 210 2 service-h200-overlap --phases one_small,concurrent \
    --set coordinator.overlap_rounds=true
  ray_row 270 2 service-h200-ray
  ;;
overlap-final|decode-memo)
  # The default configuration once two groups of callers taking turns became the default
  # for workers in another process (first by timing, 00:04; then always, after), and
  # again once the servicer kept a decode step's decoded calls for its other layers
  # (decode-memo): the channel's GPU tests, then the Ray row with 3 alternating pairs.
  channel_tests 120
  ray_row 330 3 service-h200-ray
  ;;
files-final)
  # Tensors in a client's shared region reach the Ray worker in place (the worker maps the
  # region's file): the channel's GPU tests (shared arena, TCP, shared file), one call's
  # breakdown behind the Ray actor, one client at batch 32 with the pool in the server
  # process (this host's reference), then the pool behind a Ray actor, 2 alternating pairs.
  channel_tests 150
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 benchmarks/service_breakdown.py --device cuda \
    --layers 32 --steps 20 --transport local-shm --ray 2>&1 | grep -v "WARNING\|INFO" \
    | tee "$OUT/breakdown.log"
  CUDA_VISIBLE_DEVICES=0 timeout 100 python3 benchmarks/bench_service.py --h200 --no-ray \
    --transports local-shm --phases single --steps 20 --out "$OUT/service-single.md" \
    > "$OUT/bench.log" 2>&1
  grep "service,\|in-process" "$OUT/service-single.md"
  CUDA_VISIBLE_DEVICES=0 timeout 330 python3 benchmarks/bench_service.py --h200 --no-in-process \
    --transports local-shm --pairs 2 --out "$OUT/service-h200-ray.md" >> "$OUT/bench.log" 2>&1
  tail -12 "$OUT/service-h200-ray.md"
  ;;
uvloop)
  # The coordinator on uvloop (server.event_loop, sixteenth session): the Ray row with 2
  # pairs on uvloop, then the concurrency pair on asyncio's loop on the same host.
  python3 -c "import uvloop; print('uvloop', uvloop.__version__)"
  ray_row 300 2 service-h200-ray --event-loop uvloop
  ray_row 210 1 service-h200-asyncio --event-loop asyncio --phases one_small,concurrent
  ;;
uvloop-diag)
  # The coordinator's CPU per call on each event loop, alternating, without the 8-client
  # Ray run's noise: in process over the real CUDA pools (no sockets), then with local-
  # session clients in their own processes over zero-cost pools (sockets, no GPU).
  for i in 1 2 3; do
    for loop in asyncio uvloop; do
      CUDA_VISIBLE_DEVICES=0 timeout 60 python3 benchmarks/diag_round_cost.py --device cuda \
        --pinned --clients 8 --steps 24 --event-loop $loop 2>&1 | tail -1 | tee -a "$OUT/round-cost.log"
    done
  done
  for i in 1 2 3; do
    for loop in asyncio uvloop; do
      timeout 90 python3 benchmarks/diag_concurrency_stub.py --clients 8 --steps 20 \
        --event-loop $loop 2>&1 | grep clients= | tee -a "$OUT/concurrency-stub.log"
    done
  done
  ;;
pairs-four)
  # The session's final code on its default loop (asyncio): the Ray row with 4 alternating
  # concurrency pairs, for the spread of the ratio on one host.
  ray_row 540 4 service-h200-ray
  ;;
p99-check)
  # What the online correctness check costs a lone batch-32 client's tail: the Ray row's
  # single-client run (30 steps) with the service's default check, then with it off.
  ray_row 170 1 single-check --phases single --steps 30
  ray_row 170 1 single-no-check --phases single --steps 30 --correctness-check-fraction 0
  ;;
check-unlocked)
  # The check's recomputation outside the worker's lock: the pool GPU tests that call
  # reference_attend on CUDA, then the single-client Ray row with the default check (the
  # figure p99-check read at 16.6 ms p99 with the lock held).
  timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_decode_graphs.py \
    tests/test_workers_pool.py -k "through_graphs or fingerprints or outside_the_workers_lock" \
    2>&1 | tail -2 | tee "$OUT/gpu-tests.log"
  ray_row 150 1 single-check --phases single --steps 30
  ;;
check-interference)
  # How much the online correctness check costs the concurrency pairs: 2 pairs with the
  # service's default check, then 2 with it off, on one host.
  ray_row 250 2 pairs-check --phases one_small,concurrent
  ray_row 250 2 pairs-no-check --phases one_small,concurrent --correctness-check-fraction 0
  ;;
rows-final)
  # The seventeenth session's code (each caller's rows of a round cut by one split, the
  # batch's rows kept with the decode memo): the tests of graphs and checks side by side
  # and the pool's, then the whole Ray row with 3 alternating concurrency pairs.
  timeout 120 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_decode_graphs.py \
    tests/test_workers_pool.py 2>&1 | tail -40 | tee "$OUT/gpu-tests.log"
  ray_row 420 3 service-h200-ray
  ;;
callbacks)
  # The eighteenth session: a local session's repeated layers answered from their round's
  # callback (no task per call). The whole Ray row with 2 alternating concurrency pairs,
  # then 2 pairs on the same host with server.local_session_callbacks off (a task per call).
  ray_row 300 2 service-h200-ray
  ray_row 250 2 pairs-tasks-only --phases one_small,concurrent \
    --set server.local_session_callbacks=false
  ;;
profile-concurrent)
  # Where the coordinator's event-loop thread spends a concurrent call behind Ray: the
  # in-process diagnostic (no sockets, zero-cost pools) with the callback path, alone and at
  # 8 clients; then the Ray row's concurrent run under cProfile (that thread only).
  for c in 1 8; do
    timeout 60 python3 benchmarks/diag_round_cost.py --clients "$c" --pinned --now 2>&1 | tail -1
  done
  ray_row 220 1 profile-concurrent --phases concurrent --profile-ray concurrent \
    --profile-out "$OUT/ray-profile.txt"
  grep "^\[" "$OUT/profile-concurrent.log"
  ;;
pinned-loop)
  # The host's CPU topology; the whole Ray row with the coordinator's event-loop thread on a
  # core of its own (--loop-cpu: clients and Ray kept off that core), 2 pairs; then 2 pairs
  # unpinned on the same host.
  lscpu | grep -E "Model name|Thread|Core|Socket|NUMA node|MHz"
  echo "cpu2 siblings: $(cat /sys/devices/system/cpu/cpu2/topology/thread_siblings_list)"
  ray_row 300 2 service-h200-ray --loop-cpu 2
  grep -h "^\[\|event loop" "$OUT/service-h200-ray.log"
  ray_row 240 2 pairs-unpinned --phases one_small,concurrent
  grep -h "^\[" "$OUT/pairs-unpinned.log"
  ;;
threads)
  # The busiest threads (server, clients, Ray worker) over each timed run of 2 concurrency
  # pairs: what sets the pace when the event loop is not saturated.
  ray_row 300 2 pairs-threads --phases one_small,concurrent --threads
  grep -h "^\[\|busiest" "$OUT/pairs-threads.log"
  ;;
gc-runs)
  # Two concurrent runs back to back: how much time the collector takes in each (the
  # second concurrent run of a pair was the slower in 4 of 5 pairs this session).
  ray_row 250 2 concurrent-gc --phases concurrent
  grep -h "^\[" "$OUT/concurrent-gc.log"
  ;;
loop-split)
  # Where the event loop's CPU per call goes on the real path (twentieth session). The pool
  # tests of rounds over pages (checked on the device, results page-locked); the Ray row
  # with 3 pairs, each run's line giving the loop thread's user / system time and sleeps
  # per call and its rounds (how many over pages of two layers); 2 pairs with
  # coordinator.coalesce_layers off (no round over pages); one concurrent run under
  # cProfile (forks: all steady decode).
  timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_workers_pool.py \
    -k "page or checked" 2>&1 | tail -3
  ray_row 230 3 service-h200-split --phases one_small,concurrent
  grep -h "^\[" "$OUT/service-h200-split.log"
  ray_row 170 2 no-coalesce --phases one_small,concurrent \
    --set coordinator.coalesce_layers=false
  grep -h "^\[" "$OUT/no-coalesce.log"
  ray_row 150 1 profile-forks --phases concurrent --profile-ray concurrent \
    --profile-out "$OUT/ray-profile.txt"
  grep -h "^\[" "$OUT/profile-forks.log"
  ;;
parts)
  # Rounds over pages in parts (twenty-first session): the coordinator hands the worker
  # each caller's query, keys and values where the caller put them and each caller's
  # output slot, instead of joining them into the channel's arena and copying the output
  # out again on its event loop. The GPU tests of parts (pool, stager, worker channel);
  # the Ray row with 6 pairs; one concurrent run under cProfile.
  timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_workers_pool.py \
    tests/test_workers_gpu.py -k "parts or stager or page or checked or channel" 2>&1 | tail -3
  ray_row 290 6 service-h200-parts --phases one_small,concurrent
  grep -h "^\[" "$OUT/service-h200-parts.log"
  ray_row 110 1 profile-parts --phases concurrent --profile-ray concurrent \
    --profile-out "$OUT/ray-profile.txt"
  grep -h "^\[" "$OUT/profile-parts.log"
  ;;
worker-busy)
  # How busy the Ray worker is when the loop is not (twenty-first session): its lock's
  # share of a concurrent run, each call kind's time under it and the pool's steps inside
  # (diag_worker_busy.py).
  worker_busy 200 32
  ;;
layers)
  # Rounds over several layers replayed as CUDA graphs (twenty-first session): the worker
  # gets the round's per-layer metadata under its plan's key and each sequence's and new
  # token's layer (KVPool.write_and_attend_layers), makes the pages on the device, and
  # replays one graph per round shape whichever layers. The GPU tests of it (pool, decode
  # graphs, stager, worker channel); the worker's time per call kind in a concurrent run
  # (diag_worker_busy.py); the Ray row with 5 pairs.
  worker_round_tests 150
  worker_busy 150 32
  ray_row 260 5 service-h200-layers --phases one_small,concurrent
  grep -h "^\[" "$OUT/service-h200-layers.log"
  ;;
final-layers)
  # The session's final code (twenty-first session: shared rounds in parts and over
  # layers, replayed as graphs; their channel calls repeated): the GPU tests of it and the
  # whole Ray row with 8 pairs.
  worker_round_tests 120
  ray_row 400 8 service-h200-ray
  grep -h "^\[" "$OUT/service-h200-ray.log"
  ;;
host-copies)
  # A round's host copies without GIL releases (twenty-second session): the stager packs
  # parts with memmove (workers.host_bytes), a round's output reaches its callers' parts
  # through one pinned transfer with the finite flag and one wait, stand-ins are kept by
  # shape. The GPU tests of it; the worker's time per call kind (diag_worker_busy.py, now
  # with the metadata's reloads); the Ray row with 6 pairs.
  worker_round_tests 150
  worker_busy 120 36
  ray_row 280 6 service-h200-copies --phases one_small,concurrent
  grep -h "^\[" "$OUT/service-h200-copies.log"
  ;;
final-copies)
  # The session's final code (twenty-second session): the GPU tests of the worker's round
  # and the whole Ray row with 8 pairs.
  worker_round_tests 120
  ray_row 400 8 service-h200-ray
  grep -h "^\[" "$OUT/service-h200-ray.log"
  ;;
forks-pairs)
  # The Ray row with the runs decoding forks of sequences filled once (bench_service's
  # default since the eighteenth session: a run costs its steps, not a fill of 16 GiB), so
  # 8 alternating concurrency pairs fit one call.
  ray_row 540 8 service-h200-ray
  grep -h "^\[" "$OUT/service-h200-ray.log"
  ;;
checks-ab)
  # What the online correctness check (0.01 of rounds, after the answer) costs the
  # concurrency ratio: 10 alternating pairs in one service, the even-numbered ones with
  # the check set aside (bench_service --alternate-checks).
  ray_row 560 10 service-h200-checks --phases one_small,concurrent --alternate-checks
  grep -h "^\[" "$OUT/service-h200-checks.log"
  ;;
graphs-beside-checks)
  # The online check's recomputation (outside the worker's lock) beside a worker's first
  # replays, which capture CUDA graphs, three times: steps and checks must both be right.
  t=tests/test_decode_graphs.py::test_checks_beside_the_first_replays_disturb_neither_the_steps_nor_the_checks
  for i in 1 2 3; do
    timeout 60 python3 -m pytest -x -q -p no:cacheprovider --tb=short "$t" 2>&1 | tail -25 \
      | tee "$OUT/graphs-beside-checks-$i.log"
  done
  ;;
local-pairs)
  # The pool in the server's process over a local session, 2 alternating concurrency
  # pairs: the two targets on the session's last code (the in-process path did
  # not change this session but for the data-call counter).
  CUDA_VISIBLE_DEVICES=0 timeout 320 python3 benchmarks/bench_service.py --h200 --no-ray \
    --transports local-shm --pairs 2 --out "$OUT/service-h200.md" > "$OUT/bench.log" 2>&1
  tail -12 "$OUT/service-h200.md"
  ;;
profile-server)
  # One client's timeline at batch 32 (service_breakdown), then py-spy on the server's
  # process alone (idle samples kept: wall time) through a single-client run.
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 benchmarks/service_breakdown.py --device cuda \
    --layers 32 --steps 20 2>&1 | tail -14 | tee "$OUT/service-breakdown.log"
  CUDA_VISIBLE_DEVICES=0 timeout 200 "$PYSPY" record --nonblocking --threads --idle \
    -r 2000 -f raw -o "$OUT/spy-single.raw" -- python3 benchmarks/bench_service.py --h200 \
    --no-ray --transports session-shm --phases single --steps 40 \
    --out "$OUT/service-spy-single.md" > "$OUT/spy-single.log" 2>&1
  tail -3 "$OUT/spy-single.log"; grep "service," "$OUT/service-spy-single.md"
  ;;
graphs-service)
  # The GPU tests of the pool (CUDA-graph replay included), the pool call's breakdown with
  # and without graphs, one service call's breakdown, the service benchmark.
  timeout 150 python3 -m pytest -q -p no:cacheprovider -p no:benchmark -n 8 -m gpu \
    tests/test_decode_graphs.py tests/test_workers_pool.py tests/test_workers_gpu.py \
    tests/test_kernels_fingerprints.py > "$OUT/gpu-tests.log" 2>&1
  tail -15 "$OUT/gpu-tests.log"
  timeout 60 python3 benchmarks/pool_call_breakdown.py 2>&1 | tee "$OUT/pool-breakdown.log"
  timeout 60 python3 benchmarks/pool_call_breakdown.py --no-graphs 2>&1 | tee -a "$OUT/pool-breakdown.log"
  CUDA_VISIBLE_DEVICES=0 timeout 90 python3 benchmarks/service_breakdown.py --device cuda \
    --layers 32 --steps 10 2>&1 | tail -8 | tee "$OUT/service-breakdown.log"
  CUDA_VISIBLE_DEVICES=0 timeout 170 python3 benchmarks/bench_service.py --h200 --no-ray \
    --transports session-shm --out "$OUT/service-h200.md" > "$OUT/bench-service.log" 2>&1
  tail -14 "$OUT/service-h200.md"
  timeout 60 python3 benchmarks/diag_grpc_floor.py --calls 2000 2>&1 | tee "$OUT/grpc-floor.log"
  ;;
merge-kernels-service)
  # The GPU tests of kernels and pools; the split path's two fused merges paired with SDPA
  # (diag_merge.py names the winner), the kernel benchmark with the winner; the service
  # benchmark over the Session stream with shared memory (fits a 7-minute device budget).
  timeout 100 python3 -m pytest -q -p no:cacheprovider -p no:benchmark -n 8 -m gpu \
    tests/test_kernels_attention.py tests/test_kernels_io.py tests/test_kernels_fingerprints.py \
    tests/test_workers_pool.py tests/test_workers_gpu.py > "$OUT/gpu-tests.log" 2>&1
  tail -3 "$OUT/gpu-tests.log"
  timeout 90 python3 benchmarks/diag_merge.py --out "$OUT/diag-merge.json" > "$OUT/diag-merge.log" 2>&1
  tail -22 "$OUT/diag-merge.log"
  winner=$(grep '^WINNER:' "$OUT/diag-merge.log" | tail -1 | sed 's/WINNER: *//')
  timeout 120 python3 benchmarks/bench_kernels.py --out "$OUT/kernels" \
    --merge-reads "${winner:-serial}" > "$OUT/bench-kernels.log" 2>&1
  tail -30 "$OUT/bench-kernels.log"
  CUDA_VISIBLE_DEVICES=0 timeout 170 python3 benchmarks/bench_service.py --h200 --no-ray \
    --transports session-shm --out "$OUT/service-h200.md" > "$OUT/bench-service.log" 2>&1
  tail -12 "$OUT/service-h200.md"
  ;;
*) echo "unknown phase $phase" >&2; exit 2 ;;
esac
