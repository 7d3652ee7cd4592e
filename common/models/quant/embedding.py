"""Token embedding over a packed GGUF matrix: each step expands only the rows it looks up.

SmolLM2's Q8_0 embedding is 30 MB packed and 113 MB as fp32; with tied word embeddings the LM
head multiplies by the same `PackedWeight` (no second copy, as the fp32 path's oneDNN head has).
Under tensor parallelism a rank holds vocabulary rows [start, start + S) (vocab_parallel.py's
split, the last shard zero-padded) and the all-reduce assembles each token's row.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.common.distributed.layout import SINGLE, TensorParallel
from pdserve.common.models.quant.cpu_native import load_packed_kernels
from pdserve.common.models.quant.packed import PackedWeight


class PackedEmbedding(nn.Module):
    def __init__(self, weight: PackedWeight, tp: TensorParallel = SINGLE, start: int = 0):
        """weight: this rank's rows [start, start + S) of the vocabulary (all of it at tp
        size 1)."""
        super().__init__()
        if tp.size == 1 and start != 0:
            raise ValueError("one rank holds the whole vocabulary (start 0)")
        self.packed_weight = weight
        self.tp, self.start = tp, start

    @property
    def packed_parts(self) -> tuple[PackedWeight, ...]:
        return (self.packed_weight,)

    @property
    def num_embeddings(self) -> int:
        return self.packed_weight.out_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] int64 in [0, vocab) -> [T, hidden] fp32, the rows gguf-py would expand."""
        if self.tp.size == 1:
            return self._rows(ids)
        local = ids - self.start
        mine = (local >= 0) & (local < self.num_embeddings)
        x = self._rows(local.clamp(0, self.num_embeddings - 1))
        x.mul_(mine.unsqueeze(-1).to(x.dtype))  # other ranks' ids: zeros in this partial sum
        return self.tp.all_reduce(x)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] in [0, num_embeddings) -> this weight's rows [T, hidden] fp32."""
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
