"""The sampler's temperature path on the native kernel (common/attention/cpu_kernels/
sampling.cpp), with sample_ops' torch functions as the fallback and the reference.

Why native: at 64 x 49,152 the torch path runs about eight full-vocabulary tensor passes per
step (subtract the max, scale, clamp, exp, flush, min-p, float64 block sums): 9-11 ms of CPU
per decode step on a 2-core machine, where every ms beside the forward is taken from it. The
kernel does one pass for the max and one that makes the weights and their float64 block sums,
then the same two-level inverse-CDF pick; it writes no [n, V] weights at all.

The contract is sample_ops' (its docstrings): the top token weighs exactly 1, weights at or
under FLUSH_BELOW are 0, the pick is exact up to float64 rounding of the fp32 weights. The
kernel's exp is within 2 ulp of the exact value where torch's is within 1, so the two paths
give the same token for the same uniform except where the uniform falls within ~1e-7 of a
boundary of the cumulative distribution (tests/unit/test_sample_native.py).

The kernel runs on contiguous-column fp32 CPU logits; anything else, PDSERVE_NO_NATIVE=1 or a
failed build takes the torch path.
"""

from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch

from pdserve.common.attention.cpu_native import load_cpu_kernels
from pdserve.common.engine import sample_ops


def kernels_for(logits: torch.Tensor, use_native: bool = True) -> Optional[ModuleType]:
    """The native module when it can take these logits, else None (use the torch path);
    use_native=False always takes the torch path (the reference, for tests and benchmarks)."""
    if not use_native or logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2 \
            or logits.stride(-1) != 1:
        return None
    return load_cpu_kernels()


def argmax(logits: torch.Tensor, use_native: bool = True) -> torch.Tensor:
    """sample_ops.argmax: logits [n, V] -> int64 [n], torch.argmax's index (the first max; the
    first NaN in a row that has one). Native: one call and two vector passes per row, where the
    blocked torch form is seven ops (~14 us for one SmolLM2 row, several times that inside a
    batch-1 step whose weights evicted the interpreter's caches)."""
    native = kernels_for(logits, use_native)
    if native is None:
        return sample_ops.argmax(logits)
    return native.argmax_rows(logits)


def weights(logits: torch.Tensor, inv_temp: torch.Tensor,
            use_native: bool = True) -> torch.Tensor:
    """sample_ops.weights: logits [n, V] fp32, inv_temp [n, 1] fp32 -> new [n, V] weights."""
    native = kernels_for(logits, use_native)
    if native is None:
        return sample_ops.weights(logits, inv_temp)
    return native.sample_weights(logits, inv_temp.contiguous(), sample_ops.EXP_FLOOR,
                                 sample_ops.FLUSH_BELOW)


def sample_plain(logits: torch.Tensor, inv_temp: torch.Tensor, min_p: torch.Tensor,
                 u: torch.Tensor, use_native: bool = True) -> torch.Tensor:
    """Token ids [n] drawn from full rows of logits [n, V] fp32 at temperature (inv_temp
    [n, 1] fp32) under min-p (min_p [n, 1] fp32, 0 = off) with uniforms u [n] fp64: what
    sample_ops.sample_rows(min_p_(weights(logits, inv_temp), min_p), u) draws."""
    native = kernels_for(logits, use_native)
    if native is None:
        w = sample_ops.weights(logits, inv_temp)
        if bool((min_p > 0).any()):
            sample_ops.min_p_(w, min_p)
        return sample_ops.sample_rows(w, u)
    return native.sample_rows(logits, inv_temp.contiguous(), min_p.contiguous(),
                              u.contiguous(), sample_ops.EXP_FLOOR, sample_ops.FLUSH_BELOW)


def sample_top_p(logits: torch.Tensor, inv_temp: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor, u: torch.Tensor, use_native: bool = True) -> torch.Tensor:
    """Token ids [n] drawn from full rows of logits [n, V] fp32 at temperature (inv_temp [n, 1]
    fp32) cut to top-p (top_p [n] fp64 < 1, no top-k) and then by min-p (min_p [n, 1] fp32)
    with uniforms u [n] fp64: what sample_ops.sample_top_p(weights(logits, inv_temp), ...)
    draws. Native: one call (weights, a histogram of their mass, the edge bucket sorted, the
    pick), where the torch path sorts up to 4,096 candidates per row and builds the histogram
    in ~10 tensor passes for the rows that need more (~70 ms against ~10 per step at
    64 x 49,152, SmolLM2's rows at T 0.8 / p 0.95, on a 2-core Zen 1)."""
    native = kernels_for(logits, use_native)
    if native is None:
        return sample_ops.sample_top_p(sample_ops.weights(logits, inv_temp), top_p, min_p, u)
    return native.sample_top_p_rows(logits, inv_temp.contiguous(), top_p.contiguous(),
                                    min_p.contiguous(), u.contiguous(), sample_ops.EXP_FLOOR,
                                    sample_ops.FLUSH_BELOW)
