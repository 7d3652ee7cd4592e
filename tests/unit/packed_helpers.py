"""Shared by the packed-weight tests: gguf-py-quantized random weights and the fp64 reference."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from pdserve.common.models.quant.packed import PackedWeight, QType


def make_weight(qtype: QType, n: int, k: int, seed: int = 0) -> tuple[PackedWeight, torch.Tensor]:
    """A random weight quantized by gguf-py; returns it packed and as gguf-py dequantizes it."""
    values = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    packed = quantize(values, GGMLQuantizationType(int(qtype)))  # [n, k / 32 * block_bytes] uint8
    ref = dequantize(packed, GGMLQuantizationType(int(qtype))).astype(np.float32)
    return PackedWeight.from_numpy(qtype, packed, k), torch.from_numpy(ref.copy())


def reference(x, w_fp32, bias=None, residual=None):
    y = x.double() @ w_fp32.double().T
    if bias is not None:
        y = y + bias.double()
    if residual is not None:
        y = y + residual.double()
    return y.float()


def tol(k: int) -> dict:
    return dict(atol=2e-5 * k ** 0.5, rtol=1e-5)
