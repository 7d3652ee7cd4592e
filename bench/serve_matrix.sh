#!/usr/bin/env bash
# The served-path benchmark of docs/served-performance.md, one job at a time:
#   bash bench/serve_matrix.sh colocated|disagg [OUT_DIR]
# starts `pdserve up` (SmolLM2 fp32, prefix caching off), runs `pdserve bench serve` with 64
# random prompts of 256 -> 128 tokens (EOS ignored) at rate 2 and all at once, greedy and at
# temperature 1.0, reads the engine's step breakdown (serve_profile) during the saturated
# temperature-1.0 run, stops the stack, then runs `pdserve bench offline` on the same workload.
# The offline peer runs at the threads of the instance that decodes: colocated 2 threads on
# both cores; disagg 1 thread pinned to the decode core (the decode instance's share).
# OFFLINE=0 skips the offline part (an A/B of two checkouts shares one offline peer).
# SIDE_CPUS=0 pins the stack's other processes (redis, KV store, router) and the client to
# those cores once the stack is up (default: unpinned, they run where the scheduler puts them).
set -euo pipefail
MODE=${1:-colocated}
OUT=${2:-/tmp/pdserve-serve-matrix-$MODE}
PY=${PY:-python}
PDS=${PDS:-pdserve}
PORT=${PORT:-18431}
mkdir -p "$OUT"
export OMP_NUM_THREADS=2
if [ "$MODE" = colocated ]; then
  STACK=(--mode colocated --num-threads 2 --cpus 0,1)
  PEER=(); PEER_THREADS=2
else
  STACK=(--mode disagg --prefill-cpus 0 --decode-cpus 1)
  PEER=(taskset -c 1); PEER_THREADS=1
fi
source "$(dirname "$0")/stack_up.sh"
stack_up "$OUT" "$PORT" $PDS up "${STACK[@]}" --model smollm2 --weights fp32 --no-prefix-caching
grep -E "memory budget|KV cache" "$OUT/up.log" || true
ENGINE=$(grep -E "^  (unified|decode) " "$OUT/up.log" | head -1 | awk '{print $2}')
ROUTER_PID=$(pgrep -f "serve router .*--port $PORT " | head -1 || true)
SIDE=()
if [ -n "${SIDE_CPUS:-}" ]; then
  SIDE=(taskset -c "$SIDE_CPUS")
  for name in redis kvstore router; do
    pid=$($PY -c "import json,sys; print(json.load(open(sys.argv[1])).get('$name', ''))" \
      "$OUT/logs/services.json")
    for p in $pid $(pgrep -P "${pid:-0}" || true); do  # every thread, and any child
      taskset -a -p -c "$SIDE_CPUS" "$p" > /dev/null
    done
  done
fi
W=(--workload random --num-prompts 64 --input-len 256 --output-len 128 --no-progress
   --base-url "http://127.0.0.1:$PORT")
# Every run its own prompts (seed): disagg's KV store keeps what prefill saved, so a prompt
# seen before is a store hit and skips prefill (--no-prefix-caching is the engines' own cache).
SEED=0
"${SIDE[@]}" $PDS bench serve "${W[@]}" --seed 100 --num-prompts 4 --rate inf \
  --out-dir "$OUT/warm" > /dev/null
for T in 1.0 0.0; do
  for RATE in 2 inf; do
    if [ "$T" = 1.0 ] && [ "$RATE" = inf ]; then
      # from the first decode-only steps (past the prompts' prefill: all arrive at once)
      # to the run's end; the router's CPU per generated token beside the engine's steps
      "${SIDE[@]}" $PY -m pdserve.bench.serve_profile --engine "$ENGINE" --decode-window 600 \
        ${ROUTER_PID:+--router-pid "$ROUTER_PID"} \
        > "$OUT/profile.txt" 2>&1 &
      PROF=$!
    fi
    if [ "$T" = 1.0 ] && [ "$RATE" = 2 ]; then
      "${SIDE[@]}" $PY -m pdserve.bench.serve_step_trace --engine "$ENGINE" --after-first-step 600 \
        --delay 2 --duration "${TRACE_S:-30}" --poll-ms 40 > "$OUT/trace.txt" 2>&1 &
      TRACE=$!
    fi
    SEED=$((SEED + 1))
    "${SIDE[@]}" $PDS bench serve "${W[@]}" --seed "$SEED" --rate "$RATE" --temperature "$T" \
      --out-dir "$OUT/serve-t$T-r$RATE" | tail -1 | sed "s/^/serve t=$T rate=$RATE /"
  done
done
wait "${PROF:-}" 2>/dev/null || true
wait "${TRACE:-}" 2>/dev/null || true
echo "profile:"; cat "$OUT/profile.txt"
echo "steps at rate 2:"; cat "$OUT/trace.txt"
stack_down
[ "${OFFLINE:-1}" = 0 ] && exit 0
for T in 0.0 1.0; do
  "${PEER[@]}" $PDS bench offline --model smollm2 --weights fp32 --num-prompts 64 \
    --input-len 256 --output-len 128 --num-threads "$PEER_THREADS" --skip-hf --repeats 1 \
    --temperature "$T" --no-prefix-caching | tail -1 \
    | sed "s/^/offline t=$T /"
done
OS=(--weights fp32 --num-threads "$PEER_THREADS" --no-prefix-caching --temperature 1.0)
"${PEER[@]}" $PY -m pdserve.bench.offline_step "${OS[@]}" --batch 2 4 8 16 32 48 64 | tail -1 \
  | tee "$OUT/offline_step.json" | sed "s/^/offline decode step /"  # bench/itl_peer.py reads it
[ "${BESIDE_LOAD:-}" = none ] && exit 0
"${PEER[@]}" $PY -m pdserve.bench.offline_step "${OS[@]}" --batch 16 64 \
  --beside-load "${BESIDE_LOAD:-3/15}" | tail -1 | sed "s/^/offline decode step, beside load /"
