"""Rotary position embeddings (rotate-half / Hugging Face layout), with linear and llama3
frequency scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from pdserve.common.config import RopeScaling


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.type == "linear":
        return inv / scaling.factor
    if scaling.type == "llama3":
        return _llama3(inv, scaling)
    return inv


def _llama3(inv: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Long wavelengths slowed by `factor`, short ones kept, a smooth blend between."""
    low_wavelen = s.original_max_position / s.low_freq_factor
    high_wavelen = s.original_max_position / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: RopeScaling):
        super().__init__()
        inv = inv_frequencies(head_dim, theta, scaling)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv)  # [P, d/2]
        # cos/sin for the full head dim, halves repeated (rotate-half layout): [P, d]
        self.register_buffer("cos", torch.cat([freqs.cos()] * 2, -1), persistent=False)
        self.register_buffer("sin", torch.cat([freqs.sin()] * 2, -1), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, d] for positions [T]; computed once per forward, used by every
        layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def forward(self, cos_sin, q: torch.Tensor, k: torch.Tensor):
        """q [T, h, d], k [T, kvh, d] -> rotated q, k."""
        cos, sin = cos_sin
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
