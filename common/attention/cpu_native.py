"""Native CPU kernels (cpu_kernels/*.cpp), built just in time into one module: paged decode
attention (paged_attention.cpp), paged prefill attention (prefill_attention.cpp), the fused layer
step and RMSNorm (layer_ops.cpp), fused temperature sampling (sampling.cpp); the Python bindings
(bindings.cpp, the one translation unit that pays for torch's Python headers).

Why native: on the CPU the torch path's gather of the paged KV into dense tensors costs more than
the attention itself; the kernels read each K/V row straight through the block table.

Why just in time rather than at install: the build needs only a C++ compiler (and ninja) at run
time, and a failed build must never break the engine: `load_cpu_kernels()` then returns None
(one logged warning) and callers keep the torch gather path. `PDSERVE_NO_NATIVE=1` forces that
fallback.

The build is cached in a directory named by a hash of the source, the compile flags and the
torch / Python versions (under the venv's `.cache/pdserve-kernels`, else
`~/.cache/torch_extensions/pdserve`, or `$PDSERVE_KERNEL_CACHE`), so each machine compiles a
source version once; later processes import the built library directly (milliseconds).
cpp_extension's lock file in that directory makes concurrent first loads wait for one build.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import sys
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).resolve().parent / "cpu_kernels"
# bindings.cpp first: it compiles longest (<torch/python.h>), so ninja starts it first and
# the kernels compile beside it
SOURCES = tuple(KERNEL_DIR / n for n in ("bindings.cpp", "paged_attention.cpp",
                                           "prefill_attention.cpp", "layer_ops.cpp",
                                           "sampling.cpp"))
_OK_MARKER = "BUILD_OK"  # written after a successful build: the .so is complete and loads
ISA_CHOICES = ("native", "avx2", "scalar")  # PDSERVE_CPU_ISA


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def compile_flags() -> list[str]:
    """-O3, plus AVX2/FMA code when this CPU has both, and AVX-512 (the prefill kernel's 16-lane
    vectors) when it has that too. -fopenmp always: at::parallel_for is an inline OpenMP loop in
    torch's headers, serial without it.

    PDSERVE_CPU_ISA=avx2|scalar caps the instruction set (default `native`: the best this CPU
    has), so the narrower builds can be tested on a wider machine; each gets its own cache."""
    isa = os.environ.get("PDSERVE_CPU_ISA", "native")
    if isa not in ISA_CHOICES:
        raise ValueError(f"PDSERVE_CPU_ISA must be one of {', '.join(ISA_CHOICES)}, got {isa!r}")
    flags = ["-O3", "-fopenmp"]
    cpu = _cpu_flags()
    if isa != "scalar" and {"avx2", "fma"} <= cpu:
        flags += ["-mavx2", "-mfma"]
        if "f16c" in cpu:  # fp16 KV widened 8 at a time (vcvtph2ps)
            flags += ["-mf16c"]
        if isa == "native" and "avx512f" in cpu:
            flags += ["-mavx512f"]
    return flags


def kernel_cache_root() -> Path:
    env = os.environ.get("PDSERVE_KERNEL_CACHE")
    if env:
        return Path(env)
    if sys.prefix != sys.base_prefix:  # in a virtual environment: keep builds with it
        return Path(sys.prefix) / ".cache" / "pdserve-kernels"
    return Path.home() / ".cache" / "torch_extensions" / "pdserve"


def sources_module_name(prefix: str, kernel_dir: Path, flags: list[str]) -> str:
    """`prefix`_HASH, unique per version of every source and header in `kernel_dir` and
    everything else the binary depends on (flags, torch, Python, machine)."""
    h = hashlib.sha256()
    for path in sorted(kernel_dir.glob("*.[ch]*")):  # every source and header
        h.update(path.name.encode() + path.read_bytes())
    h.update(repr((flags, torch.__version__, sys.version_info[:2], platform.machine())).encode())
    return f"{prefix}_{h.hexdigest()[:16]}"


def module_name(flags: list[str]) -> str:
    return sources_module_name("pdserve_cpu_attn", KERNEL_DIR, flags)


def build_directory() -> Path:
    return kernel_cache_root() / module_name(compile_flags())


def _import_built(name: str, directory: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, directory / f"{name}.so")
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {directory / name}.so")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_or_import(name: str, sources, flags: list[str], what: str) -> ModuleType:
    """The extension `name` from the kernel cache, built from `sources` with `flags` first if
    this version was never built (`what` names it in the one log line a build prints)."""
    directory = kernel_cache_root() / name
    if (directory / _OK_MARKER).exists():
        return _import_built(name, directory)
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"C++ compiler {compiler!r} not found")
    from torch.utils import cpp_extension  # imported only when a build is needed (slow import)
    directory.mkdir(parents=True, exist_ok=True)
    log.info("building %s in %s (once per source version)", what, directory)
    module = cpp_extension.load(name=name, sources=[str(p) for p in sources],
                                extra_cflags=flags,
                                extra_ldflags=["-fopenmp"], build_directory=str(directory))
    (directory / _OK_MARKER).write_text("ok\n")
    return module


def _build_or_import() -> ModuleType:
    flags = compile_flags()
    return build_or_import(module_name(flags), SOURCES, flags, "native CPU attention kernels")


@functools.lru_cache(maxsize=1)
def _load_once() -> ModuleType | None:
    try:
        return _build_or_import()
    except Exception as e:  # noqa: BLE001 - any build/import failure means: use the torch path
        log.warning("native CPU attention kernels unavailable, using the torch gather path: %s",
                    e)
        return None


def load_cpu_kernels() -> ModuleType | None:
    """The compiled module, or None (PDSERVE_NO_NATIVE=1, no compiler, failed build)."""
    if os.environ.get("PDSERVE_NO_NATIVE") == "1":
        return None
    return _load_once()


def paged_decode(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """query [D, heads, d] fp32 (row-strided views fine), kv_cache [2, NB, bs, kvh, d] fp32
    contiguous, block_tables [D, W] int32, seq_lens [D] int32 -> [D, heads, d] (written into
    `out` when given: contiguous, same shape). ValueError on bad shapes or metadata; RuntimeError
    when the kernels are unavailable (check `load_cpu_kernels()` first)."""
    module = load_cpu_kernels()
    if module is None:
        raise RuntimeError("native CPU attention kernels are unavailable")
    return module.paged_decode(query, kv_cache, block_tables, seq_lens, float(scale), out)
