"""Vocabulary-parallel embedding and LM head: rank r of T holds rows [r*S, (r+1)*S) of the
vocabulary, S = ceil(V / T); the last shard is padded with zero rows (they never match a token
id, and their logits are cut off after the gather)."""

from __future__ import annotations

import torch
from torch import nn

from pdserve.common.distributed.layout import SINGLE, TensorParallel, vocab_shard
from pdserve.common.models.linear import ColumnParallelLinear
from pdserve.common.models.quant.packed import PackedWeight


def _shard_rows(full: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """full [V, H] -> this rank's rows [S, H], zero-padded past V."""
    s = vocab_shard(full.shape[0], tp.size)
    part = full[tp.rank * s:(tp.rank + 1) * s]
    if part.shape[0] == s:
        return part
    return torch.cat([part, part.new_zeros(s - part.shape[0], *full.shape[1:])])


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp
        self.shard = vocab_shard(vocab_size, tp.size)
        self.start = tp.rank * self.shard
        self.weight = nn.Parameter(torch.empty(self.shard, hidden), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> [T, hidden]: each rank looks up the ids in its shard, zeros elsewhere,
        and the all-reduce assembles the rows."""
        if self.tp.size == 1:
            return nn.functional.embedding(ids, self.weight)
        local = ids - self.start
        mine = (local >= 0) & (local < self.shard)
        x = nn.functional.embedding(local.clamp(0, self.shard - 1), self.weight)
        x.mul_(mine.unsqueeze(1).to(x.dtype))
        return self.tp.all_reduce(x)

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(_shard_rows(full, self.tp))


class ParallelLMHead(ColumnParallelLinear):
    """Column-parallel over the (padded) vocabulary; `gather_logits` assembles them."""

    def __init__(self, hidden: int, vocab_size: int, tp: TensorParallel = SINGLE):
        super().__init__(hidden, vocab_shard(vocab_size, tp.size) * tp.size,
                         tp_rank=tp.rank, tp_size=tp.size)
        self.tp, self.vocab_size = tp, vocab_size

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(_shard_rows(full, self.tp))

    def full_shape(self, shard_id=None) -> tuple[int, int]:
        return (self.vocab_size, self.weight.shape[1])  # the checkpoint's, unpadded

    def rank_part(self, w: PackedWeight, shard_id=None) -> PackedWeight:
        s = vocab_shard(self.vocab_size, self.tp.size)
        return w.padded_rows(self.tp.rank * s, s)

    def logits(self, hidden: torch.Tensor):
        """hidden [N, H] -> logits [N, V] on rank 0 (None on the other ranks)."""
        part = self(hidden)  # [N, S]
        if self.tp.size == 1:
            return part
        full = self.tp.comm.gather_last_dim(part)
        return None if full is None else full[:, :self.vocab_size]
