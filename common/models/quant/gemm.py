"""y = x @ W^T for a packed weight (quant/packed.py): which kernel runs, by device and M.

- CPU, M < LARGE_M: the native packed kernel (cpu_kernels/packed_gemm.cpp), threads over
  output rows: for a few rows each block is expanded in registers; from 4 rows on, a panel of
  weight rows is expanded once into cache-resident scratch and a register-tiled micro-kernel
  runs over all rows. Decode steps live here; the weight bytes streamed per step are the packed
  ones (Q4_1: 0.625 bytes per weight instead of 4; Q4_K 0.5625, Q6_K 0.82).
- CPU, M >= LARGE_M: expand TILE_ROWS rows of W at a time to fp32 (native) and multiply with
  oneDNN's fp32 GEMM (torch's where oneDNN is missing). With many rows the GEMM is compute-bound, the expansion is paid once per
  M rows, and the tuned GEMM beats the packed kernel (whose activation blocks stream from L3
  once per panel).
- CUDA: the Triton kernel (quant/triton_gemm.py), which expands blocks in registers too.
- Otherwise (no native build): expand with torch ops (packed.py) and multiply.

Every path multiplies by exactly the fp32 weights gguf-py dequantizes and accumulates in fp32,
so results differ from the dequantized-fp32 GEMM only by summation order.
"""

from __future__ import annotations

import torch

from pdserve.common.models.cpu_gemm import onednn_available
from pdserve.common.models.cpu_gemm import packed_linear as cpu_gemm_linear
from pdserve.common.models.quant.cpu_native import load_packed_kernels
from pdserve.common.models.quant.packed import PackedWeight

# Measured on the 2-core AMD EPYC (AVX2 build, 2 threads) over 30 SmolLM2-shaped Q4_1 layers
# with `flock /tmp/pdserve-cpu.lock python -m pdserve.common.models.quant.crossover` (numbers
# in docs/packed-weights.md): the packed kernel is 1.7-8.7x faster than expand + fp32 GEMM up
# to M = 128, expand + GEMM faster from M = 256 on (0.64x at 256, 0.88x at 512).
LARGE_M = 256
TILE_ROWS = 1024  # rows expanded per GEMM call on the large-M path: 2.4 MB at K = 576


def packed_linear(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp32 -> x W^T (+ bias [N]) (+ residual [M, N]) as [M, N] fp32."""
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"x must be [M, {w.in_features}], got {tuple(x.shape)}")
    if x.dtype != torch.float32:  # half activations (--dtype): multiply in fp32, round back
        y = packed_linear(x.float(), w, None if bias is None else bias.float(),
                          None if residual is None else residual.float())
        return y.to(x.dtype)
    if x.is_cuda:
        from pdserve.common.models.quant.triton_gemm import triton_packed_linear
        return triton_packed_linear(x, w, bias, residual)
    native = load_packed_kernels() if x.device.type == "cpu" else None
    if native is None:
        y = torch.nn.functional.linear(x, w.dequantize(), bias)
        return y if residual is None else y + residual
    if x.shape[0] < LARGE_M:
        return native.packed_gemm(x, w.data, int(w.qtype), bias, residual)
    return _expand_then_gemm(native, x, w, bias, residual)


def expand(w: PackedWeight) -> torch.Tensor:
    """The whole weight as fp32 [N, K] (native when built; bit-identical either way)."""
    native = load_packed_kernels() if w.data.device.type == "cpu" else None
    if native is None:
        return w.dequantize()
    return native.dequantize(w.data, int(w.qtype), w.in_features, 0, w.out_features)


def _expand_then_gemm(native, x, w: PackedWeight, bias, residual) -> torch.Tensor:
    """Expand TILE_ROWS rows at a time (bounded scratch, never the whole fp32 weight)."""
    n, k, qt = w.out_features, w.in_features, int(w.qtype)
    x = x.contiguous()
    if n <= TILE_ROWS:
        y = _fp32_gemm(x, native.dequantize(w.data, qt, k, 0, n), bias)
    else:
        y = torch.empty(x.shape[0], n, dtype=x.dtype)
        for n0 in range(0, n, TILE_ROWS):
            n1 = min(n0 + TILE_ROWS, n)
            y[:, n0:n1] = _fp32_gemm(x, native.dequantize(w.data, qt, k, n0, n1), None)
        if bias is not None:
            y += bias
    return y if residual is None else y.add_(residual)


def _fp32_gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's fp32 GEMM on a plain (not prepacked) weight where torch has it: on the AMD
    EPYC it matched the prepacked GEMM at M = 2048 and ran 1.2-7x faster than torch's `linear`
    (MKL's generic path on non-Intel CPUs) at SmolLM2's shapes."""
    if onednn_available():
        return cpu_gemm_linear(x, w, bias)
    return torch.nn.functional.linear(x, w, bias)
