"""GGUF block-quantized weights kept packed in memory (`PackedWeight`), and their expansion.

A packed weight is the GGUF tensor's bytes, row by row: [N, K / block_size * block_bytes] uint8
for a logical [N, K] fp32 matrix, blocks along K of 32 weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
IQ4_NL) or super-blocks of 256 (the K-quants Q2_K .. Q6_K and IQ4_XS: 8 sub-blocks of 32 with
their own scales; every kernel walks K in 32-weight sub-blocks). Rows can be reordered and
concatenated without touching a block (llama.cpp's Q/K row permutation, the fused q/k/v and
gate/up projections), which is all loading needs.

`dequantize` reproduces gguf-py's `gguf.quants.dequantize` bit for bit (the products d * q are
exact in fp32; Q4_1's + m rounds once in both; a K-quant's sub-block scale d * sc and min
dmin * m are exact products of an fp16 and a 4- to 8-bit integer, so `d_s * q - m_s` rounds
once, as in numpy), so every path that expands these weights
(native kernels, this torch fallback, the Triton kernel) multiplies by exactly the fp32 weights
transformers loads from the same file.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

import numpy as np
import torch

SUB_BLOCK = 32  # weights per (sub-)block: the unit every kernel expands at a time
QK_K = 256  # weights per K-quant super-block


class QType(enum.IntEnum):
    """The GGML types kept packed; values are GGML's type ids (what the kernels take)."""

    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    IQ4_NL = 20
    IQ4_XS = 23

    @property
    def block_bytes(self) -> int:
        return _LAYOUT[self][1]

    @property
    def block_size(self) -> int:
        """Weights per block (32, or 256 for a K-quant super-block)."""
        return _LAYOUT[self][0]

    @property
    def half_offsets(self) -> tuple[int, ...]:
        """Byte offsets of a block's fp16 fields (the scale d, then the min or dmin if any)."""
        return _LAYOUT[self][2]

    @classmethod
    def from_ggml(cls, ggml_type: int) -> "QType | None":
        """The packed type for a GGML type id, or None (that tensor is expanded at load)."""
        try:
            return cls(int(ggml_type))
        except ValueError:
            return None


# qtype -> (weights per block, bytes per block as gguf's GGML_QUANT_SIZES, fp16 field offsets)
_LAYOUT = {QType.Q4_0: (32, 18, (0,)), QType.Q4_1: (32, 20, (0, 2)), QType.Q5_0: (32, 22, (0,)),
           QType.Q5_1: (32, 24, (0, 2)), QType.Q8_0: (32, 34, (0,)),
           QType.Q2_K: (QK_K, 84, (80, 82)), QType.Q3_K: (QK_K, 110, (108,)),
           QType.Q4_K: (QK_K, 144, (0, 2)), QType.Q5_K: (QK_K, 176, (0, 2)),
           QType.Q6_K: (QK_K, 210, (208,)), QType.IQ4_NL: (32, 18, (0,)),
           QType.IQ4_XS: (QK_K, 136, (0,))}

# IQ4_NL's non-linear grid: a block's nibble q stands for d * IQ4_NL_GRID[q] (gguf-py's
# IQ4_NL.kvalues, llama.cpp's kvalues_iq4nl)
IQ4_NL_GRID = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@dataclass(frozen=True, eq=False)
class PackedWeight:
    """A logical [out_features, in_features] fp32 weight held as GGUF blocks.

    data: [out_features, in_features / qtype.block_size * qtype.block_bytes] uint8, contiguous.
    """

    qtype: QType
    data: torch.Tensor
    in_features: int

    def __post_init__(self):
        if not isinstance(self.qtype, QType):
            raise ValueError(f"qtype must be a QType, got {self.qtype!r}")
        bs = self.qtype.block_size
        if self.in_features <= 0 or self.in_features % bs:
            raise ValueError(f"in_features must be a positive multiple of {bs} for "
                             f"{self.qtype.name}, got {self.in_features}")
        row_bytes = self.in_features // bs * self.qtype.block_bytes
        if (self.data.dtype != torch.uint8 or self.data.dim() != 2
                or self.data.shape[1] != row_bytes or not self.data.is_contiguous()):
            raise ValueError(f"data must be contiguous uint8 [N, {row_bytes}], got "
                             f"{self.data.dtype} {tuple(self.data.shape)}")

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def fp32_nbytes(self) -> int:
        return self.out_features * self.in_features * 4

    @classmethod
    def from_numpy(cls, qtype: QType, rows: np.ndarray, in_features: int) -> "PackedWeight":
        """rows: the tensor's bytes as [N, row_bytes] uint8 (copied: GGUF data is a read-only
        view of the file mapping)."""
        data = torch.from_numpy(np.array(rows, dtype=np.uint8, copy=True, order="C"))
        return cls(qtype, data, in_features)

    @classmethod
    def cat(cls, parts: list["PackedWeight"]) -> "PackedWeight":
        """Rows of `parts` stacked in order (fused projections); one qtype and width."""
        first = parts[0]
        if any(p.qtype != first.qtype or p.in_features != first.in_features for p in parts):
            raise ValueError("packed weights to concatenate must share qtype and in_features")
        return cls(first.qtype, torch.cat([p.data for p in parts]).contiguous(),
                   first.in_features)

    def rows(self, start: int, n: int) -> "PackedWeight":
        """Output rows [start, start + n) as their own weight (a copy, so the whole one can
        be freed): a column-parallel rank's shard."""
        if not 0 <= start <= start + n <= self.out_features or n <= 0:
            raise ValueError(f"rows [{start}, {start + n}) outside [0, {self.out_features})")
        return PackedWeight(self.qtype, self.data[start:start + n].clone(), self.in_features)

    def padded_rows(self, start: int, n: int) -> "PackedWeight":
        """Rows [start, start + n), those past the last row all-zero blocks (zero weights in
        every type: each scale is 0): a vocabulary-parallel rank's padded shard (a copy)."""
        if start < 0 or n <= 0:
            raise ValueError(f"rows [{start}, {start + n}) are not a shard")
        have = self.data[start:start + n]
        pad = self.data.new_zeros(n - have.shape[0], self.data.shape[1])
        return PackedWeight(self.qtype, torch.cat([have, pad]).contiguous(), self.in_features)

    def splits_at(self, start: int, n: int) -> bool:
        """Whether input features [start, start + n) are whole blocks (`columns` can cut
        them)."""
        bs = self.qtype.block_size
        return (n > 0 and start >= 0 and start + n <= self.in_features and start % bs == 0
                and n % bs == 0)

    def columns(self, start: int, n: int) -> "PackedWeight":
        """Input features [start, start + n), whole blocks only (a copy): a row-parallel
        rank's shard."""
        if not self.splits_at(start, n):
            raise ValueError(f"input features [{start}, {start + n}) of {self.in_features} are "
                             f"not whole {self.qtype.name} blocks of {self.qtype.block_size}")
        bs, bb = self.qtype.block_size, self.qtype.block_bytes
        blocks = self.data.view(self.out_features, self.in_features // bs, bb)
        part = self.data.new_empty(self.out_features, n // bs, bb)
        part.copy_(blocks[:, start // bs:(start + n) // bs])
        return PackedWeight(self.qtype, part.view(self.out_features, -1), n)

    def apply(self, fn) -> "PackedWeight":
        """The same weight with `fn` applied to its bytes (nn.Module._apply: device moves)."""
        data = fn(self.data)
        return self if data is self.data else PackedWeight(self.qtype, data, self.in_features)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 [N, K] (or [len(rows), K] for the given row ids), with torch ops on the data's
        device; bit-identical to gguf-py's dequantize."""
        data = self.data if rows is None else self.data[rows]
        return expand_blocks(data, self.qtype, self.in_features)


def stack_runs(parts: list[PackedWeight]) -> tuple[PackedWeight, ...]:
    """Fused projections' packed shards, in output order -> one weight per run of consecutive
    shards that share qtype and in_features (rows stacked): one part for a uniform layer,
    several for a Q4_K_M q/k/v whose v is Q6_K."""
    runs: list[list[PackedWeight]] = []
    for p in parts:
        if runs and (runs[-1][0].qtype, runs[-1][0].in_features) == (p.qtype, p.in_features):
            runs[-1].append(p)
        else:
            runs.append([p])
    return tuple(r[0] if len(r) == 1 else PackedWeight.cat(r) for r in runs)


def expand_blocks(data: torch.Tensor, qtype: QType, in_features: int) -> torch.Tensor:
    """[R, K / block_size * block_bytes] uint8 -> [R, K] fp32, torch ops (the reference)."""
    r = data.shape[0]
    blocks = data.reshape(r, in_features // qtype.block_size, qtype.block_bytes)
    return _EXPAND[qtype](blocks).reshape(r, in_features)


def _expand_q8_0(b: torch.Tensor) -> torch.Tensor:  # [R, nb, 34] -> [R, nb, 32]
    return b[..., 2:].contiguous().view(torch.int8).float() * _half(b[..., 0:2])


def _expand_q4_0(b: torch.Tensor) -> torch.Tensor:  # [R, nb, 18] -> [R, nb, 32]
    return _half(b[..., 0:2]) * (_nibbles(b[..., 2:]) - 8.0)


def _expand_q4_1(b: torch.Tensor) -> torch.Tensor:  # [R, nb, 20] -> [R, nb, 32]
    return _half(b[..., 0:2]) * _nibbles(b[..., 4:]) + _half(b[..., 2:4])


def _q5_quants(b: torch.Tensor, qh_at: int) -> torch.Tensor:
    """Q5_0 / Q5_1 [R, nb, bytes] -> the 32 quants 0..31 [R, nb, 32] fp32: the nibbles after
    the 4 bytes of qh, bit i of qh (little-endian) bit 4 of element i."""
    qh = b[..., qh_at:qh_at + 4].unsqueeze(-1)  # [R, nb, 4, 1]: byte i / 8 holds bit i % 8
    bits = torch.arange(8, dtype=torch.uint8, device=b.device)
    high = ((qh >> bits) & 1).flatten(-2)  # [R, nb, 32]
    return _nibbles(b[..., qh_at + 4:qh_at + 20]) + 16.0 * high.float()


def _expand_q5_0(b: torch.Tensor) -> torch.Tensor:  # [R, nb, 22] -> [R, nb, 32]
    return _half(b[..., 0:2]) * (_q5_quants(b, 2) - 16.0)


def _expand_q5_1(b: torch.Tensor) -> torch.Tensor:  # [R, nb, 24] -> [R, nb, 32]
    return _half(b[..., 0:2]) * _q5_quants(b, 4) + _half(b[..., 2:4])


@functools.cache
def _iq4_grid(device: torch.device) -> torch.Tensor:
    """IQ4_NL_GRID as a [16] fp32 tensor on `device`, made once per device: built per call it
    was a host-to-device copy per packed-embedding lookup where the torch path runs on CUDA."""
    return torch.tensor(IQ4_NL_GRID, dtype=torch.float32, device=device)


def _iq4_levels(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] nibble bytes -> [..., 32] fp32 grid levels (element j low, j + 16 high)."""
    return _iq4_grid(qs.device)[_nibble_codes(qs).long()]


def _expand_iq4_nl(b: torch.Tensor) -> torch.Tensor:  # [R, nb, 18] -> [R, nb, 32]
    return _half(b[..., 0:2]) * _iq4_levels(b[..., 2:])  # exact: fp16 times a 7-bit level


def _expand_iq4_xs(b: torch.Tensor) -> torch.Tensor:  # [R, nb, 136] -> [R, nb, 256]
    lo = torch.stack([b[..., 4:8] & 0x0F, b[..., 4:8] >> 4], dim=-1).flatten(-2)  # [R, nb, 8]
    h = b[..., 2].int() | (b[..., 3].int() << 8)  # scales_h, little-endian
    hi = (h.unsqueeze(-1) >> (2 * torch.arange(8, device=b.device))) & 3
    ls = lo.int() | (hi << 4)
    dl = _half(b[..., 0:2]) * (ls - 32).float()  # [R, nb, 8], exact
    levels = _iq4_levels(b[..., 8:].reshape(*b.shape[:-1], 8, 16))  # [R, nb, 8, 32]
    return (dl.unsqueeze(-1) * levels).flatten(-2)  # exact too: at most 23 significant bits


def _nibble_codes(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32] uint8: element j low nibble, j + 16 high nibble."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32] fp32 nibbles (_nibble_codes' order)."""
    return _nibble_codes(qs).float()


def _kquant_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K [R, nb, bytes] -> the 8 sub-block scales d * sc and mins dmin * m,
    each [R, nb, 8, 1] fp32 (6-bit sc, m unpacked from bytes 4 .. 16 as gguf-py does)."""
    s = b[..., 4:16]
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], dim=-1).float()
    mn = torch.cat([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], dim=-1).float()
    return (_half(b[..., 0:2]) * sc).unsqueeze(-1), (_half(b[..., 2:4]) * mn).unsqueeze(-1)


def _low_high(qs: torch.Tensor) -> torch.Tensor:
    """[R, nb, 128] bytes -> [R, nb, 8, 32]: per 32-byte chunk, low nibbles then high ones."""
    c = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return torch.cat([c & 0x0F, c >> 4], dim=-2).reshape(*qs.shape[:-1], 8, 32)


def _expand_q4_k(b: torch.Tensor) -> torch.Tensor:  # [R, nb, 144] -> [R, nb, 256]
    d, m = _kquant_scales(b)
    return (d * _low_high(b[..., 16:]).float() - m).flatten(-2)


def _expand_q5_k(b: torch.Tensor) -> torch.Tensor:  # [R, nb, 176] -> [R, nb, 256]
    d, m = _kquant_scales(b)
    qh = b[..., 16:48].unsqueeze(-2)  # [R, nb, 1, 32]: bit s of byte i -> sub-block s
    bits = torch.arange(8, dtype=torch.uint8, device=b.device).view(8, 1)
    q = _low_high(b[..., 48:]) | (((qh >> bits) & 1) << 4)
    return (d * q.float() - m).flatten(-2)


def _expand_q6_k(b: torch.Tensor) -> torch.Tensor:  # [R, nb, 210] -> [R, nb, 256]
    ql = b[..., 0:128].reshape(*b.shape[:-1], 2, 1, 64)
    ql = torch.cat([ql & 0x0F, ql >> 4], dim=-2).reshape(*b.shape[:-1], 8, 32)
    qh = b[..., 128:192].reshape(*b.shape[:-1], 2, 1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).view(4, 1)
    qh = ((qh >> shifts) & 3).reshape(*b.shape[:-1], 8, 32)
    q = ((ql | (qh << 4)).view(torch.int8) - 32).float().reshape(*b.shape[:-1], 16, 16)
    sc = b[..., 192:208].contiguous().view(torch.int8).float()  # [R, nb, 16]
    return (_half(b[..., 208:210]) * sc).unsqueeze(-1).mul(q).flatten(-2)


def _crumbs(qs: torch.Tensor) -> torch.Tensor:
    """[R, nb, 64] bytes -> [R, nb, 8, 32] 2-bit values: sub-block s holds bits 2 (s % 4) of
    32-byte chunk s // 4 (Q2_K's and Q3_K's low bits)."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=qs.device).view(4, 1)
    c = qs.reshape(*qs.shape[:-1], 2, 1, 32)
    return ((c >> shifts) & 3).reshape(*qs.shape[:-1], 8, 32)


def _expand_q2_k(b: torch.Tensor) -> torch.Tensor:  # [R, nb, 84] -> [R, nb, 256]
    sc = b[..., 0:16]  # per 16 weights: low nibble scale, high nibble min
    d = (_half(b[..., 80:82]) * (sc & 0x0F).float()).unsqueeze(-1)  # [R, nb, 16, 1]
    m = (_half(b[..., 82:84]) * (sc >> 4).float()).unsqueeze(-1)
    q = _crumbs(b[..., 16:80]).float().reshape(*b.shape[:-1], 16, 16)
    return (d * q - m).flatten(-2)


def _expand_q3_k(b: torch.Tensor) -> torch.Tensor:  # [R, nb, 110] -> [R, nb, 256]
    hm = b[..., 0:32].unsqueeze(-2)  # [R, nb, 1, 32]: bit s of byte i -> sub-block s
    bits = torch.arange(8, dtype=torch.uint8, device=b.device).view(8, 1)
    # q = low 2 bits - 4 where the hmask bit is clear: -4 .. 3
    q = _crumbs(b[..., 32:96]).to(torch.int8) - (((hm >> bits) & 1) ^ 1).to(torch.int8) * 4
    s = b[..., 96:108]
    lo = torch.cat([s[..., 0:8] & 0x0F, s[..., 0:8] >> 4], dim=-1)  # [R, nb, 16]
    hi = torch.cat([(s[..., 8:12] >> (2 * t)) & 3 for t in range(4)], dim=-1)
    sc = ((lo | (hi << 4)).to(torch.int8) - 32).float()
    d = (_half(b[..., 108:110]) * sc).unsqueeze(-1)  # [R, nb, 16, 1]
    return (d * q.float().reshape(*b.shape[:-1], 16, 16)).flatten(-2)


_EXPAND = {QType.Q4_0: _expand_q4_0, QType.Q4_1: _expand_q4_1, QType.Q5_0: _expand_q5_0,
           QType.Q5_1: _expand_q5_1, QType.Q8_0: _expand_q8_0,
           QType.Q2_K: _expand_q2_k, QType.Q3_K: _expand_q3_k,
           QType.Q4_K: _expand_q4_k, QType.Q5_K: _expand_q5_k, QType.Q6_K: _expand_q6_k,
           QType.IQ4_NL: _expand_iq4_nl, QType.IQ4_XS: _expand_iq4_xs}


def _half(two_bytes: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 little-endian fp16 -> [..., 1] fp32."""
    return two_bytes.contiguous().view(torch.float16).float()
