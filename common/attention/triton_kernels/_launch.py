"""One Triton kernel, launched compiled on CUDA and interpreted on the CPU.

`triton.jit` decides between compiling and interpreting once, at import, from TRITON_INTERPRET.
The engine and the tests need both in one process (the GPU check runs the CPU-interpreted and the
CUDA-compiled cases side by side), so each kernel keeps both forms and picks per launch by the
device of its tensors. Each form is built on first use, so a CPU-only host never compiles.

The interpreter can run only builtins inside an interpreted kernel, while Triton's standard
library (tl.cdiv, tl.zeros, tl.max, tl.sum) is itself made of @jit functions, interpreted only if
TRITON_INTERPRET was set when triton was first imported. So the kernels use builtins only
(tl.full, integer arithmetic) and reduce with `tl.reduce` and the two combine functions below,
which the interpreter recognises by identity and runs as numpy max / sum. With that, a kernel
runs interpreted whatever the environment was at import time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

MAX_COMBINE = tl.standard._elementwise_max  # tl.reduce(x, axis, MAX_COMBINE) == tl.max(x, axis)
SUM_COMBINE = tl.standard._sum_combine  # tl.reduce(x, axis, SUM_COMBINE) == tl.sum(x, axis)


class DeviceKernel:
    """`kernel.on(device)[grid](*args)` launches `fn` the way that device needs."""

    def __init__(self, fn):
        self.fn = fn
        self._compiled = None
        self._interpreted = None

    def on(self, device: torch.device):
        # TRITON_INTERPRET=1 at triton's import makes its stdlib (and so MAX_COMBINE)
        # interpreted; compiled kernels could not use it, so CUDA tensors get interpreted too
        if device.type == "cuda" and isinstance(MAX_COMBINE, JITFunction):
            if self._compiled is None:
                self._compiled = JITFunction(self.fn)
            return self._compiled
        if self._interpreted is None:
            self._interpreted = InterpretedFunction(self.fn)
        return self._interpreted


def device_kernel(fn) -> DeviceKernel:
    """Decorator used in place of `@triton.jit`."""
    return DeviceKernel(fn)


def pow2(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum): Triton block shapes must be powers of two."""
    return max(triton.next_power_of_2(n), minimum)


def check_block_n(block_n: int) -> None:
    """Key tiles feed tl.dot, which wants a power of two >= 16."""
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
