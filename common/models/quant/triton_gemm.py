"""The packed-weight GEMM on CUDA (Triton): y = x @ W^T (+ bias) (+ residual), W GGUF-packed.

Grid: (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)). A program walks K one 32-weight block at a time: it
loads its BLOCK_N rows' scale (and min) and quants, expands them to fp32 in registers exactly as
gguf-py dequantizes (quant/packed.py), and accumulates x_tile @ w_tile^T in fp32 with
`input_precision="ieee"` (never TF32, which would round the operands). So, as on the CPU, the
result is the dequantized-fp32 GEMM up to summation order, from packed bytes.

Launched compiled on CUDA and interpreted on the CPU (the tests), through the attention kernels'
`device_kernel` (common/attention/triton_kernels/_launch.py), so it uses builtins only.
"""

from __future__ import annotations

import torch
import triton.language as tl

from pdserve.common.attention.triton_kernels._launch import device_kernel, pow2
from pdserve.common.models.quant.packed import BLOCK, PackedWeight, QType


@device_kernel
def _packed_gemm_kernel(
    x_ptr,  # [M, K] fp32, row stride stride_xm
    w_ptr,  # [N, row_bytes] uint8
    bias_ptr,  # [N] fp32 (HAS_BIAS)
    res_ptr,  # [M, N] fp32, row stride stride_rm (HAS_RES)
    out_ptr,  # [M, N] fp32 contiguous
    M, N, NUM_BLOCKS, stride_xm, row_bytes, stride_rm,
    QT: tl.constexpr, BLOCK_BYTES: tl.constexpr, QS_OFFSET: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.arange(0, 32)  # element within a block
    m_mask = m < M
    n_mask = n < N
    if QT == 8:  # Q8_0: byte j holds element j
        q_byte = j
        q_shift = j * 0
    else:  # Q4: byte j % 16, low nibble for j < 16, high nibble after
        q_byte = j % 16
        q_shift = (j // 16) * 4
    w_rows = w_ptr + n.to(tl.int64) * row_bytes  # [BLOCK_N] pointers
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for b in range(0, NUM_BLOCKS):
        blk = w_rows + b * BLOCK_BYTES
        d_bits = (tl.load(blk, mask=n_mask, other=0).to(tl.uint16)
                  | (tl.load(blk + 1, mask=n_mask, other=0).to(tl.uint16) << 8))
        d = d_bits.to(tl.float16, bitcast=True).to(tl.float32)  # [BLOCK_N]
        raw = tl.load(blk[:, None] + QS_OFFSET + q_byte[None, :], mask=n_mask[:, None],
                      other=0)  # [BLOCK_N, 32] uint8
        if QT == 8:
            q = raw.to(tl.int8, bitcast=True).to(tl.float32)
            w = d[:, None] * q
        else:
            q = ((raw >> q_shift[None, :].to(tl.uint8)) & 0x0F).to(tl.float32)
            if QT == 3:  # Q4_1: d * q + m (the product is exact, so one rounding, as numpy)
                m_bits = (tl.load(blk + 2, mask=n_mask, other=0).to(tl.uint16)
                          | (tl.load(blk + 3, mask=n_mask, other=0).to(tl.uint16) << 8))
                mn = m_bits.to(tl.float16, bitcast=True).to(tl.float32)
                w = d[:, None] * q + mn[:, None]
            else:  # Q4_0: d * (q - 8)
                w = d[:, None] * (q - 8.0)
        x = tl.load(x_ptr + m[:, None].to(tl.int64) * stride_xm + b * 32 + j[None, :],
                    mask=m_mask[:, None], other=0.0)  # [BLOCK_M, 32]
        acc += tl.dot(x, tl.trans(w), input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0)[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if HAS_RES:
        acc += tl.load(res_ptr + m[:, None].to(tl.int64) * stride_rm + n[None, :], mask=mask,
                       other=0.0)
    tl.store(out_ptr + m[:, None].to(tl.int64) * N + n[None, :], acc, mask=mask)


def triton_packed_linear(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None,
                         residual: torch.Tensor | None = None, block_n: int = 64
                         ) -> torch.Tensor:
    """x [M, K] fp32 (unit column stride) -> x W^T (+ bias [N]) (+ residual [M, N]) [M, N]."""
    m_rows, k = x.shape
    n = w.out_features
    if k != w.in_features or x.dtype != torch.float32 or x.stride(1) != 1:
        raise ValueError(f"x must be fp32 [M, {w.in_features}] with unit column stride, got "
                         f"{x.dtype} {tuple(x.shape)}")
    if residual is not None and (residual.shape != (m_rows, n) or residual.stride(1) != 1):
        raise ValueError(f"residual must be [M, N] = {(m_rows, n)} with unit column stride")
    out = torch.empty(m_rows, n, dtype=torch.float32, device=x.device)
    if m_rows == 0 or n == 0:
        return out
    block_m = min(pow2(m_rows, 16), 64)  # tl.dot wants >= 16 rows
    grid = (-(-m_rows // block_m), -(-n // block_n))
    _packed_gemm_kernel.on(x.device)[grid](
        x, w.data, bias if bias is not None else out, residual if residual is not None else out,
        out, m_rows, n, k // BLOCK, x.stride(0), w.data.shape[1],
        residual.stride(0) if residual is not None else 0,
        QT=int(w.qtype), BLOCK_BYTES=w.qtype.block_bytes,
        QS_OFFSET=4 if w.qtype == QType.Q4_1 else 2, BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_BIAS=bias is not None, HAS_RES=residual is not None)
    return out
