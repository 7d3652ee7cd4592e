"""Attention backend interface and the metadata of one packed forward.

A forward packs the new tokens of many requests into one flat batch of T tokens. The runner
orders requests so that the `num_decodes` decode requests (exactly one new token each) come first,
then the prefill / extend requests (one or more new tokens each, a chunk of a prompt, attending to
their cached prefix and causally to the chunk itself).

Per layer the model calls `write_kv` with the new tokens' keys and values, then `forward`; so by
the time `forward` runs, the cache already holds every token of every request's context.

KV cache layout, one tensor per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
(index 0 = keys, 1 = values). Cache slot s = block_id * block_size + offset.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable, Optional

import torch


@dataclass
class AttentionMetadata:
    num_tokens: int  # T
    num_decodes: int  # the first num_decodes requests (and tokens) are single-token decodes
    query_start_loc: torch.Tensor  # [R+1] int32, cumulative query lengths (device)
    seq_lens: torch.Tensor  # [R] int32, context length after this step = cached + new (device)
    block_tables: torch.Tensor  # [R, max_blocks] int32, padded with 0 (device)
    slot_mapping: torch.Tensor  # [T] int64, cache slot of each new token (device)
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int]  # [R] host copies, for backends that loop over requests
    seq_lens_cpu: list[int]  # [R]

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionBackend(abc.ABC):
    """Paged attention over the layout above. Implementations hold no per-request state."""

    name: str = "abstract"

    @abc.abstractmethod
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Store key/value [T, kv_heads, head_dim] at kv_cache slots slot_mapping [T]."""

    @abc.abstractmethod
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """query [T, heads, head_dim]; key/value [T, kv_heads, head_dim] are the new tokens
        (already written to kv_cache). Returns [T, heads, head_dim]."""

    def fused_forward(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                      num_heads: int) -> Optional[torch.Tensor]:
        """Optional fast path for a whole layer's attention: rotate-half rotary on q and k
        (cos, sin [T, head_dim] for each token's position), k and v written to their slots,
        attention for every request of the batch; the same result as the three steps done
        apart. qkv [T, (heads + 2 kv_heads) * head_dim]. Returns [T, heads, head_dim], or None
        when this backend cannot (then the model does the three steps itself, and nothing was
        written)."""
        return None

    def fused_step(self, meta: AttentionMetadata, kv_cache: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> Optional[Callable[..., torch.Tensor]]:
        """`fused_forward` for every layer of one fp32 step, its per-step checks done once:
        `attend(qkv, kv_cache, scale, num_heads)` -> [T, heads, head_dim] (each layer's cache
        laid out and typed like `kv_cache`), or None where fused_forward would return None."""
        return None


def get_attention_backend(name: str, device: str) -> AttentionBackend:
    """Resolve `auto | torch | triton`: auto picks triton on CUDA and torch elsewhere."""
    if name == "auto":
        name = "triton" if str(device).startswith("cuda") else "torch"
    if name == "torch":
        from pdserve.common.attention.torch_backend import TorchAttentionBackend
        return TorchAttentionBackend()
    if name == "triton":
        from pdserve.common.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend()
    raise ValueError(f"attention_backend must be one of auto, torch, triton, got {name!r}")
