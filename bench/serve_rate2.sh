#!/usr/bin/env bash
# Issue 19's ITL target in one run: ITL p50 served at a rate vs the offline decode step.
#   bash bench/serve_rate2.sh [RATE] [RUNS] [OUT_DIR]
# starts `pdserve up --mode colocated` (SmolLM2 fp32, 2 threads on cores 0,1, prefix caching
# off), warms it up, runs `pdserve bench serve` RUNS times at RATE (64 random prompts of
# 256 -> 128 tokens, EOS ignored, temperature $TEMP), stops the stack, times the offline
# decode step at batch $BATCH (the token-weighted batch the median token rides at rate 2,
# README), and prints each run's ITL p50 / offline step, their median, and one JSON line.
# The code that runs is whatever `python -m pdserve` resolves to: PYTHONPATH picks a checkout.
set -euo pipefail
RATE=${1:-2}
RUNS=${2:-3}
OUT=${3:-/tmp/pdserve-serve-rate$RATE}
PY=${PY:-python}
PORT=${PORT:-18461}
BATCH=${BATCH:-64}
TEMP=${TEMP:-1.0}
rm -rf "$OUT"; mkdir -p "$OUT"
export OMP_NUM_THREADS=2
$PY -m pdserve.cli up --mode colocated --num-threads 2 --cpus 0,1 --model smollm2 \
  --weights fp32 --no-prefix-caching --insecure --port "$PORT" --grpc-port $((PORT + 1)) \
  --discovery static --log-dir "$OUT/logs" ${UP_ARGS:-} > "$OUT/up.log" 2>&1 &
UP=$!
trap 'kill -TERM $UP 2>/dev/null; wait $UP 2>/dev/null || true' EXIT
for _ in $(seq 600); do grep -q "^ready" "$OUT/up.log" && break; sleep 0.5; done
grep -q "^ready" "$OUT/up.log" || { cat "$OUT/up.log"; exit 1; }
W=(--workload random --num-prompts 64 --input-len 256 --output-len 128 --no-progress
   --temperature "$TEMP" --base-url "http://127.0.0.1:$PORT")
$PY -m pdserve.cli bench serve "${W[@]}" --seed 99 --num-prompts 4 --rate inf \
  --out-dir "$OUT/warm" > /dev/null
for i in $(seq "$RUNS"); do
  $PY -m pdserve.cli bench serve "${W[@]}" --seed "$i" --rate "$RATE" \
    --out-dir "$OUT/run$i" | tail -1 > "$OUT/run$i.json"
done
kill -TERM $UP; wait $UP || true
trap - EXIT
$PY -m pdserve.bench.offline_step --weights fp32 --num-threads 2 --no-prefix-caching \
  --temperature "$TEMP" --batch "$BATCH" | tail -1 > "$OUT/offline_step.json"
$PY - "$OUT" "$RUNS" "$BATCH" "$RATE" <<'EOF'
import json, platform, statistics, sys
out, runs, batch, rate = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
step_s = json.load(open(f"{out}/offline_step.json"))["decode_step_ms"][batch] / 1e3
rows = [json.load(open(f"{out}/run{i}.json")) for i in range(1, runs + 1)]
for i, r in enumerate(rows, 1):
    print(f"run {i}: ITL p50 {r['itl_p50_s'] * 1e3:.1f} ms = "
          f"{r['itl_p50_s'] / step_s:.2f}x offline step {step_s * 1e3:.1f} ms (batch {batch}); "
          f"TTFT p50 {r['ttft_p50_s']:.2f} s, {r['output_throughput']:.1f} tok/s, "
          f"{r['failed']} failed")
itl = statistics.median(r["itl_p50_s"] for r in rows)
print(json.dumps({"bench": "serve_rate2", "rate": float(rate), "runs": runs,
                  "itl_p50_ms": [r["itl_p50_s"] * 1e3 for r in rows],
                  "ttft_p50_s": [r["ttft_p50_s"] for r in rows],
                  "output_tok_s": [r["output_throughput"] for r in rows],
                  "failed": sum(r["failed"] for r in rows),
                  "offline_step_ms": step_s * 1e3, "batch": int(batch),
                  "itl_p50_over_offline_step": itl / step_s,
                  "cpu": platform.processor() or platform.machine()}))
EOF
