#!/usr/bin/env bash
# (Re)start the coordinator on the head node of a `ray up` cluster, in the background, with
# its log in ~/kvcache-coordinator.log. Run by head_start_ray_commands, and by hand after an
# upgrade:  ray exec deploy/ray/cluster-aws.yaml 'bash ~/kvcache-deploy/start-coordinator.sh'
set -euo pipefail
# The cluster runs with Ray token authentication (the token is ~/.ray/auth_token).
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
here="$(cd "$(dirname "$0")" && pwd)"
config="${KVCACHE_CONFIG:-$here/kvcache.yaml}"
pidfile="$HOME/kvcache-coordinator.pid"
log="$HOME/kvcache-coordinator.log"

if [[ -f "$pidfile" ]] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
  old="$(cat "$pidfile")"
  echo "stopping coordinator pid $old"
  kill -TERM "$old"
  # The server drains in-flight calls (server.shutdown_grace_s) before it exits.
  for _ in $(seq 1 60); do kill -0 "$old" 2>/dev/null || break; sleep 1; done
  kill -0 "$old" 2>/dev/null && kill -KILL "$old"
fi

nohup kvcache serve --config "$config" >>"$log" 2>&1 &
echo $! >"$pidfile"
echo "coordinator pid $(cat "$pidfile"), log $log"

# Wait (bounded) until its gRPC health service answers SERVING.
for _ in $(seq 1 120); do
  if python -m cache_service.health_probe --address 127.0.0.1:50051 --timeout 2 >/dev/null 2>&1; then
    echo "coordinator is serving"
    exit 0
  fi
  kill -0 "$(cat "$pidfile")" 2>/dev/null || { echo "coordinator exited; see $log" >&2; exit 1; }
  sleep 1
done
echo "coordinator did not become healthy within 120 s; see $log" >&2
exit 1
