"""How many bytes a loaded model's weights hold, packed or not (for the memory plan)."""

from __future__ import annotations

import torch
from torch import nn

from pdserve.common.kv.memory import WeightsFootprint
from pdserve.common.models.quant.packed import HoldsPacked, PackedWeight


def weights_footprint(model: nn.Module) -> WeightsFootprint:
    """Resident bytes of every parameter, GGUF-packed weight (`HoldsPacked` modules) and
    oneDNN prepacked weight (`packed`: cpu_gemm.py), each storage counted once (a tied head
    shares the embedding's), beside the bytes all of them take as fp32."""
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
        if isinstance(module, HoldsPacked):
            for w in module.packed_parts:
                count(w.data, w.fp32_nbytes)
        onednn = getattr(module, "packed", None)
        if isinstance(onednn, torch.Tensor):
            count(onednn, onednn.numel() * 4)
    return WeightsFootprint(resident, fp32)


def loaded_weights_footprint(weights: dict, tp_size: int = 1) -> WeightsFootprint:
    """The same count from the loaded checkpoint, before any model is built (the KV plan comes
    first: the executor allocates each rank's model and KV caches together), summed over the
    tp_size ranks. A PackedWeight counts packed where it stays packed: always with one rank;
    under tensor parallelism unless it is a row-parallel linear whose input features do not
    split into whole blocks (linear.py's `keeps_packed`). That split is checked on every weight
    here, which over-counts a column-parallel one that would stay packed (a safe error: fewer
    KV blocks); the last vocabulary shard's zero padding is not counted."""
    seen: set[int] = set()
    resident = fp32 = 0
    for w in weights.values():
        data = w.data if isinstance(w, PackedWeight) else w
        key = data.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        as_fp32 = w.fp32_nbytes if isinstance(w, PackedWeight) else w.numel() * 4
        packed = isinstance(w, PackedWeight) and _stays_packed(w, tp_size)
        resident += data.numel() * data.element_size() if packed or not isinstance(
            w, PackedWeight) else as_fp32
        fp32 += as_fp32
    return WeightsFootprint(resident, fp32)


def _stays_packed(w: PackedWeight, tp_size: int) -> bool:
    if tp_size == 1:
        return True
    n = w.in_features // tp_size
    return w.in_features % tp_size == 0 and w.splits_at(0, n)
