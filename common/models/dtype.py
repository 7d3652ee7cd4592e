"""The dtype of unquantized weights and activations (`--dtype`, EngineConfig.dtype).

`auto` is fp32 on the CPU (measured in docs/half-precision.md: bf16 does not pay there) and
bf16 on CUDA. A half dtype casts the model's floating-point parameters and buffers (rotary
tables included, as transformers computes them in fp32 and casts) and runs the torch paths:
the native CPU kernels and oneDNN's prepacked GEMM are fp32-only. GGUF-packed matrices stay
packed and multiply in fp32 (quant/gemm.py widens the activations and rounds the result back).
"""

from __future__ import annotations

import torch

from pdserve.common.config import DTYPES

_BY_NAME = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """The torch dtype of weights and activations for a `dtype` setting on `device`."""
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if name not in _BY_NAME:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return _BY_NAME[name]
