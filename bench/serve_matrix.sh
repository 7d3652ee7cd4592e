#!/usr/bin/env bash
# The served-path benchmark of docs/served-performance.md, one job at a time:
#   bash bench/serve_matrix.sh colocated|disagg [OUT_DIR]
# starts `pdserve up` (SmolLM2 fp32, prefix caching off), runs `pdserve bench serve` with 64
# random prompts of 256 -> 128 tokens (EOS ignored) at rate 2 and all at once, greedy and at
# temperature 1.0, reads the engine's step breakdown (serve_profile) during the saturated
# temperature-1.0 run, stops the stack, then runs `pdserve bench offline` on the same workload.
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
else
  STACK=(--mode disagg --prefill-cpus 0 --decode-cpus 1)
fi
source "$(dirname "$0")/stack_up.sh"
stack_up "$OUT" "$PORT" $PDS up "${STACK[@]}" --model smollm2 --weights fp32 --no-prefix-caching
grep -E "memory budget|KV cache" "$OUT/up.log" || true
ENGINE=$(grep -E "^  (unified|decode) " "$OUT/up.log" | head -1 | awk '{print $2}')
ROUTER_PID=$(pgrep -f "serve router .*--port $PORT " | head -1 || true)
W=(--workload random --num-prompts 64 --input-len 256 --output-len 128 --seed 0 --no-progress
   --base-url "http://127.0.0.1:$PORT")
$PDS bench serve "${W[@]}" --num-prompts 4 --rate inf --out-dir "$OUT/warm" > /dev/null
for T in 1.0 0.0; do
  for RATE in 2 inf; do
    if [ "$T" = 1.0 ] && [ "$RATE" = inf ]; then
      # from the first decode-only steps (past the prompts' prefill: all arrive at once)
      # to the run's end; the router's CPU per generated token beside the engine's steps
      $PY -m pdserve.bench.serve_profile --engine "$ENGINE" --decode-window 600 \
        ${ROUTER_PID:+--router-pid "$ROUTER_PID"} \
        > "$OUT/profile.txt" 2>&1 &
      PROF=$!
    fi
    if [ "$T" = 1.0 ] && [ "$RATE" = 2 ]; then
      $PY -m pdserve.bench.serve_step_trace --engine "$ENGINE" --after-first-step 600 \
        --delay 2 --duration "${TRACE_S:-30}" --poll-ms 40 > "$OUT/trace.txt" 2>&1 &
      TRACE=$!
    fi
    $PDS bench serve "${W[@]}" --rate "$RATE" --temperature "$T" \
      --out-dir "$OUT/serve-t$T-r$RATE" | tail -1 | sed "s/^/serve t=$T rate=$RATE /"
  done
done
wait "${PROF:-}" 2>/dev/null || true
wait "${TRACE:-}" 2>/dev/null || true
echo "profile:"; cat "$OUT/profile.txt"
echo "steps at rate 2:"; cat "$OUT/trace.txt"
stack_down
for T in 0.0 1.0; do
  $PDS bench offline --model smollm2 --weights fp32 --num-prompts 64 --input-len 256 \
    --output-len 128 --num-threads 2 --skip-hf --repeats 1 --temperature "$T" \
    --no-prefix-caching | tail -1 \
    | sed "s/^/offline t=$T /"
done
OS=(--weights fp32 --num-threads 2 --no-prefix-caching --temperature 1.0)
$PY -m pdserve.bench.offline_step "${OS[@]}" --batch 2 4 8 16 32 48 64 | tail -1 \
  | sed "s/^/offline decode step /"
$PY -m pdserve.bench.offline_step "${OS[@]}" --batch 16 64 \
  --beside-load "${BESIDE_LOAD:-3/15}" | tail -1 | sed "s/^/offline decode step, beside load /"
