"""Deterministic, chained, versioned block hashes.

hash(block i) = sha256(hash(block i-1) || token ids of block i || extra keys), where the chain
starts from a seed = sha256(layout version || model fingerprint || cache_salt). Only full blocks
get hashes. Every process on every host computes the same key for the same block (never Python's
`hash()`, whose strings are salted per process), and a different model, dtype, block size,
layout version or tenant salt can never produce a colliding chain.
"""

from __future__ import annotations

import hashlib
from typing import Optional, Sequence

import numpy as np

BLOCK_HASH_VERSION = b"pdserve-block-hash-v1"

BlockHash = bytes  # 32-byte sha256 digest


def chain_seed(model_fingerprint: str, block_size: int, cache_salt: Optional[str] = None) -> BlockHash:
    h = hashlib.sha256(BLOCK_HASH_VERSION)
    h.update(model_fingerprint.encode())
    h.update(block_size.to_bytes(4, "little"))
    h.update(b"\x00salt:" + (cache_salt or "").encode())
    return h.digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra_keys: bytes = b"") -> BlockHash:
    h = hashlib.sha256(parent)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    if extra_keys:
        h.update(b"\x00extra:" + extra_keys)
    return h.digest()


def hash_blocks(seed: BlockHash, token_ids: Sequence[int], block_size: int,
                start: int = 0, parent: Optional[BlockHash] = None) -> list[BlockHash]:
    """Hashes of the full blocks of token_ids from block index `start` on; `parent` is the hash
    of block start-1 (the seed when start == 0)."""
    parent = seed if start == 0 else parent
    if parent is None:
        raise ValueError("parent hash is required when start > 0")
    out = []
    arr = np.asarray(token_ids, dtype=np.int64)
    for i in range(start, len(arr) // block_size):
        parent = hash_block(parent, arr[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out
