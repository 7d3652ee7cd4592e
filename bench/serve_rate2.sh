#!/usr/bin/env bash
# Issue 19's ITL target in one run: ITL p50 served at a rate vs the offline decode step.
#   bash bench/serve_rate2.sh [RATE] [RUNS] [OUT_DIR]
# starts `pdserve up --mode colocated` (SmolLM2 fp32, 2 threads on cores 0,1, prefix caching
# off), warms it up, runs `pdserve bench serve` RUNS times at RATE (64 random prompts of
# 256 -> 128 tokens, EOS ignored, temperature $TEMP), stops the stack, times the offline
# decode step at $BATCHES (before the stack too: the peer is the median of the two), and
# prints each run's ITL p50 over the offline step at the batch its median token rode
# (bench/itl_peer.py), then one JSON line with their median.
# The code that runs is whatever `python -m pdserve` resolves to: PYTHONPATH picks a checkout
# (itl_peer.py, stdlib only, runs from beside this script, so an older checkout can be timed).
# Experiments (issue 19: is the served engine's own step slower than offline, and why):
#   TRACE=1           bench/serve_step_trace.py beside each run (polls every TRACE_POLL_MS, 20),
#                     so itl_peer.py also prints the engine's own decode-only steps vs offline
#                     (the polls slow that step, 1.06x -> 1.19x in one hold: see STEP_LOG)
#   WEIGHTS=packed    both sides on the GGUF's packed weights (the stack's default for a
#                     quantized file) instead of fp32
#   ENGINE_ENV="K=V"  environment for the stack (e.g. GOMP_SPINCOUNT=10000)
#   ROUTER_NICE=N     renice the router once ready; CLIENT_NICE=N  run the client under nice
#   STEP_LOG=1        the engine logs every step itself (PDSERVE_STEP_LOG, no polling: the
#                     trace's GetLoad polls slow the step they measure), and
#                     bench/step_log_split.py splits its decode-only steps over the offline step
# The offline peer decodes at the served batch's context lengths: a served row is at 256 + 0-127
# (mean 320 over a run), offline_step's default rows at 256-288 (mean 272), a step 2-5% faster;
# CONTEXT_SPREAD=96 spreads the offline prompts over 256-351, so over its 32 decode steps its
# rows span 256-383, mean 320: the same work (CONTEXT_SPREAD=0: the old peer).
set -euo pipefail
RATE=${1:-2}
RUNS=${2:-3}
OUT=${3:-/tmp/pdserve-serve-rate$RATE}
PY=${PY:-python}
PORT=${PORT:-18461}
WEIGHTS=${WEIGHTS:-fp32}
BATCHES=${BATCHES:-4 8 16 24 32 48 64}
TEMP=${TEMP:-1.0}
CONTEXT_SPREAD=${CONTEXT_SPREAD:-96}
rm -rf "$OUT"; mkdir -p "$OUT"
export OMP_NUM_THREADS=2
# the offline peer before and after the served runs (itl_peer.py takes each batch's median):
# one offline_step run alone varied by a tenth from the next in one hold
OFFLINE_STEP=($PY -m pdserve.bench.offline_step --weights "$WEIGHTS" --num-threads 2
              --no-prefix-caching --temperature "$TEMP" --context-spread "$CONTEXT_SPREAD"
              --batch $BATCHES)
"${OFFLINE_STEP[@]}" | tail -1 > "$OUT/offline_step_before.json"
source "$(dirname "$0")/stack_up.sh"
[ -z "${STEP_LOG:-}" ] || ENGINE_ENV="${ENGINE_ENV:-} PDSERVE_STEP_LOG=$OUT/step_log.jsonl"
stack_up "$OUT" "$PORT" env ${ENGINE_ENV:-} $PY -m pdserve.cli up --mode colocated \
  --num-threads 2 --cpus 0,1 --model smollm2 --weights "$WEIGHTS" --no-prefix-caching ${UP_ARGS:-}
ENGINE=$(awk '$1 == "unified0" && $2 ~ /:/ {print $2; exit}' "$OUT/up.log")
if [ -n "${ROUTER_NICE:-}" ]; then
  renice -n "$ROUTER_NICE" -p $(pgrep -P "$UP" -f "router --model") > /dev/null
fi
CLIENT=(nice -n "${CLIENT_NICE:-0}" $PY -m pdserve.cli bench serve)
W=(--workload random --num-prompts 64 --input-len 256 --output-len 128 --no-progress
   --temperature "$TEMP" --base-url "http://127.0.0.1:$PORT")
"${CLIENT[@]}" "${W[@]}" --seed 99 --num-prompts 4 --rate inf \
  --out-dir "$OUT/warm" > /dev/null
for i in $(seq "$RUNS"); do
  mkdir -p "$OUT/run$i"
  TR=
  if [ -n "${TRACE:-}" ]; then
    $PY -m pdserve.bench.serve_step_trace --engine "$ENGINE" --after-first-step 120 \
      --duration "${TRACE_S:-30}" --poll-ms "${TRACE_POLL_MS:-20}" \
      --records-out "$OUT/run$i/step_trace.jsonl" > "$OUT/run$i.trace" 2>&1 &
    TR=$!
  fi
  "${CLIENT[@]}" "${W[@]}" --seed "$i" --rate "$RATE" \
    --out-dir "$OUT/run$i" | tail -1 > "$OUT/run$i.json"
  [ -z "$TR" ] || wait "$TR" || true
done
stack_down
"${OFFLINE_STEP[@]}" | tail -1 > "$OUT/offline_step.json"
RUN_DIRS=()
for i in $(seq "$RUNS"); do RUN_DIRS+=("$OUT/run$i"); done
$PY "$(dirname "$0")/itl_peer.py" "$OUT/offline_step_before.json" "$OUT/offline_step.json" \
  "${RUN_DIRS[@]}" | sed "s|$OUT/||"
if [ -n "${STEP_LOG:-}" ]; then
  $PY -m pdserve.bench.step_log_split "$OUT/step_log.jsonl" "$OUT/offline_step_before.json" \
    "$OUT/offline_step.json" > "$OUT/step_log_split.txt"
  grep -v '^{' "$OUT/step_log_split.txt" | sed -n '1,2p;/^by same_batch/,/True/p;/^engine-side/p'
fi
