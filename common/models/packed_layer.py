"""A decoder layer whose four linears all hold packed GGUF weights, run on the CPU as seven
native calls with their arguments prepared once at load.

Why: at batch 1 a SmolLM2 step computes for ~10 ms, and the module path around the kernels
(eight module calls per layer, each packed GEMM's dispatch checks, the attention backend's
per-call checks, the gate/up split, SiLU and product) cost ~40 us of Python per layer, ~1.2 ms
per step over 30 layers. The calls here are the ones the module path makes (the same kernels,
the same arguments, in the same order), so the output is bit-identical to it; the model takes
this path only where the module path would reach exactly these kernels (`LlamaForCausalLM`:
fp32 on the CPU, fewer rows than the packed kernel's switch point, the fused attention step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from pdserve.common.models.quant.packed import PackedWeight

# attend(qkv [T, (H + 2 kvh) d], kv_cache, scale, num_heads) -> [T, H, d]: rotary, KV write and
# attention of one layer (AttentionBackend.fused_step)
Attend = Callable[[torch.Tensor, torch.Tensor, float, int], torch.Tensor]


@dataclass(frozen=True)
class PackedLinear:
    """One linear's packed bytes [N, row_bytes], GGML type id and optional bias [N]."""

    data: torch.Tensor
    qtype: int
    bias: Optional[torch.Tensor]

    @classmethod
    def of(cls, w: PackedWeight, bias: Optional[torch.Tensor]) -> "PackedLinear":
        return cls(w.data, int(w.qtype), bias)

    def __post_init__(self):
        if self.data.dim() != 2 or self.data.dtype != torch.uint8:
            raise ValueError(f"packed data must be uint8 [N, row_bytes], got {self.data.dtype} "
                             f"{tuple(self.data.shape)}")
        if self.bias is not None and self.bias.shape != (self.data.shape[0],):
            raise ValueError(f"bias must be [{self.data.shape[0]}], got {tuple(self.bias.shape)}")


@dataclass(frozen=True)
class PackedLayer:
    """The tensors and sizes one layer's native calls take."""

    ln1: torch.Tensor  # [hidden] input RMSNorm weight
    ln2: torch.Tensor  # [hidden] post-attention RMSNorm weight
    eps: float
    qkv: PackedLinear  # [(H + 2 kvh) d, hidden]
    o: PackedLinear  # [hidden, H d]
    gate_up: PackedLinear  # [2 I, hidden]
    down: PackedLinear  # [hidden, I]
    num_heads: int  # H (this rank's query heads)
    q_size: int  # H d
    scale: float  # attention softmax scale

    def __post_init__(self):
        if self.ln1.shape != self.ln2.shape or self.ln1.dim() != 1:
            raise ValueError(f"norm weights must be one [hidden] shape, got "
                             f"{tuple(self.ln1.shape)} and {tuple(self.ln2.shape)}")
        if self.num_heads <= 0 or self.q_size % self.num_heads:
            raise ValueError(f"q_size {self.q_size} is no multiple of num_heads "
                             f"{self.num_heads}")
        hidden = self.ln1.shape[0]
        if self.o.data.shape[0] != hidden or self.down.data.shape[0] != hidden:
            raise ValueError(f"o and down must have {hidden} output rows")
        if self.gate_up.data.shape[0] % 2:
            raise ValueError("gate_up must stack two equal halves [gate; up]")

    def forward(self, gemm, rms_norm, attend: Attend, x: torch.Tensor,
                kv_cache: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] fp32 -> the layer's output [T, hidden]. `gemm`: the packed kernels'
        module (quant/cpu_native.py); `rms_norm(x, weight, eps)`: the native RMSNorm."""
        t = x.shape[0]
        qkv = self.qkv
        h = rms_norm(x, self.ln1, self.eps)
        a = attend(gemm.packed_gemm(h, qkv.data, qkv.qtype, qkv.bias, None), kv_cache,
                   self.scale, self.num_heads)  # [T, H, d]
        x = gemm.packed_gemm(a.view(t, self.q_size), self.o.data, self.o.qtype, self.o.bias, x)
        h = rms_norm(x, self.ln2, self.eps)
        gu, down = self.gate_up, self.down
        g = gemm.packed_gemm_silu_mul(h, gu.data, gu.qtype, gu.bias)  # [T, I]
        return gemm.packed_gemm(g, down.data, down.qtype, down.bias, x)
