"""Random valid K-quant (and IQ4_NL, IQ4_XS) weights built from bytes (gguf-py has no quantizer for
them): random quants and packed scales, with the fp16 scale fields set to finite values."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from pdserve.common.models.quant.packed import PackedWeight, QType

# the super-block types (256 weights: 8 sub-blocks of 32 with their own scales)
KQUANTS = [QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.IQ4_XS]


def random_kquant_rows(qtype: QType, n: int, k: int, seed: int = 0, scale: float = 1e-2
                       ) -> np.ndarray:
    """[n, k / block_size * block_bytes] uint8: random blocks, fp16 fields ~ N(0, scale)
    (finite; 5% of them an fp16 subnormal)."""
    rng = np.random.default_rng(seed)
    nb = k // qtype.block_size
    blocks = rng.integers(0, 256, size=(n, nb, qtype.block_bytes), dtype=np.uint8)
    for off in qtype.half_offsets:
        halves = (rng.standard_normal((n, nb)) * scale).astype(np.float16)
        halves[rng.random((n, nb)) < 0.05] = np.float16(3e-6)  # fp16 subnormal
        blocks[:, :, off:off + 2] = halves.view(np.uint8).reshape(n, nb, 2)
    return blocks.reshape(n, nb * qtype.block_bytes)


def make_kquant_weight(qtype: QType, n: int, k: int, seed: int = 0
                       ) -> tuple[PackedWeight, torch.Tensor]:
    """A random K-quant (or IQ4_NL, IQ4_XS) weight, packed and as gguf-py dequantizes it ([n, k]
    fp32)."""
    rows = random_kquant_rows(qtype, n, k, seed)
    ref = dequantize(rows, GGMLQuantizationType(int(qtype))).astype(np.float32)
    assert np.isfinite(ref).all()
    return PackedWeight.from_numpy(qtype, rows, k), torch.from_numpy(ref.reshape(n, k).copy())
