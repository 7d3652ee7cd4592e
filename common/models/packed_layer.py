"""A decoder layer whose four linears all hold packed GGUF weights, run on the CPU as seven
native calls with their arguments prepared once at load, or, for a step of a few decodes, as
ONE native call (`packed_decode_layer`, quant/cpu_kernels/fused_layer.cpp).

Why: at batch 1 a SmolLM2 step computes for ~10 ms, and the module path around the kernels
(eight module calls per layer, each packed GEMM's dispatch checks, the attention backend's
per-call checks, the gate/up split, SiLU and product) cost ~40 us of Python per layer, ~1.2 ms
per step over 30 layers. The calls here are the ones the module path makes (the same kernels,
the same arguments, in the same order), so the output is bit-identical to it; the model takes
this path only where the module path would reach exactly these kernels (`LlamaForCausalLM`:
fp32 on the CPU, fewer rows than the packed kernel's switch point, the fused attention step).

The one-call layer (a step of T < `fused_rows` tokens, all decodes) runs the same inner
functions in one OpenMP region with barriers between phases, so its output is bit-identical to
the seven calls; it saves the parallel regions' start-ups and the Python between them (~120
regions per SmolLM2 step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from pdserve.common.models.quant.packed import PackedWeight

# attend(qkv [T, (H + 2 kvh) d], kv_cache, scale, num_heads) -> [T, H, d]: rotary, KV write and
# attention of one layer (AttentionBackend.fused_step)
Attend = Callable[[torch.Tensor, torch.Tensor, float, int], torch.Tensor]


@dataclass(frozen=True)
class DecodeStep:
    """One step's attention inputs for the one-call layer, bound once per step: T decode
    tokens, token r is request r."""

    cos: torch.Tensor  # [T, d] fp32 contiguous
    sin: torch.Tensor  # [T, d]
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [T, W] int32
    seq_lens: torch.Tensor  # [T] int32

    def __post_init__(self):
        t = self.slot_mapping.shape[0]
        if (self.cos.shape != self.sin.shape or self.cos.dim() != 2 or self.cos.shape[0] != t
                or self.seq_lens.shape != (t,) or self.block_tables.shape[0] != t):
            raise ValueError(f"decode step tensors disagree on T = {t}: cos "
                             f"{tuple(self.cos.shape)}, seq_lens {tuple(self.seq_lens.shape)}, "
                             f"block_tables {tuple(self.block_tables.shape)}")

    @classmethod
    def of(cls, num_tokens: int, num_decodes: int, num_reqs: int, fused_rows: int,
           cos_sin: Sequence[torch.Tensor], slot_mapping: torch.Tensor,
           block_tables: torch.Tensor, seq_lens: torch.Tensor) -> Optional["DecodeStep"]:
        """The step's inputs when it is 1 <= T < fused_rows decodes only, with the metadata
        types the kernel reads (int64 slots, contiguous int32 tables), else None."""
        t = num_tokens
        if not (0 < t < fused_rows and num_decodes == num_reqs == t):
            return None
        if (slot_mapping.dtype != torch.int64 or block_tables.dtype != torch.int32
                or seq_lens.dtype != torch.int32 or not block_tables.is_contiguous()
                or not seq_lens.is_contiguous() or not slot_mapping.is_contiguous()):
            return None
        cos, sin = (c.reshape(t, -1).contiguous() for c in cos_sin)
        return cls(cos, sin, slot_mapping, block_tables, seq_lens)


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
    # qkv's last rows when they are another GGUF type than its first (a Q4_K_M file's Q6_K v
    # beside Q4_K q and k): [tail rows, hidden]; qkv then holds the rows before them
    qkv_tail: Optional[PackedLinear] = None

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
        kv_rows = self.qkv.data.shape[0] - self.q_size  # k and v rows, the tail's included
        if self.qkv_tail is not None:
            kv_rows += self.qkv_tail.data.shape[0]
        if kv_rows <= 0 or kv_rows % 2:
            raise ValueError(f"qkv must hold q_size {self.q_size} rows and equal k and v rows, "
                             f"got {kv_rows} rows past q")

    def forward(self, gemm, rms_norm, attend: Attend, x: torch.Tensor,
                kv_cache: torch.Tensor, step: Optional[DecodeStep] = None,
                keep: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [T, hidden] fp32 -> the layer's output [T, hidden]. `gemm`: the packed kernels'
        module (quant/cpu_native.py); `rms_norm(x, weight, eps)`: the native RMSNorm. With
        `step` (this step's decodes, DecodeStep.of) the whole layer is one native call. With
        `keep` [N] (no `step`): every row's K/V, then rows `keep` only, [N, hidden], as the
        module path's `DecoderLayer` does."""
        if step is not None:
            return self._decode(gemm, step, x, kv_cache)
        t = x.shape[0]
        h = rms_norm(x, self.ln1, self.eps)
        a = attend(self._qkv(gemm, h), kv_cache, self.scale,
                   self.num_heads).view(t, self.q_size)  # [T, H d]
        if keep is not None:
            a, x = a[keep], x[keep]
            if keep.numel() == 0:
                return x
        x = gemm.packed_gemm(a, self.o.data, self.o.qtype, self.o.bias, x)
        h = rms_norm(x, self.ln2, self.eps)
        gu, down = self.gate_up, self.down
        g = gemm.packed_gemm_silu_mul(h, gu.data, gu.qtype, gu.bias)  # [T, I]
        return gemm.packed_gemm(g, down.data, down.qtype, down.bias, x)

    def _qkv(self, gemm, h: torch.Tensor) -> torch.Tensor:
        """h [T, hidden] -> [T, (H + 2 kvh) d]: one packed GEMM, or one per part side by side
        (what quant/gemm.py's packed_linear_parts computes on the module path)."""
        qkv, tail = self.qkv, self.qkv_tail
        y = gemm.packed_gemm(h, qkv.data, qkv.qtype, qkv.bias, None)
        if tail is None:
            return y
        return torch.cat([y, gemm.packed_gemm(h, tail.data, tail.qtype, tail.bias, None)], 1)

    def _decode(self, gemm, step: DecodeStep, x: torch.Tensor,
                kv_cache: torch.Tensor) -> torch.Tensor:
        qkv, o, gu, down, tail = self.qkv, self.o, self.gate_up, self.down, self.qkv_tail
        return gemm.packed_decode_layer(
            x, self.ln1, self.ln2, self.eps, qkv.data, qkv.qtype, qkv.bias, o.data, o.qtype,
            o.bias, gu.data, gu.qtype, gu.bias, down.data, down.qtype, down.bias, step.cos,
            step.sin, kv_cache, step.slot_mapping, step.block_tables, step.seq_lens, self.scale,
            self.num_heads, *(() if tail is None else (tail.data, tail.qtype, tail.bias)))
