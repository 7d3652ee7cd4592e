"""Checks of what a caller sends the master, applied at the gRPC edge before any state changes.

Every repeated field, key, string and number a peer controls is bounded here, so no request
can grow the master's memory or Redis without limit, stall it with a huge batch, or plant a
lease that never ends (NaN and inf compare false against every bound, so they are refused
explicitly). Each check raises ValueError with a message the caller gets as INVALID_ARGUMENT.
"""

from __future__ import annotations

import math

from pdserve.services.kvstore.config import MasterConfig

MAX_KEY_BYTES = 64  # block keys are 32-byte digests
MAX_NODE_ID = 128
MAX_ADDRESS = 256
MAX_INCARNATION = 64


def check_key(key: bytes) -> None:
    if not 0 < len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"a key must be 1..{MAX_KEY_BYTES} bytes, got {len(key)}")


def _keys_within(keys, most: int, what: str) -> list[bytes]:
    if len(keys) > most:
        raise ValueError(f"at most {most} {what} per call, got {len(keys)}")
    for k in keys:
        check_key(k)
    return list(keys)


def check_keys(keys, cfg: MasterConfig) -> list[bytes]:
    return _keys_within(keys, cfg.max_batch_keys, "keys")


def check_lease(lease_s: float, cfg: MasterConfig) -> None:
    """0 means no lease (evictable at once); anything else is a finite positive bound."""
    if not (math.isfinite(lease_s) and 0 <= lease_s <= cfg.max_lease_s):
        raise ValueError(f"lease_s must be finite and in [0, {cfg.max_lease_s}], got {lease_s}")


def check_put_start(key: bytes, size: int, lease_s: float, replica_num: int,
                    cfg: MasterConfig) -> None:
    check_key(key)
    if not 0 < size <= cfg.max_node_capacity:
        raise ValueError(f"size must be in [1, {cfg.max_node_capacity}], got {size}")
    check_lease(lease_s, cfg)
    if replica_num > cfg.max_replicas:
        raise ValueError(f"replica_num must be <= {cfg.max_replicas}, got {replica_num}")


def check_put_batch(entries, cfg: MasterConfig) -> None:
    """A BatchPutStart: at most max_batch_puts entries, each checked as a PutStart."""
    if len(entries) > cfg.max_batch_puts:
        raise ValueError(f"at most {cfg.max_batch_puts} puts per call, got {len(entries)}")
    for e in entries:
        check_put_start(e.key, e.size, e.lease_s, e.replica_num, cfg)


def check_put_keys(keys, cfg: MasterConfig) -> list[bytes]:
    """A BatchPutEnd / BatchPutRevoke: at most max_batch_puts keys."""
    return _keys_within(keys, cfg.max_batch_puts, "puts")


def check_node(node_id: str, address: str, capacity: int, incarnation: str,
               cfg: MasterConfig) -> None:
    if not 0 < len(node_id) <= MAX_NODE_ID:
        raise ValueError(f"node_id must be 1..{MAX_NODE_ID} characters")
    if not 0 < len(address) <= MAX_ADDRESS or ":" not in address:
        raise ValueError(f"address must be host:port of at most {MAX_ADDRESS} characters")
    if not 0 < capacity <= cfg.max_node_capacity:
        raise ValueError(f"capacity must be in [1, {cfg.max_node_capacity}], got {capacity}")
    if len(incarnation) > MAX_INCARNATION:
        raise ValueError(f"incarnation must be at most {MAX_INCARNATION} characters")
