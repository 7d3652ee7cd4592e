"""Layout-independent KV blocks: the store's block holds every KV head, in head order, however
the engine that wrote it (or reads it) splits its heads over tensor-parallel ranks.

A stored block is [layers, 2, block_size, all KV heads, head_dim] (codec.py), the same bytes a
TP=1 engine writes, under the same key (the block's chained hash): so prefill with TP=a and
decode with TP=b exchange blocks through the store, and the router's block-lookup keys do not
depend on any layout. `HeadShards` maps between that block and the engine's caches: rank r's
cache of layer l is [2, blocks, block_size, its heads, head_dim] and holds heads
[offset_r, offset_r + heads_r) (contiguous runs in rank order, common/distributed/layout.py).
At T > 1 the ranks' caches live in shared memory (common/distributed/kv_share.py), so rank 0's
connector reads and writes every rank's heads directly.
"""

from __future__ import annotations

import torch


class HeadShards:
    def __init__(self, shards: list[list[torch.Tensor]]):
        """shards[r][l]: rank r's cache of layer l, [2, blocks, block_size, heads_r, d]."""
        if not shards or any(len(s) != len(shards[0]) for s in shards):
            raise ValueError("every rank needs one cache per layer")
        self.shards = shards
        self.num_layers = len(shards[0])
        self.offsets: list[int] = []
        total = 0
        for s in shards:
            self.offsets.append(total)
            total += s[0].shape[3]
        self.num_kv_heads = total

    def copy_layer_into(self, out: torch.Tensor, layer: int, block_ids: torch.Tensor) -> None:
        """out [n, 2, block_size, K, d] <- layer `layer` of blocks block_ids (all heads)."""
        for off, s in zip(self.offsets, self.shards):
            cache = s[layer]  # [2, blocks, bs, h, d]
            h = cache.shape[3]
            out[..., off:off + h, :].copy_(cache[:, block_ids].transpose(0, 1))

    def write_layer_from(self, src: torch.Tensor, layer: int, block_ids: torch.Tensor) -> None:
        """Layer `layer` of blocks block_ids (all heads) <- src [n, 2, block_size, K, d]: the
        inverse of copy_layer_into, one indexed copy per rank (a load installs its blocks a
        layer at a time: ~3x faster than block by block, layer by layer)."""
        for off, s in zip(self.offsets, self.shards):
            cache = s[layer]  # [2, blocks, bs, h, d]
            h = cache.shape[3]
            cache.index_copy_(1, block_ids, src[..., off:off + h, :].transpose(0, 1))

    def read_block(self, block_id: int) -> torch.Tensor:
        """Block block_id with every head: [layers, 2, block_size, K, d] (a copy)."""
        return torch.stack([torch.cat([s[layer][:, block_id] for s in self.shards], dim=-2)
                            for layer in range(self.num_layers)])

    def write_block(self, block_id: int, block: torch.Tensor) -> None:
        """Install block [layers, 2, block_size, K, d] into every rank's heads of block_id."""
        for off, s in zip(self.offsets, self.shards):
            for layer, cache in enumerate(s):
                h = cache.shape[3]
                cache[:, block_id].copy_(block[layer, ..., off:off + h, :])
