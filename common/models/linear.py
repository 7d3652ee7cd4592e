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
reordered once for oneDNN and the plain copy dropped (a fused layer's projections stay one
GEMM); row-parallel layers then also fuse the residual add into the GEMM as a oneDNN post-op.
Gate/up's SiLU-and-mul is one vectorized pass after its GEMM (quant/gemm.py's `silu_and_mul`).
Without packing the same methods run torch's ops, with the same results up to fp32 rounding.

GGUF-quantized weights may instead stay packed (quant/packed.py): `load_packed` takes each
shard's blocks, `finish_loading` stacks them into `packed_parts` and drops the fp32 parameter,
and forward multiplies through quant/gemm.py (blocks expanded to fp32 in registers, fp32
accumulation). A fused layer whose shards differ in type (a Q4_K_M file's Q6_K v beside Q4_K
q and k) keeps one packed part per run of same-typed shards and multiplies each: one GEMM
per part, their outputs side by side. With tp_size > 1 each rank keeps its own rows of every
shard (column-parallel) or its own blocks of input features (row-parallel, where the split
falls on block boundaries: `keeps_packed`). A fused layer whose shards cannot all stay packed
(some shards fp32) expands the packed ones into its fp32 weight instead, so it always loads.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from pdserve.common.models.cpu_gemm import pack_weight, packed_linear, packed_linear_binary
from pdserve.common.models.quant.blocked import BlockedWeights
from pdserve.common.models.quant.cpu_native import load_packed_kernels
from pdserve.common.models.quant.gemm import packed_linear as quant_linear
from pdserve.common.models.quant.gemm import packed_linear_parts as quant_linear_parts
from pdserve.common.models.quant.gemm import packed_silu_and_mul as quant_silu_and_mul
from pdserve.common.models.quant.gemm import silu_and_mul
from pdserve.common.models.quant.packed import PackedWeight, stack_runs

logger = logging.getLogger(__name__)


def even_shard(size: int, tp_rank: int, tp_size: int, what: str) -> tuple[int, int]:
    """(start, length) of rank tp_rank's equal share of `size` features."""
    if size % tp_size:
        raise ValueError(f"{what} {size} not divisible by tp_size {tp_size}")
    n = size // tp_size
    return tp_rank * n, n


class PackedLoading:
    """Mixin: collect GGUF-packed shards while loading; stack them or expand them after.

    Subclasses name their shard ids (`packed_shard_ids`) and provide `weight_loader`."""

    packed_shard_ids: tuple = (None,)

    def _init_packed(self) -> None:
        # the weight's GGUF blocks as row groups in output order, one per run of same-typed
        # shards; () when the layer holds fp32
        self.packed_parts: tuple[PackedWeight, ...] = ()
        self.blocked_weights: BlockedWeights | None = None  # use_blocked_weights sets it
        self._pending: dict = {}

    def keeps_packed(self, w: PackedWeight) -> bool:
        """Whether this rank can hold its part of `w` packed (column-parallel layers: always;
        row-parallel ones override it)."""
        return True

    def rank_part(self, w: PackedWeight, shard_id=None) -> PackedWeight:
        """This rank's part of shard `shard_id` (full, unsharded) as packed blocks."""
        raise NotImplementedError

    def load_packed(self, w: PackedWeight, shard_id=None) -> None:
        """Take shard `shard_id` of this layer as packed blocks (full, unsharded rows; with
        tp_size > 1 this rank keeps its part)."""
        if shard_id not in self.packed_shard_ids:
            raise ValueError(f"unknown shard {shard_id!r}")
        if w.shape != self.full_shape(shard_id):
            raise ValueError(f"packed shard {shard_id!r} has shape {w.shape}, expected "
                             f"{self.full_shape(shard_id)}")
        if not self.keeps_packed(w):
            raise ValueError(f"{type(self).__name__} cannot split {w.qtype.name} blocks over "
                             f"{self.tp_size} ranks")
        self.load_rank_part(w if self.tp_size == 1 else self.rank_part(w, shard_id), shard_id)

    def load_rank_part(self, part: PackedWeight, shard_id=None) -> None:
        """Take this rank's part of shard `shard_id`, already cut (a tied head shares its
        embedding's rows)."""
        self._pending[shard_id] = part

    @property
    def packed_weight(self) -> PackedWeight | None:
        """The packed weight when the layer is one GGUF type throughout (one part); None when
        it holds fp32 or several parts."""
        return self.packed_parts[0] if len(self.packed_parts) == 1 else None

    def _apply(self, fn, recurse=True):  # .to(device) moves the packed bytes too
        self.packed_parts = tuple(p.apply(fn) for p in self.packed_parts)
        return super()._apply(fn, recurse)

    def finish_loading(self) -> None:
        """After every weight is loaded: if all shards came packed, the packed parts
        (consecutive shards of one type stacked into one); else the packed shards expanded into
        the fp32 weight."""
        pending, self._pending = self._pending, {}
        if not pending:
            return
        parts = [pending.get(s) for s in self.packed_shard_ids]
        if all(p is not None for p in parts):
            self.packed_parts = stack_runs(parts)
            rows = sum(p.out_features for p in self.packed_parts)
            if (rows, parts[0].in_features) != tuple(self.weight.shape):
                raise ValueError(f"packed weight has shape {(rows, parts[0].in_features)}, "
                                 f"expected {tuple(self.weight.shape)}")
            self.weight = None  # a tied embedding keeps its own reference
            if len(self.packed_parts) > 1:
                logger.info("%s: kept packed as %d parts (%s)", type(self).__name__,
                            len(self.packed_parts),
                            ", ".join(p.qtype.name for p in self.packed_parts))
            return
        logger.info("%s: shards %s expanded to fp32 (beside fp32 shards)",
                    type(self).__name__, sorted(map(str, pending)))
        for shard_id, w in pending.items():  # this rank's part, already cut
            self._load_part(w.dequantize(), shard_id)

    def _load_part(self, part: torch.Tensor, shard_id) -> None:
        """Copy this rank's fp32 part of shard `shard_id` into the weight."""
        raise NotImplementedError


class ColumnParallelLinear(PackedLoading, nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        _, n = even_shard(out_features, tp_rank, tp_size, "out_features")
        self.full_out = out_features
        self._setup(in_features, n, bias, tp_rank, tp_size)

    def _setup(self, in_features: int, local_out: int, bias: bool, tp_rank: int,
               tp_size: int) -> None:
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.weight = nn.Parameter(torch.empty(local_out, in_features), requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(local_out), requires_grad=False)
                     if bias else None)
        self.packed: torch.Tensor | None = None  # oneDNN weight once pack_onednn() ran
        self._init_packed()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_parts:
            return quant_linear_parts(x, self.packed_parts, self.bias, self.blocked_weights)
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return nn.functional.linear(x, self.weight, self.bias)

    def pack_onednn(self) -> None:
        self.packed = pack_weight(self.weight.detach())
        self.weight = None  # a tied embedding keeps its own reference to the tensor

    def full_shape(self, shard_id=None) -> tuple[int, int]:
        """(out, in) of the unsharded weight (of one projection, for fused layers)."""
        if shard_id is None:
            return (self.full_out, self.weight.shape[1])
        index = self.packed_shard_ids.index(shard_id)
        return (self.out_sizes[index], self.weight.shape[1])

    def _shard(self, full: torch.Tensor) -> torch.Tensor:
        n = full.shape[0] // self.tp_size
        return full[self.tp_rank * n:(self.tp_rank + 1) * n]

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(self._shard(full))

    def rank_part(self, w: PackedWeight, shard_id=None) -> PackedWeight:
        n = w.out_features // self.tp_size
        return w.rows(self.tp_rank * n, n)

    def _load_part(self, part: torch.Tensor, shard_id) -> None:
        self.weight.data.copy_(part)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections stacked on the output dim (e.g. gate and up).

    `shards`: this rank's (start, length) rows of each projection; default an equal share of
    each (QKV passes uneven ones when the KV heads do not split evenly)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1,
                 shards: list[tuple[int, int]] | None = None):
        nn.Module.__init__(self)
        self.out_sizes = list(out_sizes)
        self.full_out = sum(out_sizes)
        self.packed_shard_ids = tuple(range(len(out_sizes)))
        self.shards = shards or [even_shard(s, tp_rank, tp_size, "out_features")
                                 for s in out_sizes]
        self._setup(in_features, sum(n for _, n in self.shards), bias, tp_rank, tp_size)

    def weight_loader(self, param, full, shard_id=None):
        local = sum(n for _, n in self.shards[:shard_id])
        start, n = self.shards[shard_id]
        param.data[local:local + n].copy_(full[start:start + n])

    def rank_part(self, w: PackedWeight, shard_id=None) -> PackedWeight:
        return w.rows(*self.shards[self.packed_shard_ids.index(shard_id)])

    def _load_part(self, part: torch.Tensor, shard_id) -> None:
        index = self.packed_shard_ids.index(shard_id)
        local = sum(n for _, n in self.shards[:index])
        self.weight.data[local:local + part.shape[0]].copy_(part)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> silu(gate) * up [T, out / 2] for a [gate, up] pair of projections: one
        GEMM makes [T, out] = [gate | up] and one vectorized pass the SiLU and the product
        (quant/gemm.py's `silu_and_mul`; with GGUF blocks below the switch point, SiLU is fused
        into the packed kernel's store instead, when gate and up share one GGUF type)."""
        if self.packed_weight is not None:
            return quant_silu_and_mul(x, self.packed_weight, self.bias, self.blocked_weights)
        return silu_and_mul(self(x))


class QKVParallelLinear(MergedColumnParallelLinear):
    """`kv_heads`: this rank's (first KV head, count); its query heads are those KV heads'
    groups. Default: all heads (tp_size 1)."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, tp_rank: int = 0, tp_size: int = 1,
                 kv_heads: tuple[int, int] | None = None):
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        first, count = kv_heads or (0, num_kv_heads)
        group = num_heads // num_kv_heads
        kv = (first * head_dim, count * head_dim)
        shards = [(first * group * head_dim, count * group * head_dim), kv, kv]
        super().__init__(hidden, sizes, bias, tp_rank, tp_size, shards)
        self.packed_shard_ids = ("q", "k", "v")

    def weight_loader(self, param, full, shard_id=None):
        super().weight_loader(param, full, {"q": 0, "k": 1, "v": 2}[shard_id])


class RowParallelLinear(PackedLoading, nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1, comm=None,
                 in_shard: tuple[int, int] | None = None):
        """`comm`: the tensor-parallel group's Communicator (common/distributed/layout.py),
        required when tp_size > 1. `in_shard`: this rank's (start, length) input features;
        default an equal share."""
        super().__init__()
        self.in_shard = in_shard or even_shard(in_features, tp_rank, tp_size, "in_features")
        if tp_size > 1 and comm is None:
            raise ValueError("a row-parallel linear with tp_size > 1 needs a communicator")
        self.tp_rank, self.tp_size, self.comm = tp_rank, tp_size, comm
        self.weight = nn.Parameter(torch.empty(out_features, self.in_shard[1]),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(out_features), requires_grad=False)
                     if bias else None)
        self.packed: torch.Tensor | None = None
        self.full_in = in_features
        self._init_packed()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, in / tp] -> x W^T (summed over ranks) + bias (+ residual) [T, out]."""
        lead = self.tp_rank == 0  # only one rank's partial sum carries bias and residual
        bias = self.bias if lead else None
        if self.packed_weight is not None:
            y = quant_linear(x, self.packed_weight, bias, residual if lead else None,
                             self.blocked_weights)
        elif self.packed is not None:
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

    def full_shape(self, shard_id=None) -> tuple[int, int]:
        return (self.weight.shape[0], self.full_in)

    def weight_loader(self, param, full, shard_id=None):
        if param.dim() == 1:  # bias is not sharded
            param.data.copy_(full)
            return
        start, n = self.in_shard
        param.data.copy_(full[:, start:start + n])

    def keeps_packed(self, w: PackedWeight) -> bool:
        return self.tp_size == 1 or w.splits_at(*self.in_shard)

    def rank_part(self, w: PackedWeight, shard_id=None) -> PackedWeight:
        return w.columns(*self.in_shard)

    def _load_part(self, part: torch.Tensor, shard_id) -> None:
        self.weight.data.copy_(part)


def use_blocked_weights(model: nn.Module) -> int:
    """Give every CPU layer that kept its GGUF blocks one shared set of oneDNN-layout buffers
    (quant/blocked.py: the largest-M GEMMs expand into them) where the packed kernels build;
    returns how many layers got it."""
    layers = [m for m in model.modules()
              if isinstance(m, PackedLoading) and m.packed_parts
              and m.packed_parts[0].data.device.type == "cpu"]
    native = load_packed_kernels() if layers else None
    if native is None:
        return 0
    blocked = BlockedWeights(native)
    for m in layers:
        m.blocked_weights = blocked
    return len(layers)
