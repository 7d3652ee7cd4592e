"""Which part of the model one tensor-parallel rank holds, and the check that a model splits.

Rank r of T holds a contiguous run of KV heads (`kv_head_range`: K/T each when T divides K,
else the first K % T ranks one more) and the query heads of those KV heads' groups, so every
query head's KV head lives on the same rank; 1/T of the MLP's intermediate features; and rows
[r*ceil(V/T), (r+1)*ceil(V/T)) of the vocabulary (embedding and LM head; the last shard is
padded). KV heads are never replicated, so T may not exceed the KV head count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from pdserve.common.config import ModelConfig


class Communicator(Protocol):
    """Collectives among the ranks of one tensor-parallel group. Every rank calls each method
    in the same order with tensors of the same shape (the forward is identical on all ranks).
    Results are bitwise identical on every rank (partials are summed in rank order)."""

    rank: int
    world_size: int

    def all_reduce(self, t: torch.Tensor) -> None:
        """t (contiguous) <- the sum of every rank's t, in place."""

    def gather_last_dim(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        """t [N, k] on each rank -> [N, k * world] (rank order) on rank 0; None elsewhere."""

    def barrier(self) -> None:
        """Return once every rank called it: every store a rank made before its call is then
        visible to the others (what rank 0 needs before it reads another rank's shared KV)."""

    def abort(self) -> None:
        """Make peers blocked in a collective raise (where the transport allows it)."""

    def close(self) -> None:
        """Release the group and its buffers."""


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in its group; `comm` is None only when size == 1."""

    rank: int = 0
    size: int = 1
    comm: Optional[Communicator] = None

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is not in [0, {self.size})")
        if self.size > 1 and self.comm is None:
            raise ValueError("tensor parallel size > 1 needs a communicator")

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            self.comm.all_reduce(t)
        return t


SINGLE = TensorParallel()


def kv_head_range(num_kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """(first KV head, count) of rank `rank`: contiguous, counts differ by at most one (the
    first num_kv_heads % size ranks hold one more)."""
    base, extra = divmod(num_kv_heads, size)
    return rank * base + min(rank, extra), base + (rank < extra)


def check_tp_split(cfg: ModelConfig, tp_size: int) -> None:
    """ValueError naming the count that tp_size cannot split: every rank needs at least one
    KV head (they are not replicated) and an equal share of the MLP's features."""
    if cfg.num_kv_heads < tp_size:
        raise ValueError(f"tensor_parallel_size {tp_size} is larger than the model's "
                         f"{cfg.num_kv_heads} KV heads (each rank needs one; they are not "
                         f"replicated); use at most {cfg.num_kv_heads}")
    if cfg.intermediate_size % tp_size:
        raise ValueError(f"tensor_parallel_size {tp_size} does not divide the model's "
                         f"intermediate size {cfg.intermediate_size}")


def vocab_shard(vocab_size: int, tp_size: int) -> int:
    """Rows of the vocabulary each rank holds (the last rank's shard is padded)."""
    return -(-vocab_size // tp_size)


@dataclass(frozen=True)
class PipelineStage:
    """Which decoder layers one pipeline stage holds: [first_layer, first_layer + num_layers).
    The first stage also holds the embedding, the last the final norm and the LM head."""

    stage: int = 0
    size: int = 1
    first_layer: int = 0
    num_layers: int = -1  # -1: every layer (size 1)

    def __post_init__(self):
        if not 0 <= self.stage < self.size:
            raise ValueError(f"pipeline stage {self.stage} is not in [0, {self.size})")
        if self.size > 1 and self.num_layers < 1:
            raise ValueError("a pipeline stage holds at least one layer")

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.size - 1

    def layers(self, total: int) -> range:
        n = total if self.num_layers < 0 else self.num_layers
        return range(self.first_layer, self.first_layer + n)


WHOLE_MODEL = PipelineStage()


def pipeline_stage(num_layers: int, stage: int, size: int) -> PipelineStage:
    """Stage `stage` of `size`: contiguous runs of layers whose counts differ by at most one;
    the first num_layers % size stages hold one more (the last stage also runs the LM head,
    the largest matmul, while the first stage's embedding is only a lookup)."""
    check_pp_split(num_layers, size)
    first, count = kv_head_range(num_layers, stage, size)  # the same even split
    return PipelineStage(stage, size, first, count)


def check_pp_split(num_layers: int, pp_size: int) -> None:
    if num_layers < pp_size:
        raise ValueError(f"pipeline_parallel_size {pp_size} is larger than the model's "
                         f"{num_layers} decoder layers (each stage needs one); use at most "
                         f"{num_layers}")


@dataclass(frozen=True)
class RankPlace:
    """Global rank = stage * T + tensor-parallel rank: each stage's T ranks are consecutive,
    and rank 0 (the engine process) is tensor rank 0 of the first stage."""

    rank: int
    tp_size: int
    pp_size: int

    def __post_init__(self):
        if not 0 <= self.rank < self.tp_size * self.pp_size:
            raise ValueError(f"rank {self.rank} is not in [0, {self.tp_size * self.pp_size})")

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def stage(self) -> int:
        return self.rank // self.tp_size

    def global_rank(self, stage: int, tp_rank: int) -> int:
        return stage * self.tp_size + tp_rank
