"""KV cache manager: which blocks each request holds, prefix-cache lookups, allocation.

Lifecycle of a request's blocks:
1. `get_computed_blocks` (no side effects) finds the longest cached prefix of full blocks.
2. `allocate_slots` takes references on those hits and allocates new blocks for the tokens to
   compute this step; it returns None, changing nothing, when the pool cannot serve it.
3. After the step, `cache_blocks` publishes the request's newly full, computed blocks by hash.
4. `free` drops the request's references, tail first, so the prefix is evicted last.
"""

from __future__ import annotations

from typing import Optional

from pdserve.common.engine.request import Request
from pdserve.common.kv.block_hash import BlockHash, chain_seed, hash_blocks
from pdserve.common.kv.block_pool import Block, BlockPool


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, model_fingerprint: str):
        self.pool = pool
        self.block_size = block_size
        self.model_fingerprint = model_fingerprint
        self.req_blocks: dict[str, list[Block]] = {}
        self._num_cached: dict[str, int] = {}  # leading blocks of a request already published
        self._seeds: dict[Optional[str], BlockHash] = {}
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found

    def _seed(self, salt: Optional[str]) -> BlockHash:
        if salt not in self._seeds:
            self._seeds[salt] = chain_seed(self.model_fingerprint, self.block_size, salt)
        return self._seeds[salt]

    def update_block_hashes(self, request: Request) -> list[BlockHash]:
        """Extend request.block_hashes to cover every full block of its tokens."""
        n_have = len(request.block_hashes)
        if request.num_tokens // self.block_size > n_have:
            parent = request.block_hashes[-1] if n_have else None
            request.block_hashes.extend(hash_blocks(
                self._seed(request.params.cache_salt), request.all_token_ids, self.block_size,
                start=n_have, parent=parent))
        return request.block_hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        """Longest cached prefix of full blocks, leaving at least one token to compute (the
        last one's logits are needed). Returns (blocks, number of tokens they hold)."""
        if not self.pool.enable_caching:
            return [], 0
        hashes = self.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[Block] = []
        for h in hashes[:max_blocks]:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (not every attempt of a request that waits)."""
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[Block] = ()) -> Optional[list[Block]]:
        """Make room for num_new_tokens after request.num_computed_tokens (+ the hits).
        Returns the newly allocated blocks, or None (and no change) if the pool is short."""
        held = self.req_blocks.get(request.request_id, [])
        total = (request.num_computed_tokens + len(new_computed_blocks) * self.block_size
                 + num_new_tokens)
        need = -(-total // self.block_size) - len(held) - len(new_computed_blocks)
        # hits sitting in the free queue stop being allocatable once referenced
        hit_free = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if need + hit_free > self.pool.num_free_blocks:
            return None
        self.pool.touch(new_computed_blocks)
        new = self.pool.get_new_blocks(max(need, 0))
        self.req_blocks[request.request_id] = held + list(new_computed_blocks) + new
        return new

    def cache_blocks(self, request: Request) -> None:
        """Publish every full block whose tokens are all computed."""
        if not self.pool.enable_caching:
            return
        hashes = self.update_block_hashes(request)
        blocks = self.req_blocks.get(request.request_id, [])
        n_full = min(request.num_computed_tokens // self.block_size, len(hashes), len(blocks))
        start = self._num_cached.get(request.request_id, 0)
        for block, h in zip(blocks[start:n_full], hashes[start:n_full]):
            self.pool.cache_full_block(block, h)
        self._num_cached[request.request_id] = max(start, n_full)

    def free(self, request: Request) -> None:
        blocks = self.req_blocks.pop(request.request_id, [])
        self._num_cached.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]
