"""The packed-weight GEMM on CUDA (Triton): y = x @ W^T (+ bias) (+ residual), W GGUF-packed.

Grid: (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)). A program walks K one 32-weight (sub-)block at a
time (Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / IQ4_NL blocks, or the 8 sub-blocks of a K-quant or
IQ4_XS super-block): it loads its BLOCK_N rows' scale (and min) and quants, expands them to fp32
in registers exactly as gguf-py dequantizes (quant/packed.py; a K-quant's sub-block scale d * sc
and min dmin * m are exact products, so d_s * q - m_s rounds once, fused or not), and
accumulates x_tile @ w_tile^T in fp32 with `input_precision="ieee"` (never TF32, which would
round the operands). So, as on the CPU, the result is the dequantized-fp32 GEMM up to summation
order, from packed bytes.

Launched compiled on CUDA and interpreted on the CPU (the tests), through the attention kernels'
`device_kernel` (common/attention/triton_kernels/_launch.py), so it uses builtins only.
"""

from __future__ import annotations

import torch
import triton.language as tl

from pdserve.common.attention.triton_kernels._launch import device_kernel, pow2
from pdserve.common.models.quant.packed import IQ4_NL_GRID, SUB_BLOCK, PackedWeight, QType


@device_kernel
def _packed_gemm_kernel(
    x_ptr,  # [M, K] fp32, row stride stride_xm
    w_ptr,  # [N, row_bytes] uint8
    bias_ptr,  # [N] fp32 (HAS_BIAS)
    res_ptr,  # [M, N] fp32, row stride stride_rm (HAS_RES)
    out_ptr,  # [M, N] fp32 contiguous
    M, N, NUM_SUBS, stride_xm, row_bytes, stride_rm,
    QT: tl.constexpr, BLOCK_BYTES: tl.constexpr, SUBS: tl.constexpr, QS_OFFSET: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
    IQ4_GRID_0: tl.constexpr, IQ4_GRID_1: tl.constexpr, IQ4_GRID_2: tl.constexpr,
    IQ4_GRID_3: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.arange(0, 32)  # element within a (sub-)block
    m_mask = m < M
    n_mask = n < N
    wmask = n_mask[:, None]
    if QT == 8:  # Q8_0: byte j holds element j
        q_byte = j
        q_shift = j * 0
    else:  # Q4: byte j % 16, low nibble for j < 16, high nibble after
        q_byte = j % 16
        q_shift = (j // 16) * 4
    w_rows = w_ptr + n.to(tl.int64) * row_bytes  # [BLOCK_N] pointers
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for g in range(0, NUM_SUBS):  # sub-block s of super-block g // SUBS (SUBS = 1: blocks)
        blk = w_rows + (g // SUBS) * BLOCK_BYTES
        s = g % SUBS
        if QT == 12 or QT == 13:  # Q4_K / Q5_K: (d * sc[s]) * q - dmin * m[s]
            d = (tl.load(blk, mask=n_mask, other=0).to(tl.uint16)
                 | (tl.load(blk + 1, mask=n_mask, other=0).to(tl.uint16) << 8)
                 ).to(tl.float16, bitcast=True).to(tl.float32)  # [BLOCK_N]
            dmin = (tl.load(blk + 2, mask=n_mask, other=0).to(tl.uint16)
                    | (tl.load(blk + 3, mask=n_mask, other=0).to(tl.uint16) << 8)
                    ).to(tl.float16, bitcast=True).to(tl.float32)
            # the 6-bit sc[s], m[s] from scale bytes s, s + 4 and (s + 4) % 8 (gguf-py's layout)
            a = tl.load(blk + 4 + s, mask=n_mask, other=0).to(tl.int32)
            b4 = tl.load(blk + 8 + s, mask=n_mask, other=0).to(tl.int32)
            c = tl.load(blk + 4 + (s + 4) % 8, mask=n_mask, other=0).to(tl.int32)
            sc = tl.where(s < 4, a & 63, (b4 & 15) | ((c >> 6) << 4))
            mn = tl.where(s < 4, b4 & 63, (b4 >> 4) | ((a >> 6) << 4))
            ds = d * sc.to(tl.float32)
            ms = dmin * mn.to(tl.float32)
            raw = tl.load(blk[:, None] + QS_OFFSET + 32 * (s // 2) + j[None, :], mask=wmask,
                          other=0).to(tl.int32)  # [BLOCK_N, 32]
            q = (raw >> (4 * (s % 2))) & 15
            if QT == 13:  # Q5_K: bit s of qh[j] is bit 4
                qh = tl.load(blk[:, None] + 16 + j[None, :], mask=wmask, other=0).to(tl.int32)
                q = q | (((qh >> s) & 1) << 4)
            w = ds[:, None] * q.to(tl.float32) - ms[:, None]
        elif QT == 10 or QT == 11:  # Q2_K / Q3_K: 2 low bits, a scale per 16 weights
            q = (tl.load(blk[:, None] + QS_OFFSET + 32 * (s // 4) + j[None, :], mask=wmask,
                         other=0).to(tl.int32) >> (2 * (s % 4))) & 3  # [BLOCK_N, 32]
            e16 = 2 * s + j // 16  # [32]: the scale of each element
            if QT == 10:  # Q2_K: (d * sc) * q - dmin * m, sc / m the nibbles of byte e16
                sm = tl.load(blk[:, None] + e16[None, :], mask=wmask, other=0).to(tl.int32)
                d = (tl.load(blk + 80, mask=n_mask, other=0).to(tl.uint16)
                     | (tl.load(blk + 81, mask=n_mask, other=0).to(tl.uint16) << 8)
                     ).to(tl.float16, bitcast=True).to(tl.float32)
                dmin = (tl.load(blk + 82, mask=n_mask, other=0).to(tl.uint16)
                        | (tl.load(blk + 83, mask=n_mask, other=0).to(tl.uint16) << 8)
                        ).to(tl.float16, bitcast=True).to(tl.float32)
                w = ((d[:, None] * (sm & 15).to(tl.float32)) * q.to(tl.float32)
                     - dmin[:, None] * (sm >> 4).to(tl.float32))
            else:  # Q3_K: (d * (sc - 32)) * (q - 4 where bit s of hmask[j] is clear)
                hb = (tl.load(blk[:, None] + j[None, :], mask=wmask, other=0).to(tl.int32)
                      >> s) & 1
                q = q - 4 * (1 - hb)
                lo = (tl.load(blk[:, None] + 96 + e16[None, :] % 8, mask=wmask, other=0
                              ).to(tl.int32) >> (4 * (e16[None, :] // 8))) & 15
                hi = (tl.load(blk[:, None] + 104 + e16[None, :] % 4, mask=wmask, other=0
                              ).to(tl.int32) >> (2 * (e16[None, :] // 4))) & 3
                d = (tl.load(blk + 108, mask=n_mask, other=0).to(tl.uint16)
                     | (tl.load(blk + 109, mask=n_mask, other=0).to(tl.uint16) << 8)
                     ).to(tl.float16, bitcast=True).to(tl.float32)
                w = (d[:, None] * ((lo | (hi << 4)) - 32).to(tl.float32)) * q.to(tl.float32)
        elif QT == 14:  # Q6_K: (d * scale[e / 16]) * (q - 32)
            t = s % 4
            h = s // 4
            lo = (tl.load(blk[:, None] + 64 * h + 32 * (t % 2) + j[None, :], mask=wmask,
                          other=0).to(tl.int32) >> (4 * (t // 2))) & 15
            hi = (tl.load(blk[:, None] + 128 + 32 * h + j[None, :], mask=wmask,
                          other=0).to(tl.int32) >> (2 * t)) & 3
            q = (lo | (hi << 4)) - 32
            sc = tl.load(blk[:, None] + 192 + 2 * s + j[None, :] // 16, mask=wmask,
                         other=0).to(tl.int8, bitcast=True).to(tl.float32)  # [BLOCK_N, 32]
            d = (tl.load(blk + 208, mask=n_mask, other=0).to(tl.uint16)
                 | (tl.load(blk + 209, mask=n_mask, other=0).to(tl.uint16) << 8)
                 ).to(tl.float16, bitcast=True).to(tl.float32)
            w = (d[:, None] * sc) * q.to(tl.float32)
        elif QT == 20 or QT == 23:  # IQ4_NL: d * grid[q]; IQ4_XS: (d * (ls[s] - 32)) * grid[q]
            dl = (tl.load(blk, mask=n_mask, other=0).to(tl.uint16)
                  | (tl.load(blk + 1, mask=n_mask, other=0).to(tl.uint16) << 8)
                  ).to(tl.float16, bitcast=True).to(tl.float32)
            if QT == 23:  # sub-block s's 6-bit scale; its nibbles at 8 + 16 s
                sh = (tl.load(blk + 2, mask=n_mask, other=0).to(tl.int32)
                      | (tl.load(blk + 3, mask=n_mask, other=0).to(tl.int32) << 8))
                sl = tl.load(blk + 4 + s // 2, mask=n_mask, other=0).to(tl.int32)
                ls = ((sl >> (4 * (s % 2))) & 15) | (((sh >> (2 * s)) & 3) << 4)
                dl = dl * (ls - 32).to(tl.float32)  # exact
            nib = ((tl.load(blk[:, None] + QS_OFFSET + 16 * s + q_byte[None, :], mask=wmask,
                            other=0).to(tl.int64) >> q_shift[None, :].to(tl.int64)) & 15)
            # grid[q] + 128 is byte q % 4 of word q // 4
            word = tl.where(nib < 4, IQ4_GRID_0, tl.where(nib < 8, IQ4_GRID_1, tl.where(
                nib < 12, IQ4_GRID_2, IQ4_GRID_3)))
            w = dl[:, None] * (((word >> (8 * (nib % 4))) & 255) - 128).to(tl.float32)  # exact
        else:
            d_bits = (tl.load(blk, mask=n_mask, other=0).to(tl.uint16)
                      | (tl.load(blk + 1, mask=n_mask, other=0).to(tl.uint16) << 8))
            d = d_bits.to(tl.float16, bitcast=True).to(tl.float32)  # [BLOCK_N]
            raw = tl.load(blk[:, None] + QS_OFFSET + q_byte[None, :], mask=wmask,
                          other=0)  # [BLOCK_N, 32] uint8
            if QT == 8:
                q = raw.to(tl.int8, bitcast=True).to(tl.float32)
                w = d[:, None] * q
            else:
                q = ((raw >> q_shift[None, :].to(tl.uint8)) & 0x0F).to(tl.float32)
                if QT == 6 or QT == 7:  # Q5_0 / Q5_1: bit j of qh (before the nibbles) is bit 4
                    qh = (tl.load(blk[:, None] + QS_OFFSET - 4 + j[None, :] // 8, mask=wmask,
                                  other=0).to(tl.int32) >> (j[None, :] % 8)) & 1
                    q = q + 16.0 * qh.to(tl.float32)
                if QT == 6:  # Q5_0: d * (q - 16), exact
                    w = d[:, None] * (q - 16.0)
                elif QT == 3 or QT == 7:  # Q4_1 / Q5_1: d * q + m (one rounding, as numpy)
                    m_bits = (tl.load(blk + 2, mask=n_mask, other=0).to(tl.uint16)
                              | (tl.load(blk + 3, mask=n_mask, other=0).to(tl.uint16) << 8))
                    mn = m_bits.to(tl.float16, bitcast=True).to(tl.float32)
                    w = d[:, None] * q + mn[:, None]
                else:  # Q4_0: d * (q - 8)
                    w = d[:, None] * (q - 8.0)
        x = tl.load(x_ptr + m[:, None].to(tl.int64) * stride_xm + g * 32 + j[None, :],
                    mask=m_mask[:, None], other=0.0)  # [BLOCK_M, 32]
        acc += tl.dot(x, tl.trans(w), input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0)[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if HAS_RES:
        acc += tl.load(res_ptr + m[:, None].to(tl.int64) * stride_rm + n[None, :], mask=mask,
                       other=0.0)
    tl.store(out_ptr + m[:, None].to(tl.int64) * N + n[None, :], acc, mask=mask)


def _signed32(word: int) -> int:
    return word - (1 << 32) if word >= 1 << 31 else word


# IQ4_NL's 16 levels + 128 (0..241), four bytes to a word: a table without a table argument.
# Stored as signed 32-bit values, so Triton types every one of them int32 (from 2^31 on it
# would pick uint32); a byte reads back with a shift and a mask whatever the sign.
_IQ4_WORDS = tuple(_signed32(sum((IQ4_NL_GRID[4 * w + i] + 128) << (8 * i) for i in range(4)))
                   for w in range(4))

# byte offset of the quants in a block (sub-block 0's low bits, for Q2_K .. Q5_K and IQ4_XS);
# 2 otherwise (Q6_K's offsets are in the kernel)
_QS_OFFSET = {QType.Q4_1: 4, QType.Q5_0: 6, QType.Q5_1: 8, QType.IQ4_XS: 8, QType.Q2_K: 16,
              QType.Q3_K: 32, QType.Q4_K: 16, QType.Q5_K: 48}


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
        out, m_rows, n, k // SUB_BLOCK, x.stride(0), w.data.shape[1],
        residual.stride(0) if residual is not None else 0,
        QT=int(w.qtype), BLOCK_BYTES=w.qtype.block_bytes,
        SUBS=w.qtype.block_size // SUB_BLOCK, QS_OFFSET=_QS_OFFSET.get(w.qtype, 2),
        BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_BIAS=bias is not None, HAS_RES=residual is not None,
        IQ4_GRID_0=_IQ4_WORDS[0], IQ4_GRID_1=_IQ4_WORDS[1], IQ4_GRID_2=_IQ4_WORDS[2],
        IQ4_GRID_3=_IQ4_WORDS[3])
    return out
