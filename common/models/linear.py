"""Linear layers shaped for tensor parallelism.

With tp_size == 1 they are plain linears. Each layer knows how to take its shard of a full
Hugging Face weight (`weight_loader`); the tensor-parallel engine (common/distributed) builds them
with tp_rank / tp_size and gives the row-parallel ones the group's communicator:
- ColumnParallelLinear splits the output features; no communication.
- RowParallelLinear splits the input features; its outputs are summed across ranks (rank 0
  adds the bias and the residual into its partial sum first, so the sum carries them once).
- QKVParallelLinear / MergedColumnParallelLinear fuse several projections into one matmul,
  which also is what makes the CPU path fast (one GEMM instead of three).

On the CPU the engine may `pack_onednn()` every layer after loading (cpu_gemm.py): the weight is
reordered once for oneDNN and the plain copy dropped; the layers then also fuse their neighbours
into the GEMM as oneDNN post-ops (SiLU-and-mul for gate/up, the residual add for row-parallel
outputs). Without packing the same methods run the unfused torch ops, with the same results up
to fp32 rounding.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.common.models.cpu_gemm import pack_weight, packed_linear, packed_linear_binary


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
        self.packed: torch.Tensor | None = None  # oneDNN weight once pack_onednn() ran

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return nn.functional.linear(x, self.weight, self.bias)

    def pack_onednn(self) -> None:
        self.packed = pack_weight(self.weight.detach())
        self.weight = None  # a tied embedding keeps its own reference to the tensor

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
        self.packed_shards: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None

    def weight_loader(self, param, full, shard_id=None):
        start = sum(self.out_sizes[:shard_id]) // self.tp_size
        n = self.out_sizes[shard_id] // self.tp_size
        param.data[start:start + n].copy_(self._shard(full))

    def pack_onednn(self) -> None:
        """One packed GEMM per projection, so `silu_and_mul` can fuse into them."""
        sizes = [s // self.tp_size for s in self.out_sizes]
        ws = self.weight.detach().split(sizes)
        bs = self.bias.detach().split(sizes) if self.bias is not None else [None] * len(ws)
        self.packed_shards = [(pack_weight(w), b) for w, b in zip(ws, bs)]
        self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_shards is not None:
            return torch.cat([packed_linear(x, w, b) for w, b in self.packed_shards], dim=-1)
        return super().forward(x)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> silu(gate) * up [T, out / 2] for a [gate, up] pair of projections;
        packed, SiLU and the product run inside the two GEMMs (no [T, 2 * out] round trip)."""
        if self.packed_shards is not None:
            (wg, bg), (wu, bu) = self.packed_shards
            gate = packed_linear(x, wg, bg, activation="swish")
            return packed_linear_binary(x, gate, wu, bu, "mul")
        gate, up = super().forward(x).chunk(2, dim=-1)
        return nn.functional.silu(gate) * up


class QKVParallelLinear(MergedColumnParallelLinear):
    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, tp_rank: int = 0, tp_size: int = 1):
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden, sizes, bias, tp_rank, tp_size)

    def weight_loader(self, param, full, shard_id=None):
        super().weight_loader(param, full, {"q": 0, "k": 1, "v": 2}[shard_id])

    def pack_onednn(self) -> None:
        ColumnParallelLinear.pack_onednn(self)  # q, k and v stay one GEMM


class RowParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1, comm=None):
        """`comm`: the tensor-parallel group's Communicator (common/distributed/layout.py),
        required when tp_size > 1."""
        super().__init__()
        if in_features % tp_size:
            raise ValueError(f"in_features {in_features} not divisible by tp_size {tp_size}")
        if tp_size > 1 and comm is None:
            raise ValueError("a row-parallel linear with tp_size > 1 needs a communicator")
        self.tp_rank, self.tp_size, self.comm = tp_rank, tp_size, comm
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp_size),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(out_features), requires_grad=False)
                     if bias else None)
        self.packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, in / tp] -> x W^T (summed over ranks) + bias (+ residual) [T, out]."""
        lead = self.tp_rank == 0  # only one rank's partial sum carries bias and residual
        bias = self.bias if lead else None
        if self.packed is not None:
            if lead and residual is not None:
                y = packed_linear_binary(x, residual, self.packed, bias, "add")
            else:
                y = packed_linear(x, self.packed, bias)
        else:
            y = nn.functional.linear(x, self.weight, bias)
            if lead and residual is not None:
                y = y + residual
        if self.tp_size > 1:
            self.comm.all_reduce(y)
        return y

    def pack_onednn(self) -> None:
        self.packed = pack_weight(self.weight.detach())
        self.weight = None

    def weight_loader(self, param, full, shard_id=None):
        if param.dim() == 1:  # bias is not sharded
            param.data.copy_(full)
            return
        n = full.shape[1] // self.tp_size
        param.data.copy_(full[:, self.tp_rank * n:(self.tp_rank + 1) * n])
