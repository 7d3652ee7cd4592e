"""y = x @ W^T for a packed weight (quant/packed.py): which kernel runs, by device and M.

- CPU, M < LARGE_M: the native packed kernel (cpu_kernels/packed_gemm.cpp), threads over
  output rows: for a few rows each block is expanded in registers; from 4 rows on, a panel of
  weight rows is expanded once into cache-resident scratch and a register-tiled micro-kernel
  runs over all rows. Decode steps live here; the weight bytes streamed per step are the packed
  ones (Q4_1: 0.625 bytes per weight instead of 4; Q4_K 0.5625, Q6_K 0.82).
- CPU, M >= LARGE_M[simd]: expand W to fp32 (native; whole, or in EXPAND_BYTES tiles of rows)
  and multiply with oneDNN's fp32 GEMM, bias and residual fused as post-ops like the fp32
  path's, gate/up's SiLU-and-mul one vectorized pass after its one GEMM (`silu_and_mul`;
  torch's `linear` where oneDNN is missing). From BLOCKED_M[simd] rows on, where the layer
  has a `BlockedWeights` (quant/blocked.py), W is expanded straight into oneDNN's blocked
  layout instead, and the GEMM runs as on a prepacked weight. With many rows
  the GEMM is compute-bound, the expansion is paid once per M rows, and the tuned GEMM beats
  the packed kernel (whose activation blocks stream from L3 once per panel).
- CUDA: the Triton kernel (quant/triton_gemm.py), which expands blocks in registers too.
- Otherwise (no native build): expand with torch ops (packed.py) and multiply.

Every path multiplies by exactly the fp32 weights gguf-py dequantizes and accumulates in fp32,
so results differ from the dequantized-fp32 GEMM only by summation order.
"""

from __future__ import annotations

import torch

from pdserve.common.models.cpu_gemm import onednn_available
from pdserve.common.models.cpu_gemm import packed_linear as cpu_gemm_linear
from pdserve.common.models.cpu_gemm import packed_linear_binary as cpu_gemm_binary
from pdserve.common.models.quant.blocked import BlockedWeights
from pdserve.common.models.quant.cpu_native import load_packed_kernels
from pdserve.common.models.quant.packed import PackedWeight

# From this many activation rows on, expand + oneDNN GEMM; below, the packed kernel. Per build
# (the kernel module's `simd`), measured with `python -m pdserve.common.models.quant.crossover`
# over 30 SmolLM2-shaped Q4_1 layers, 2 threads (figures in docs/packed-weights.md): AVX-512 on
# a quiet Zen 5, expand + GEMM faster from M = 96 on; AVX2 on a Zen 1, with its 3 x 4 panel
# tiles, even at M = 256 (packed 1.00-1.08x expand + GEMM at 256, 1.09-1.34x below); scalar
# not measured.
LARGE_M = {"avx512": 96, "avx2": 256, "scalar": 256}
# From this many activation rows on, the large-M path expands into oneDNN's blocked layout
# (quant/blocked.py) where the layer has buffers for it. Handed a plain weight, oneDNN costs
# more than its reorder: its GEMM slows with M, while writing the blocked layout costs ~10 ms
# a forward more than a plain expansion. `crossover --blocked` over 30 SmolLM2 Q4_1 layers on
# a Zen 5, 2 threads, paths alternated, blocked / expand+GEMM: 1.04 at M = 96 and 256, 1.01
# at 512, 0.96 at 768, 0.95 at 1024, 0.92 at 2048 (an earlier pass: 1.00 at 512, 0.96, 0.89,
# 0.93; two an hour later 0.87-0.91 from M = 256 on, 0.90-1.00 at 2048): all passes agree
# from 768 on. AVX2: the AVX2 build on the same Zen 5 with oneDNN capped to AVX2
# (ONEDNN_MAX_CPU_ISA=AVX2: its brg_matmul:avx2 takes the same AB16b64a layout), not an AVX2
# core: 0.97 / 0.99 / 0.92 / 0.96 / 0.97 at M = 256 / 512 / 768 / 1024 / 2048, a second pass
# 1.00 / 0.98 / 0.97 / 0.95 from 512; both agree from 768 on. None: not measured for that
# build (the plain path stays).
BLOCKED_M = {"avx512": 768, "avx2": 768, "scalar": None}
# Most fp32 bytes the large-M path expands at once: a whole SmolLM2-135M matrix (7 MB at most;
# its LM head tiles), a SmolLM2-1.7B gate/up in 5 tiles. Transient: freed after the GEMM.
EXPAND_BYTES = 32 << 20


def large_m(simd: str) -> int:
    """The switch point of the kernel build `simd` ("avx512", "avx2" or "scalar")."""
    if simd not in LARGE_M:
        raise ValueError(f"unknown packed-kernel build {simd!r}")
    return LARGE_M[simd]


def packed_linear(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None,
                  blocked: BlockedWeights | None = None) -> torch.Tensor:
    """x [M, K] fp32 -> x W^T (+ bias [N]) (+ residual [M, N]) as [M, N] fp32. `blocked`:
    the model's oneDNN-layout buffers, for the largest M (None: plain expansion)."""
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"x must be [M, {w.in_features}], got {tuple(x.shape)}")
    if x.dtype != torch.float32:  # half activations (--dtype): multiply in fp32, round back
        y = packed_linear(x.float(), w, None if bias is None else bias.float(),
                          None if residual is None else residual.float(), blocked)
        return y.to(x.dtype)
    if x.is_cuda:
        from pdserve.common.models.quant.triton_gemm import triton_packed_linear
        return triton_packed_linear(x, w, bias, residual)
    native = load_packed_kernels() if x.device.type == "cpu" else None
    if native is None:
        y = torch.nn.functional.linear(x, w.dequantize(), bias)
        return y if residual is None else y + residual
    if x.shape[0] < large_m(native.simd):
        return native.packed_gemm(x, w.data, int(w.qtype), bias, residual)
    threshold = BLOCKED_M[native.simd]
    if blocked is not None and threshold is not None and x.shape[0] >= threshold:
        prepacked = blocked.expand(w)
        if prepacked is not None:
            return _fp32_gemm(x.contiguous(), prepacked, bias, residual)
    return _expand_then_gemm(native, x, w, bias, residual)


def packed_linear_parts(x: torch.Tensor, parts: tuple[PackedWeight, ...],
                        bias: torch.Tensor | None = None,
                        blocked: BlockedWeights | None = None) -> torch.Tensor:
    """x [M, K] -> x W^T (+ bias) [M, N] for W stored as row groups `parts` (stacked in
    order; their types may differ): one `packed_linear` per part, written side by side."""
    if len(parts) == 1:
        return packed_linear(x, parts[0], bias, blocked=blocked)
    n = sum(p.out_features for p in parts)
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    n0 = 0
    for p in parts:
        n1 = n0 + p.out_features
        y[:, n0:n1] = packed_linear(x, p, None if bias is None else bias[n0:n1],
                                    blocked=blocked)
        n0 = n1
    return y


def expand(w: PackedWeight) -> torch.Tensor:
    """The whole weight as fp32 [N, K] (native when built; bit-identical either way)."""
    native = load_packed_kernels() if w.data.device.type == "cpu" else None
    if native is None:
        return w.dequantize()
    return native.dequantize(w.data, int(w.qtype), w.in_features, 0, w.out_features)


def _expand_then_gemm(native, x, w: PackedWeight, bias, residual) -> torch.Tensor:
    """The whole weight expanded once into one transient fp32 tensor and one oneDNN GEMM with
    the bias and residual fused, when it fits EXPAND_BYTES (every SmolLM2-135M matrix but the
    LM head); else tiles of rows (bounded scratch), each tile's product copied into place."""
    n, k, qt = w.out_features, w.in_features, int(w.qtype)
    x = x.contiguous()
    rows = _tile_rows(k)
    if n <= rows:
        return _fp32_gemm(x, native.dequantize(w.data, qt, k, 0, n), bias, residual)
    y = torch.empty(x.shape[0], n, dtype=x.dtype)
    for n0 in range(0, n, rows):
        n1 = min(n0 + rows, n)
        y[:, n0:n1] = _fp32_gemm(x, native.dequantize(w.data, qt, k, n0, n1), None)
    if bias is not None:
        y += bias
    return y if residual is None else y.add_(residual)


def packed_silu_and_mul(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None,
                        blocked: BlockedWeights | None = None) -> torch.Tensor:
    """x [M, K] -> silu(x Wg^T + bg) * (x Wu^T + bu) [M, N / 2] for W = [gate; up] [N, K].
    Below the switch point the native kernel computes the SiLU and the product as it stores
    (`packed_gemm_silu_mul`: one call, no [M, N] tensor to split). From there on one GEMM makes
    [M, N] = [gate | up] (`packed_linear`: the weight expanded, oneDNN) and `silu_and_mul` one
    pass over it: on an AVX2 Zen 1 1.1x faster at M 2048 than oneDNN's swish and binary-mul
    post-ops on two GEMMs."""
    native = load_packed_kernels() if x.device.type == "cpu" else None
    if (native is not None and x.dtype == torch.float32 and x.dim() == 2
            and x.shape[0] < large_m(native.simd)):  # the packed kernel, SiLU fused in it
        return native.packed_gemm_silu_mul(x, w.data, int(w.qtype), bias)
    return silu_and_mul(packed_linear(x, w, bias, blocked=blocked))


def silu_and_mul(y: torch.Tensor) -> torch.Tensor:
    """y [M, 2 H] = [gate | up] -> silu(gate) * up [M, H]: the packed kernels' one vectorized
    pass for fp32 CPU rows (exp within 2 ulp, as the sampler's), torch's ops otherwise."""
    native = load_packed_kernels() if y.device.type == "cpu" else None
    if (native is not None and y.dtype == torch.float32 and y.dim() == 2
            and y.stride(-1) == 1 and y.shape[-1] % 2 == 0):  # what the native pass takes
        return native.silu_mul(y)
    gate, up = y.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _tile_rows(k: int) -> int:
    """Weight rows the large-M path expands at once (EXPAND_BYTES of fp32)."""
    return max(1, EXPAND_BYTES // (4 * k))


def _fp32_gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
    """oneDNN's fp32 GEMM on a plain (not prepacked) weight where torch has it: on the AMD
    EPYC it matched the prepacked GEMM at M = 2048 and ran 1.2-7x faster than torch's `linear`
    (MKL's generic path on non-Intel CPUs) at SmolLM2's shapes."""
    if onednn_available():
        if residual is not None:
            return cpu_gemm_binary(x, residual, w, bias, "add")
        return cpu_gemm_linear(x, w, bias)
    y = torch.nn.functional.linear(x, w, bias)
    return y if residual is None else y.add_(residual)
