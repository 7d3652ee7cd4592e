"""GGUF block-quantized weights kept packed in memory (`PackedWeight`), and their expansion.

A packed weight is the GGUF tensor's bytes, row by row: [N, K / 32 * block_bytes] uint8 for a
logical [N, K] fp32 matrix, blocks of 32 along K. Rows can be reordered and concatenated
without touching a block (llama.cpp's Q/K row permutation, the fused q/k/v and gate/up
projections), which is all loading needs.

`dequantize` reproduces gguf-py's `gguf.quants.dequantize` bit for bit (the products d * q are
exact in fp32; Q4_1's + m rounds once in both), so every path that expands these weights
(native kernels, this torch fallback, the Triton kernel) multiplies by exactly the fp32 weights
transformers loads from the same file.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32  # weights per block, for every type packed here


class QType(enum.IntEnum):
    """The GGML types kept packed; values are GGML's type ids (what the kernels take)."""

    Q4_0 = 2
    Q4_1 = 3
    Q8_0 = 8

    @property
    def block_bytes(self) -> int:
        return {QType.Q4_0: 18, QType.Q4_1: 20, QType.Q8_0: 34}[self]

    @classmethod
    def from_ggml(cls, ggml_type: int) -> "QType | None":
        """The packed type for a GGML type id, or None (that tensor is expanded at load)."""
        try:
            return cls(int(ggml_type))
        except ValueError:
            return None


@dataclass(frozen=True, eq=False)
class PackedWeight:
    """A logical [out_features, in_features] fp32 weight held as GGUF blocks.

    data: [out_features, in_features / 32 * qtype.block_bytes] uint8, contiguous.
    """

    qtype: QType
    data: torch.Tensor
    in_features: int

    def __post_init__(self):
        if not isinstance(self.qtype, QType):
            raise ValueError(f"qtype must be a QType, got {self.qtype!r}")
        if self.in_features <= 0 or self.in_features % BLOCK:
            raise ValueError(f"in_features must be a positive multiple of {BLOCK}, "
                             f"got {self.in_features}")
        row_bytes = self.in_features // BLOCK * self.qtype.block_bytes
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

    def apply(self, fn) -> "PackedWeight":
        """The same weight with `fn` applied to its bytes (nn.Module._apply: device moves)."""
        data = fn(self.data)
        return self if data is self.data else PackedWeight(self.qtype, data, self.in_features)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 [N, K] (or [len(rows), K] for the given row ids), with torch ops on the data's
        device; bit-identical to gguf-py's dequantize."""
        data = self.data if rows is None else self.data[rows]
        return expand_blocks(data, self.qtype, self.in_features)


def expand_blocks(data: torch.Tensor, qtype: QType, in_features: int) -> torch.Tensor:
    """[R, K / 32 * block_bytes] uint8 -> [R, K] fp32, torch ops (the reference expansion)."""
    r = data.shape[0]
    blocks = data.reshape(r, in_features // BLOCK, qtype.block_bytes)
    d = _half(blocks[..., 0:2])
    if qtype == QType.Q8_0:
        q = blocks[..., 2:].contiguous().view(torch.int8).float()
        return (q * d).reshape(r, in_features)
    qs = blocks[..., 4:] if qtype == QType.Q4_1 else blocks[..., 2:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()  # element j low, j + 16 high nibble
    w = d * q + _half(blocks[..., 2:4]) if qtype == QType.Q4_1 else d * (q - 8.0)
    return w.reshape(r, in_features)


def _half(two_bytes: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 little-endian fp16 -> [..., 1] fp32."""
    return two_bytes.contiguous().view(torch.float16).float()
