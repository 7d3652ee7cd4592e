#!/usr/bin/env bash
# Sourced by the served-path benchmarks (serve_matrix.sh, serve_rate2.sh): one place that
# starts `pdserve up` and waits for it, so the scripts cannot drift apart.
#   stack_up OUT PORT CMD...   runs `CMD... --insecure --port PORT --grpc-port PORT+1
#                              --discovery static --log-dir OUT/logs` in the background
#                              (output in OUT/up.log), sets UP to its pid, stops it on EXIT,
#                              and returns once it printed "ready" (exits 1 with the log if
#                              not within 300 s)
#   stack_down                 stops it (SIGTERM, waits) and drops the EXIT trap
stack_up() {
  local out=$1 port=$2
  shift 2
  "$@" --insecure --port "$port" --grpc-port $((port + 1)) --discovery static \
    --log-dir "$out/logs" > "$out/up.log" 2>&1 &
  UP=$!
  trap 'kill -TERM $UP 2>/dev/null; wait $UP 2>/dev/null || true' EXIT
  for _ in $(seq 600); do grep -q "^ready" "$out/up.log" && break; sleep 0.5; done
  grep -q "^ready" "$out/up.log" || { cat "$out/up.log"; exit 1; }
}

stack_down() {
  kill -TERM "$UP"
  wait "$UP" || true
  trap - EXIT
}
