"""A pipeline stage's packed decoder layers as ONE native call for a step of a few decodes
(`packed_decode_layers`, quant/cpu_kernels/fused_layer.cpp): every layer's phases in one
OpenMP parallel region, a barrier between layers.

Why: with one call per layer (packed_layer.py) a batch-1 SmolLM2 step still made 30 Python
calls, 30 argument conversions and checks, 30 buffer allocations and 30 parallel regions. The
stack runs the same phases on the same values, so its output is bit-identical to the layer
calls. The model takes it only where no per-layer hook (the KV connector's `layer_done`) must
run between layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from pdserve.common.models.packed_layer import DecodeStep, PackedLayer


@dataclass(frozen=True)
class PackedStack:
    """The layers' arguments as lists, in layer order, prepared once at load."""

    ln1: tuple[torch.Tensor, ...]  # each [hidden]
    ln2: tuple[torch.Tensor, ...]
    eps: float
    qkv: tuple[torch.Tensor, ...]  # packed uint8 [N, row_bytes] each
    o: tuple[torch.Tensor, ...]
    gate_up: tuple[torch.Tensor, ...]
    down: tuple[torch.Tensor, ...]
    qtypes: tuple[int, ...]  # [4 L]: qkv, o, gate_up, down per layer
    biases: tuple[Optional[torch.Tensor], ...]  # [4 L], likewise
    num_heads: int
    scale: float
    # each layer's qkv tail (PackedLayer.qkv_tail) as the kernel takes it: bytes, type and
    # bias per layer (None, 0, None where a layer has none); all () when no layer has one
    tails: tuple[Optional[torch.Tensor], ...] = ()
    tail_qtypes: tuple[int, ...] = ()
    tail_biases: tuple[Optional[torch.Tensor], ...] = ()

    def __post_init__(self):
        n = len(self.ln1)
        lists = (self.ln2, self.qkv, self.o, self.gate_up, self.down)
        if n == 0 or any(len(x) != n for x in lists):
            raise ValueError(f"a stack needs one entry per layer in every list ({n} layers)")
        if len(self.qtypes) != 4 * n or len(self.biases) != 4 * n:
            raise ValueError(f"qtypes and biases need four entries per layer ({4 * n})")
        tail_lens = {len(self.tails), len(self.tail_qtypes), len(self.tail_biases)}
        if tail_lens not in ({0}, {n}):
            raise ValueError(f"qkv tails: one entry per layer ({n}) in each list, or none")

    @classmethod
    def of(cls, layers: Sequence[PackedLayer]) -> Optional["PackedStack"]:
        """The stack of `layers`, or None when they differ in what one call takes once (norm
        eps, heads, softmax scale)."""
        first = layers[0]
        if any((p.eps, p.num_heads, p.scale) != (first.eps, first.num_heads, first.scale)
               for p in layers):
            return None
        linears = [(p.qkv, p.o, p.gate_up, p.down) for p in layers]
        tails = [p.qkv_tail for p in layers]
        if all(t is None for t in tails):
            tails = []
        return cls(tuple(p.ln1 for p in layers), tuple(p.ln2 for p in layers), first.eps,
                   *(tuple(ls[j].data for ls in linears) for j in range(4)),
                   qtypes=tuple(m.qtype for ls in linears for m in ls),
                   biases=tuple(m.bias for ls in linears for m in ls),
                   num_heads=first.num_heads, scale=first.scale,
                   tails=tuple(None if t is None else t.data for t in tails),
                   tail_qtypes=tuple(0 if t is None else t.qtype for t in tails),
                   tail_biases=tuple(None if t is None else t.bias for t in tails))

    def forward(self, gemm, x: torch.Tensor, kv_caches: Sequence[torch.Tensor],
                step: DecodeStep) -> torch.Tensor:
        """x [T, hidden] fp32 -> the last layer's output [T, hidden]; `kv_caches` one per
        layer; `gemm` the packed kernels' module (quant/cpu_native.py)."""
        return gemm.packed_decode_layers(
            x, self.ln1, self.ln2, self.eps, self.qkv, self.o, self.gate_up, self.down,
            self.qtypes, self.biases, step.cos, step.sin, kv_caches, step.slot_mapping,
            step.block_tables, step.seq_lens, self.scale, self.num_heads, self.tails,
            self.tail_qtypes, self.tail_biases)
