"""Token embedding over a packed GGUF matrix: each step expands only the rows it looks up.

SmolLM2's Q8_0 embedding is 30 MB packed and 113 MB as fp32; with tied word embeddings the LM
head multiplies by the same `PackedWeight` (no second copy, as the fp32 path's oneDNN head has).
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.common.models.quant.cpu_native import load_packed_kernels
from pdserve.common.models.quant.packed import PackedWeight


class PackedEmbedding(nn.Module):
    def __init__(self, weight: PackedWeight):
        super().__init__()
        self.packed_weight = weight

    @property
    def packed_parts(self) -> tuple[PackedWeight, ...]:
        return (self.packed_weight,)

    @property
    def num_embeddings(self) -> int:
        return self.packed_weight.out_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] int64 in [0, vocab) -> [T, hidden] fp32, the rows gguf-py would expand."""
        w = self.packed_weight
        native = load_packed_kernels() if ids.device.type == "cpu" else None
        if native is not None:
            return native.dequantize(w.data, int(w.qtype), w.in_features,
                                     rows=ids.reshape(-1).long().contiguous()
                                     ).view(*ids.shape, w.in_features)
        return w.dequantize(ids.reshape(-1)).view(*ids.shape, w.in_features)

    def _apply(self, fn, recurse=True):  # .to(device) moves the packed bytes too
        self.packed_weight = self.packed_weight.apply(fn)
        return super()._apply(fn, recurse)
