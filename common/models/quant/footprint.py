"""How many bytes a loaded model's weights hold, packed or not (for the memory plan)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pdserve.common.kv.memory import WeightsFootprint
from pdserve.common.models.linear import PackedLoading
from pdserve.common.models.quant.embedding import PackedEmbedding
from pdserve.common.models.quant.packed import PackedWeight


def weights_footprint(model: nn.Module) -> WeightsFootprint:
    """Resident bytes of every parameter, GGUF-packed weight (the packed linears' parts, the
    packed embedding's) and oneDNN prepacked weight (`packed`: cpu_gemm.py), each storage
    counted once (a tied head shares the embedding's), beside the bytes all of them take as
    fp32."""
    seen: set[int] = set()
    resident = fp32 = 0

    def count(t: torch.Tensor, as_fp32: int) -> None:
        nonlocal resident, fp32
        key = id(t) if t.is_mkldnn else t.untyped_storage().data_ptr()
        if key in seen:
            return
        seen.add(key)
        resident += t.numel() * t.element_size()
        fp32 += as_fp32

    for module in model.modules():
        for p in module.parameters(recurse=False):
            if p is not None:
                count(p, p.numel() * 4)
        if isinstance(module, (PackedLoading, PackedEmbedding)):
            for w in module.packed_parts:
                count(w.data, w.fp32_nbytes)
        onednn = getattr(module, "packed", None)
        if isinstance(onednn, torch.Tensor):
            count(onednn, onednn.numel() * 4)
    return WeightsFootprint(resident, fp32)


def loaded_weights_footprint(weights: dict, stays_packed: Callable[[str, PackedWeight], bool]
                             = lambda name, w: True) -> WeightsFootprint:
    """The same count from the loaded checkpoint, before any model is built (the KV plan comes
    first: the executor allocates each rank's model and KV caches together), summed over the
    ranks. A PackedWeight counts packed where `stays_packed(name, w)` (under tensor
    parallelism: llama.py's `tp_keeps_packed`), else as fp32. A fused layer with one fp32
    shard (a type without a kernel) expands its packed shards too; those count packed here,
    so for such files the estimate can run low by those shards' expansion."""
    seen: set[int] = set()
    resident = fp32 = 0
    for name, w in weights.items():
        data = w.data if isinstance(w, PackedWeight) else w
        key = data.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        as_fp32 = w.fp32_nbytes if isinstance(w, PackedWeight) else w.numel() * 4
        packed = isinstance(w, PackedWeight) and stays_packed(name, w)
        resident += data.numel() * data.element_size() if packed or not isinstance(
            w, PackedWeight) else as_fp32
        fp32 += as_fp32
    return WeightsFootprint(resident, fp32)
