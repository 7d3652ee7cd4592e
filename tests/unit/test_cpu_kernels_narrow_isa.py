"""The native kernels' narrower builds pass the same kernel tests as this machine's own build.

This machine builds the AVX-512 variant; CPUs with only AVX2 (8-lane prefill vectors, smaller
register tiles) or neither (plain loops; prefill falls back to SDPA) get other code.
PDSERVE_CPU_ISA=avx2|scalar builds those here. Each build compiles once per source version
(~30 s) into its own cache directory. The kernel tests run in a subprocess, so the build under
test is the one loaded, without the outer run's pytest cache.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.common.attention import cpu_native

ROOT = Path(__file__).resolve().parents[2]
KERNEL_TESTS = ["tests/unit/test_cpu_paged_attention.py",
                "tests/unit/test_cpu_prefill_attention.py",
                "tests/unit/test_cpu_fused_kernels.py",
                "tests/unit/test_cpu_kernels_half_kv.py"]


@pytest.mark.parametrize("isa,fast_prefill", [("avx2", True), ("scalar", False)])
def test_narrow_build_passes_the_kernel_tests(isa, fast_prefill):
    if isa == "avx2" and not {"avx2", "fma"} <= cpu_native._cpu_flags():
        pytest.skip("this CPU has no AVX2")
    env = dict(os.environ, PDSERVE_CPU_ISA=isa)
    probe = subprocess.run(
        [sys.executable, "-c", "from pdserve.common.attention.cpu_native import "
         "load_cpu_kernels as load; m = load(); print(m.simd, m.fast_prefill)"],
        env=env, capture_output=True, text=True, timeout=600)
    assert probe.stdout.split() == [isa, str(fast_prefill)], probe.stderr[-2000:]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          *KERNEL_TESTS], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stdout[-4000:]
    assert " passed" in run.stdout.splitlines()[-1]


def test_unknown_isa_is_refused(monkeypatch):
    monkeypatch.setenv("PDSERVE_CPU_ISA", "avx9")
    with pytest.raises(ValueError, match="PDSERVE_CPU_ISA"):
        cpu_native.compile_flags()
