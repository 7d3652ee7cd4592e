#!/usr/bin/env bash
# Issue 19's throughput target in one hold: served at saturation, temperature 1.0, over greedy
# offline on the same workload, as medians of RUNS runs in alternating order.
#   bash bench/serve_saturation.sh [RUNS] [OUT_DIR]
# starts `pdserve up --mode colocated` (SmolLM2 fp32, 2 threads on cores 0,1, prefix caching
# off), warms it up, then RUNS passes of `pdserve bench serve` all at once (64 random prompts
# of 256 -> 128, EOS ignored) at temperature 1.0 and greedy (odd passes 1.0 first, even ones
# greedy first: neither pays for going first), each with serve_profile --decode-window beside
# it (the engine's step breakdown over the run's decode-only steps, the router's CPU per
# token); stops the stack; then RUNS passes of `pdserve bench offline` on the same workload,
# greedy and 1.0 alternating alike. bench/saturation_peer.py prints the medians, the ratios
# and one JSON line. PYTHONPATH picks the checkout timed. WEIGHTS=packed runs both sides on
# the GGUF's packed weights (the engine's default for a quantized file) instead of fp32.
set -euo pipefail
RUNS=${1:-2}
OUT=${2:-/tmp/pdserve-serve-saturation}
PY=${PY:-python}
PORT=${PORT:-18471}
WEIGHTS=${WEIGHTS:-fp32}
rm -rf "$OUT"; mkdir -p "$OUT"
export OMP_NUM_THREADS=2
source "$(dirname "$0")/stack_up.sh"
stack_up "$OUT" "$PORT" $PY -m pdserve.cli up --mode colocated --num-threads 2 --cpus 0,1 \
  --model smollm2 --weights "$WEIGHTS" --no-prefix-caching
ENGINE=$(awk '$1 == "unified0" && $2 ~ /:/ {print $2; exit}' "$OUT/up.log")
ROUTER_PID=$(pgrep -f "serve router .*--port $PORT " | head -1 || true)
W=(--workload random --num-prompts 64 --input-len 256 --output-len 128 --seed 0 --no-progress
   --base-url "http://127.0.0.1:$PORT")
$PY -m pdserve.cli bench serve "${W[@]}" --num-prompts 4 --rate inf --out-dir "$OUT/warm" \
  > /dev/null
order() { if [ $(($1 % 2)) = 1 ]; then echo "$2 $3"; else echo "$3 $2"; fi; }
for i in $(seq "$RUNS"); do
  for T in $(order "$i" 1.0 0.0); do
    $PY -m pdserve.bench.serve_profile --engine "$ENGINE" --decode-window 300 \
      ${ROUTER_PID:+--router-pid "$ROUTER_PID"} > "$OUT/profile-t$T-$i.txt" 2>&1 &
    PROF=$!
    $PY -m pdserve.cli bench serve "${W[@]}" --rate inf --temperature "$T" \
      --out-dir "$OUT/serve-t$T-$i" | tail -1 > "$OUT/served-t$T-$i.json"
    wait "$PROF" || true
    tail -1 "$OUT/profile-t$T-$i.txt" > "$OUT/profile-t$T-$i.json"
  done
done
stack_down
for i in $(seq "$RUNS"); do
  for T in $(order "$i" 0.0 1.0); do
    $PY -m pdserve.cli bench offline --model smollm2 --weights "$WEIGHTS" --num-prompts 64 \
      --input-len 256 --output-len 128 --num-threads 2 --skip-hf --repeats 1 \
      --temperature "$T" --no-prefix-caching | tail -1 > "$OUT/offline-t$T-$i.json"
  done
done
$PY "$(dirname "$0")/saturation_peer.py" "$OUT"
