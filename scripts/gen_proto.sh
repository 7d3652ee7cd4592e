#!/usr/bin/env bash
# Regenerate the Python protobuf/gRPC modules from proto/*.proto (what `make proto` runs).
# Usage: scripts/gen_proto.sh [OUT_DIR]   (default: common/rpc, where they are committed)
# grpc_tools writes `import engine_pb2`, which only works with OUT_DIR on sys.path; the sed
# below makes those imports package-relative so the modules work as pdserve.common.rpc.*.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$root/common/rpc}"
py="${PYTHON:-}"
if [[ -z "$py" ]]; then
  if [[ -x "$root/.venv/bin/python" ]]; then py="$root/.venv/bin/python"; else py=python3; fi
fi
mkdir -p "$out"
cd "$root/proto"
protos=(*.proto)
"$py" -m grpc_tools.protoc -I . --python_out="$out" --pyi_out="$out" \
  --grpc_python_out="$out" "${protos[@]}"
for p in "${protos[@]}"; do
  mod="${p%.proto}_pb2"
  sed -i -E "s/^import ${mod} as /from . import ${mod} as /" "$out"/*_pb2*.py "$out"/*.pyi
done
