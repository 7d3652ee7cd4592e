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
import hashlib
import logging
import os
import platform
import shutil
import sys
from pathlib import Path
from types import ModuleType

import torch

from pdserve.common.attention.cpu_native import (_cache_root, _cpu_flags, _import_built,
                                                 compile_flags)

log = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).resolve().parent / "cpu_kernels"
SOURCES = (KERNEL_DIR / "packed_gemm.cpp",)
_OK_MARKER = "BUILD_OK"


def packed_compile_flags() -> list[str]:
    """The attention kernels' flags, plus F16C (one instruction per block scale) with AVX2."""
    flags = compile_flags()
    if "-mavx2" in flags and "f16c" in _cpu_flags():
        flags.append("-mf16c")
    return flags


def module_name(flags: list[str]) -> str:
    h = hashlib.sha256()
    for path in sorted(KERNEL_DIR.glob("*.[ch]*")):
        h.update(path.name.encode() + path.read_bytes())
    h.update(repr((flags, torch.__version__, sys.version_info[:2], platform.machine())).encode())
    return f"pdserve_packed_gemm_{h.hexdigest()[:16]}"


def _build_or_import() -> ModuleType:
    flags = packed_compile_flags()
    name = module_name(flags)
    directory = _cache_root() / name
    if (directory / _OK_MARKER).exists():
        return _import_built(name, directory)
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"C++ compiler {compiler!r} not found")
    from torch.utils import cpp_extension  # slow import, only when a build is needed
    directory.mkdir(parents=True, exist_ok=True)
    log.info("building packed-weight GEMM kernels in %s (once per source version)", directory)
    module = cpp_extension.load(name=name, sources=[str(p) for p in SOURCES], extra_cflags=flags,
                                extra_ldflags=["-fopenmp"], build_directory=str(directory))
    (directory / _OK_MARKER).write_text("ok\n")
    return module


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
