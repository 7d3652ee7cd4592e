"""How many bytes a loaded model's weights hold, packed or not (for the memory plan)."""

from __future__ import annotations

import torch
from torch import nn

from pdserve.common.kv.memory import WeightsFootprint
from pdserve.common.models.quant.packed import PackedWeight


def weights_footprint(model: nn.Module) -> WeightsFootprint:
    """Resident bytes of every parameter, GGUF-packed weight (`packed_weight`) and oneDNN
    prepacked weight (`packed`, `packed_shards`: cpu_gemm.py), each storage counted once (a tied
    head shares the embedding's), beside the bytes all of them take as fp32."""
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
        w = getattr(module, "packed_weight", None)
        if isinstance(w, PackedWeight):
            count(w.data, w.fp32_nbytes)
        onednn = [getattr(module, "packed", None)] + [
            t for t, _ in (getattr(module, "packed_shards", None) or [])]
        for t in onednn:
            if isinstance(t, torch.Tensor):
                count(t, t.numel() * 4)
    return WeightsFootprint(resident, fp32)
