"""The packed-weight GEMM kernels (cpu_kernels/packed_gemm.cpp), built just in time into their
own module, as the attention kernels are (common/attention/cpu_native.py, whose compile flags,
ISA cap `PDSERVE_CPU_ISA` and cache directory this reuses; the module name hashes this
directory's sources, so the two builds never share a cache entry).

A failed build never breaks the engine: `load_packed_kernels()` returns None (one logged
warning) and packed layers fall back to expanding the weight with torch ops
(quant/packed.py) before an fp32 GEMM. `PDSERVE_NO_NATIVE=1` forces that fallback.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from types import ModuleType

from pdserve.common.attention.cpu_native import (_cpu_flags, build_or_import, compile_flags,
                                                 sources_module_name)

log = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).resolve().parent / "cpu_kernels"
# packed_gemm.cpp first: it compiles longest (<torch/extension.h>)
SOURCES = (KERNEL_DIR / "packed_gemm.cpp", KERNEL_DIR / "fused_layer.cpp")
# fused_layer.cpp includes the attention kernels' decode and row helpers from here
ATTENTION_DIR = KERNEL_DIR.parents[2] / "attention" / "cpu_kernels"


def packed_compile_flags() -> list[str]:
    """The attention kernels' flags, plus F16C (one instruction per block scale) with AVX2."""
    flags = compile_flags()
    if "-mavx2" in flags and "f16c" in _cpu_flags():
        flags.append("-mf16c")
    return flags


def module_name(flags: list[str]) -> str:
    """Unique per version of this directory's sources and of the attention headers they
    include (the attention directory's hash stands in the name's inputs beside the flags)."""
    attention = sources_module_name("attention", ATTENTION_DIR, flags)
    return sources_module_name("pdserve_packed_gemm", KERNEL_DIR, flags + [attention])


def _build_or_import() -> ModuleType:
    flags = packed_compile_flags()
    return build_or_import(module_name(flags), SOURCES, flags, "packed-weight GEMM kernels")


@functools.lru_cache(maxsize=1)
def _load_once() -> ModuleType | None:
    try:
        return _build_or_import()
    except Exception as e:  # noqa: BLE001 - any build/import failure means: use the torch path
        log.warning("packed-weight GEMM kernels unavailable, expanding weights with torch: %s", e)
        return None


def load_packed_kernels() -> ModuleType | None:
    """The compiled module (`packed_gemm`, `dequantize`, `simd`), or None."""
    if os.environ.get("PDSERVE_NO_NATIVE") == "1":
        return None
    return _load_once()
