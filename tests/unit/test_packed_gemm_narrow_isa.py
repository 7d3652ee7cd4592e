"""The packed GEMM's narrower builds pass the same tests as this machine's own build (the
Q4_0 .. Q8_0, IQ4_NL and the K-quant / IQ4_XS kernel tests, and the packed layer's engine tests,
which run the one-call decoder layer; not the Triton tests, nor the dispatch tests: past the
switch they run `dequantize`, which the expansion tests cover, and a fp32 GEMM that does not
depend on the build).

PDSERVE_CPU_ISA=avx2|scalar caps the instruction set (quant/cpu_native.py reuses the attention
kernels' flags): the AVX2 variant (8-lane blocks, 2-row tiles) and the plain C++ fallback. Each
build compiles once per source version (~30 s) into its own cache directory; the tests run in a
subprocess so the build under test is the one loaded. (On an AVX2-only machine the `avx2` case
repeats the native build; the AVX-512 variant runs only where the CPU has it.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.common.attention import cpu_native

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("isa", ["avx2", "scalar"])
def test_narrow_build_passes_the_packed_gemm_tests(isa):
    if isa == "avx2" and not {"avx2", "fma"} <= cpu_native._cpu_flags():
        pytest.skip("this CPU has no AVX2")
    env = dict(os.environ, PDSERVE_CPU_ISA=isa)
    probe = subprocess.run(
        [sys.executable, "-c", "from pdserve.common.models.quant.cpu_native import "
         "load_packed_kernels as load; print(load().simd)"],
        env=env, capture_output=True, text=True, timeout=600)
    assert probe.stdout.split() == [isa], probe.stderr[-2000:]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/unit/test_packed_gemm.py", "tests/unit/test_packed_kquants.py",
                          "tests/unit/test_packed_layer.py", "tests/unit/test_packed_stack.py",
                          "tests/unit/test_packed_blocked.py", "tests/unit/test_packed_iq4_nl.py",
                          # (and_fp32: its prompt-step count assumes this CPU's own switch point)
                          "-k", "not triton and not decodes and not dispatch and not and_fp32"],
                         cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:]
    assert " passed" in run.stdout.splitlines()[-1]
