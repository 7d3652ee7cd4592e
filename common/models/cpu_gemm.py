"""Prepacked oneDNN fp32 GEMMs for the linear layers on the CPU.

Why: torch's fp32 `linear` goes to MKL's sgemm, which takes a generic AVX2 path on non-Intel
CPUs and repacks the weight on every call; oneDNN picks the widest ISA the CPU has (AVX-512 on
recent AMD and Intel parts) and lets the weight be reordered once into its blocked layout. On
the 2-core AMD EPYC this project develops on, at SmolLM2's shapes, that is 2-3x faster at every
batch size (`pdserve bench offline` measures both rates in the same run). The arithmetic stays
fp32 (oneDNN's default fp32 math mode; no implicit bf16), so greedy outputs still match
transformers.

Lifecycle: the model loads its weights as plain tensors; `pack_linears` then reorders each
linear's weight once and drops the plain copy (a tied LM head keeps the embedding's tensor and
packs its own copy). After packing, `weight_loader` can no longer be used on those layers.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
from torch import nn

CpuGemmName = Literal["auto", "onednn", "torch"]


@functools.lru_cache(maxsize=1)
def onednn_available() -> bool:
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def resolve_cpu_gemm(name: str, device: str) -> str:
    """'auto' -> 'onednn' on a CPU that has it, else 'torch'. Raises for an impossible ask."""
    if name not in ("auto", "onednn", "torch"):
        raise ValueError(f"cpu_gemm must be one of auto, onednn, torch, got {name!r}")
    if name == "torch" or not device.startswith("cpu"):
        return "torch"
    if onednn_available():
        return "onednn"
    if name == "onednn":
        raise ValueError("cpu_gemm 'onednn' asked for, but this torch build has no oneDNN")
    return "torch"


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] fp32 -> oneDNN blocked weight (opaque tensor, same logical shape)."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise ValueError(f"oneDNN packing takes fp32 CPU weights, got {weight.dtype} "
                         f"on {weight.device}")
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())


def packed_linear(x: torch.Tensor, packed: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, in] -> x W^T + b [T, out] with a weight from `pack_weight` (a plain fp32 [out, in]
    weight works too: oneDNN then reorders it per call)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def packed_linear_binary(x: torch.Tensor, other: torch.Tensor, packed: torch.Tensor,
                         bias: torch.Tensor | None, op: str) -> torch.Tensor:
    """(x W^T + b) op other, op "add" or "mul", fused into the GEMM; other [T, out]."""
    return torch.ops.mkldnn._linear_pointwise.binary(x, other, packed, bias, op)


def pack_linears(model: nn.Module) -> int:
    """Pack every linear that can be (has `pack_onednn`); returns how many were packed."""
    n = 0
    for module in model.modules():
        if hasattr(module, "pack_onednn") and module.weight is not None:
            module.pack_onednn()
            n += 1
    return n
