"""The LM head split between the last pipeline stage and rank 0 (tensor_parallel_size 1).

Why: the LM head is SmolLM2's largest matmul (49152 x 576, about six decoder layers' time in
a decode step), and the last stage also runs its half of the layers, so in decode it was the
slowest stage (2-core AMD EPYC, 8-row micro-batches, one thread per stage: 29 ms against the
first stage's 22 ms) while rank 0 waited for its logits. Splitting the head by vocabulary rows
balances the stages in decode without moving layers, which would unbalance prefill (there the
head only sees the sampled rows and the layers dominate).

How: rank 0 (the first stage, which also samples) holds vocabulary rows [0, cut), the last
stage rows [cut, V). The last stage is built as a model whose vocabulary is its rows (its
config's vocab_size V - cut, its head's weight those rows; `last_stage_inputs`) and its
`compute_logits` also returns the normed hidden rows it multiplied (`LastStageHead`), so one
tensor [N, (V - cut) + H] goes back to rank 0 as before; rank 0 multiplies the hidden rows by
its rows (`Rank0Head`, the same layer type and kernels as the last stage's head) and joins
[N, cut] and [N, V - cut] into the logits [N, V] the sampler takes.

Both sides derive `cut` from the same configs (`head_cut`), so nothing about it travels.
Only CPU fp32 engines with pipeline stages and no tensor parallelism split (cut 0 otherwise:
the last stage keeps the whole head, as before).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from pdserve.common.config import EngineConfig, ModelConfig
from pdserve.common.models.cpu_gemm import resolve_cpu_gemm
from pdserve.common.models.dtype import resolve_dtype
from pdserve.common.models.quant.packed import PackedWeight
from pdserve.common.models.vocab_parallel import ParallelLMHead

# Rank 0's share of the vocabulary rows. It also schedules, samples and books every step
# (about 1 ms per decode micro-batch) and its stage's embedding, so it takes less than half.
# Measured per 8-row decode micro-batch on SmolLM2, one thread per stage (docs/parallelism.md):
# first stage 22.5 ms + ~1 ms, last stage 22.4 ms of layers + 7 ms of head.
RANK0_HEAD_SHARE = 0.4
_ROW_ALIGN = 64  # cut at a multiple of this (whole oneDNN / kernel row blocks)


def head_cut(config: EngineConfig, model: ModelConfig, device: str) -> int:
    """Vocabulary rows [0, cut) of the LM head that rank 0 computes; 0: no split."""
    par = config.parallel
    if (par.pipeline_parallel_size == 1 or par.tensor_parallel_size != 1
            or not device.startswith("cpu")
            or resolve_dtype(config.dtype, device) != torch.float32):
        return 0
    cut = int(model.vocab_size * RANK0_HEAD_SHARE) // _ROW_ALIGN * _ROW_ALIGN
    return cut if 0 < cut < model.vocab_size else 0


def _head_name(model: ModelConfig) -> str:
    return "embed_tokens.weight" if model.tie_word_embeddings else "lm_head.weight"


def _weight(weights: dict, model: ModelConfig):
    for name in (_head_name(model), "model." + _head_name(model)):
        if name in weights:
            return name, weights[name]
    raise ValueError(f"the checkpoint has no {_head_name(model)!r} for the LM head")


def _rows(w, start: int, stop: int):
    """Rows [start, stop) of a head weight, fp32 tensor or packed (a view either way)."""
    if isinstance(w, PackedWeight):
        return PackedWeight(w.qtype, w.data[start:stop], w.in_features)
    return w[start:stop]


def last_stage_inputs(model: ModelConfig, weights: dict, cut: int
                      ) -> tuple[ModelConfig, dict]:
    """The config and weights to build the last stage from: vocabulary rows [cut, V) only."""
    name, w = _weight(weights, model)
    mine = dict(weights)
    mine[name] = _rows(w, cut, model.vocab_size)
    return dataclasses.replace(model, vocab_size=model.vocab_size - cut), mine


class LastStageHead:
    """The last stage's model, whose `compute_logits` appends the hidden rows it multiplied:
    hidden [N, H] -> [N, (V - cut) + H] (what ModelRunner hands the link)."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.pp = model, model.pp

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        return self.model(*args, **kwargs)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.model.compute_logits(hidden)  # [N, V - cut]
        return torch.cat([logits.float(), hidden.float()], dim=1)


class Rank0Head:
    """Rank 0's vocabulary rows [0, cut) of the LM head, and the join with the last stage's."""

    def __init__(self, config: EngineConfig, model: ModelConfig, weights: dict, cut: int,
                 device: str):
        if not 0 < cut < model.vocab_size:
            raise ValueError(f"cut must be in (0, {model.vocab_size}), got {cut}")
        self.cut, self.vocab_size, self.hidden = cut, model.vocab_size, model.hidden_size
        _, w = _weight(weights, model)
        self.head = ParallelLMHead(model.hidden_size, cut)  # the last stage's layer type
        if isinstance(w, PackedWeight):
            self.head.load_packed(w.rows(0, cut))  # a copy: the whole head can be freed
            self.head.finish_loading()
        else:
            self.head.weight_loader(self.head.weight, w[:cut].float())
        self.head.to(device=device).eval()
        if self.head.weight is not None and resolve_cpu_gemm(config.cpu_gemm, device) == "onednn":
            self.head.pack_onednn()  # as pack_linears does for the last stage's head

    @property
    def received_width(self) -> int:
        """Columns of what the last stage sends: its logits, then the hidden rows."""
        return self.vocab_size - self.cut + self.hidden

    @torch.inference_mode()
    def join(self, received: torch.Tensor) -> torch.Tensor:
        """received [N, (V - cut) + H] -> logits [N, V] fp32."""
        if received.shape[0] == 0:  # nothing sampled this step
            return received.new_empty(0, self.vocab_size)
        theirs, hidden = received.split([self.vocab_size - self.cut, self.hidden], dim=1)
        mine = self.head(hidden.contiguous()).float()  # [N, cut]
        return torch.cat([mine, theirs], dim=1)


def maybe_rank0_head(config: EngineConfig, model: ModelConfig, weights: dict,
                     device: str) -> Optional[Rank0Head]:
    cut = head_cut(config, model, device)
    return Rank0Head(config, model, weights, cut, device) if cut else None
