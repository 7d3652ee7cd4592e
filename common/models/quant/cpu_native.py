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
# bindings.cpp first: it compiles longest (torch's Python headers), and beside it the kernels
SOURCES = (KERNEL_DIR / "bindings.cpp", KERNEL_DIR / "packed_gemm.cpp",
           KERNEL_DIR / "fused_layer.cpp")


def packed_compile_flags() -> list[str]:
    """The attention kernels' flags, plus F16C (one instruction per block scale) with AVX2."""
    flags = compile_flags()
    if "-mavx2" in flags and "f16c" in _cpu_flags():
        flags.append("-mf16c")
    return flags


def module_name(flags: list[str], kernel_dir: Path = KERNEL_DIR) -> str:
    """Unique per version of this directory's sources and of the attention headers they
    include (fused_layer.cpp includes the attention kernels' decode and row helpers: that
    directory's hash stands in the name's inputs beside the flags)."""
    attention_dir = kernel_dir.parents[2] / "attention" / "cpu_kernels"
    attention = sources_module_name("attention", attention_dir, flags)
    return sources_module_name("pdserve_packed_gemm", kernel_dir, flags + [attention])


def _build_or_import(kernel_dir: Path = KERNEL_DIR, sources: tuple[Path, ...] = SOURCES
                     ) -> ModuleType:
    flags = packed_compile_flags()
    return build_or_import(module_name(flags, kernel_dir), sources, flags,
                           f"packed-weight GEMM kernels ({kernel_dir})")


def build_checkout_kernels(root: Path) -> ModuleType:
    """The packed kernels built from the checkout at `root` (its sources, this build's flags
    and cache): bench/kernel_ab.py times another version's kernels beside this one's."""
    kernel_dir = Path(root).resolve() / KERNEL_DIR.relative_to(KERNEL_DIR.parents[3])
    if not all((kernel_dir / n).is_file() for n in ("packed_gemm.cpp", "fused_layer.cpp")):
        raise ValueError(f"{root} has no packed-kernel sources under {kernel_dir}")
    # a checkout from before 2026-12-06 has its bindings inside packed_gemm.cpp
    sources = tuple(kernel_dir / p.name for p in SOURCES if (kernel_dir / p.name).is_file())
    return _build_or_import(kernel_dir, sources)


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
