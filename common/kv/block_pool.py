"""Block pool: the physical KV blocks, their reference counts, the LRU free queue and the
hash -> block map that makes prefix caching work.

Contract (checked by property tests):
- every block is in exactly one of: free (ref 0, no hash), cached (ref 0, hash, still in the free
  queue and reusable until evicted), in use (ref > 0). free + cached + in use == total.
- the free queue is in eviction order: blocks freed earlier are evicted first; a request frees
  its blocks tail-first so that a prefix outlives its suffix.
- a block is evicted (loses its hash) only when it is popped to serve a new allocation.
- reference counts never go negative; freeing a block with ref 0 raises.
"""

from __future__ import annotations

from typing import Iterable, Optional

from pdserve.common.kv.block_hash import BlockHash


class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev", "next")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Optional[BlockHash] = None
        self.prev: Optional[Block] = None
        self.next: Optional[Block] = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) popleft, append and removal from the middle
    (a cache hit on a free block takes it out of the queue)."""

    def __init__(self, blocks: list[Block]):
        self._head = Block(-1)  # sentinels
        self._tail = Block(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self.size = 0
        for b in blocks:
            self.append(b)

    def append(self, block: Block) -> None:
        last = self._tail.prev
        last.next, block.prev = block, last
        block.next, self._tail.prev = self._tail, block
        self.size += 1

    def popleft(self) -> Block:
        if self.size == 0:
            raise ValueError("no free blocks")
        block = self._head.next
        self.remove(block)
        return block

    def remove(self, block: Block) -> None:
        if block.prev is None or block.next is None:
            raise RuntimeError(f"{block} is not in the free queue")
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.size -= 1

    def __iter__(self):
        b = self._head.next
        while b is not self._tail:
            yield b
            b = b.next


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, Block] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free or cached-but-unreferenced)."""
        return self.free_queue.size

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, n: int) -> list[Block]:
        """n blocks with ref 1, evicting cached ones from the LRU end; ValueError if short."""
        if n > self.free_queue.size:
            raise ValueError(f"cannot allocate {n} blocks, {self.free_queue.size} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: Block) -> None:
        if block.block_hash is None:
            return
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = None
        self.num_evictions += 1

    def get_cached_block(self, block_hash: BlockHash) -> Optional[Block]:
        return self.cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on (cache-hit) blocks, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[Block]) -> None:
        """Drop one reference each, in the given order (= eviction order once free)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_full_block(self, block: Block, block_hash: BlockHash) -> None:
        """Mark a full, computed block as reusable under block_hash."""
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        self.cached.setdefault(block_hash, block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only when no block is in use."""
        if self.free_queue.size != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        return True

    def counts(self) -> tuple[int, int, int]:
        """(free, cached, in use) by scanning every block; for tests and assertions."""
        free = sum(1 for b in self.blocks if b.ref_cnt == 0 and b.block_hash is None)
        cached = sum(1 for b in self.blocks if b.ref_cnt == 0 and b.block_hash is not None)
        return free, cached, self.num_blocks - free - cached
