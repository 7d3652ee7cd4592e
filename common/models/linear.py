"""Linear layers shaped for tensor parallelism.

With tp_size == 1 (the only size this issue runs) they are plain linears. Each layer knows how to
take its shard of a full Hugging Face weight (`weight_loader`), so a later tensor-parallel engine
(gloo on the CPU) only sets tp_rank / tp_size and adds the all-reduce, without touching the model:
- ColumnParallelLinear splits the output features; no communication.
- RowParallelLinear splits the input features; its outputs are summed across ranks.
- QKVParallelLinear / MergedColumnParallelLinear fuse several projections into one matmul,
  which also is what makes the CPU path fast (one GEMM instead of three).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class ColumnParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        if out_features % tp_size:
            raise ValueError(f"out_features {out_features} not divisible by tp_size {tp_size}")
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.weight = nn.Parameter(torch.empty(out_features // tp_size, in_features),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(out_features // tp_size), requires_grad=False)
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)

    def _shard(self, full: torch.Tensor) -> torch.Tensor:
        n = full.shape[0] // self.tp_size
        return full[self.tp_rank * n:(self.tp_rank + 1) * n]

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(self._shard(full))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections stacked on the output dim (e.g. gate and up)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1):
        self.out_sizes = list(out_sizes)
        super().__init__(in_features, sum(out_sizes), bias, tp_rank, tp_size)

    def weight_loader(self, param, full, shard_id=None):
        start = sum(self.out_sizes[:shard_id]) // self.tp_size
        n = self.out_sizes[shard_id] // self.tp_size
        param.data[start:start + n].copy_(self._shard(full))


class QKVParallelLinear(MergedColumnParallelLinear):
    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, tp_rank: int = 0, tp_size: int = 1):
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden, sizes, bias, tp_rank, tp_size)

    def weight_loader(self, param, full, shard_id=None):
        super().weight_loader(param, full, {"q": 0, "k": 1, "v": 2}[shard_id])


class RowParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        if in_features % tp_size:
            raise ValueError(f"in_features {in_features} not divisible by tp_size {tp_size}")
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp_size),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(out_features), requires_grad=False)
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.linear(x, self.weight)
        if self.tp_size > 1:
            dist.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def weight_loader(self, param, full, shard_id=None):
        if param.dim() == 1:  # bias is not sharded
            param.data.copy_(full)
            return
        n = full.shape[1] // self.tp_size
        param.data.copy_(full[:, self.tp_rank * n:(self.tp_rank + 1) * n])
