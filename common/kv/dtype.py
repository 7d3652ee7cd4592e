"""The KV cache's element type (`--kv-cache-dtype`, EngineConfig.kv_cache_dtype).

The cache stores K/V in this type; attention widens each element to the activations' dtype as
it reads it (fp32 on the CPU), so a half cache halves the bytes a decode step streams from
memory and the bytes a block takes in the KV store, at the cost of rounding K and V once when
they are written (to nearest even). `auto` is the activations' dtype (`--dtype`).
"""

from __future__ import annotations

import torch

from pdserve.common.config import KV_CACHE_DTYPES, EngineConfig
from pdserve.common.models.dtype import resolve_dtype
_BY_NAME = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_kv_cache_dtype(name: str, activation_dtype: torch.dtype = torch.float32
                           ) -> torch.dtype:
    """The torch dtype of the KV cache for a `kv_cache_dtype` setting."""
    if name == "auto":
        return activation_dtype
    if name not in _BY_NAME:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                         f"got {name!r}")
    return _BY_NAME[name]


def engine_kv_dtype(config: EngineConfig) -> torch.dtype:
    """The KV cache dtype an engine of `config` allocates (auto: its activations' dtype)."""
    return resolve_kv_cache_dtype(config.kv_cache_dtype, resolve_dtype(config.dtype,
                                                                       config.device))


def kv_bytes_per_token(fp32_bytes_per_token: int, dtype: torch.dtype) -> int:
    """ModelConfig.kv_bytes_per_token (counted in fp32) for a cache of `dtype`."""
    return fp32_bytes_per_token // 4 * torch.empty((), dtype=dtype).element_size()
