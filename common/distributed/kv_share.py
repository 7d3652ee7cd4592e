"""Every CPU rank's KV cache in shared memory, so rank 0's KV connector can reach all heads.

Used only when an engine with T > 1 has a KV connector (the store hand-off): the connector runs
in the engine process (rank 0), and a block in the store always holds every KV head, whatever
layout wrote it (connector/layout.py). Lifecycle:
1. rank 0 creates one zeroed file per rank in /dev/shm (`create_kv_files`), before the
   workers start; each file holds that rank's heads of every layer and block,
   [layers, 2, blocks, block_size, its KV heads, head_dim] fp32;
2. each rank maps its own file as its KV cache (`map_rank_kv`); rank 0 also maps every
   other rank's (`map_all_kv`) for the connector;
3. once every worker is ready, rank 0 unlinks the names (the mappings stay); a failed start
   unlinks them in the executor's shutdown.
Ordering: the connector reads layer i of the other ranks after rank 0 finished layer i, whose
last all-reduce every rank joined after writing layer i's K/V, so those writes are visible
(x86 total store order; the shared-memory barrier and gloo both synchronise).
"""

from __future__ import annotations

import os
import tempfile

import torch

from pdserve.common.config import ModelConfig
from pdserve.common.distributed.layout import kv_head_range


def _shape(cfg: ModelConfig, rank: int, size: int, num_blocks: int,
           block_size: int) -> tuple[int, ...]:
    _, heads = kv_head_range(cfg.num_kv_heads, rank, size)
    return (cfg.num_layers, 2, num_blocks, block_size, heads, cfg.head_dim)


def create_kv_files(cfg: ModelConfig, size: int, num_blocks: int, block_size: int
                    ) -> list[str]:
    """One zeroed /dev/shm file per rank (rank order) sized for its heads' caches."""
    paths: list[str] = []
    try:
        for rank in range(size):
            n = 4
            for d in _shape(cfg, rank, size, num_blocks, block_size):
                n *= d
            fd, path = tempfile.mkstemp(prefix=f"pdserve-kv{rank}-", dir="/dev/shm")
            paths.append(path)
            try:
                os.ftruncate(fd, n)
            finally:
                os.close(fd)
    except BaseException:
        unlink_kv_files(paths)
        raise
    return paths


def map_rank_kv(path: str, cfg: ModelConfig, rank: int, size: int, num_blocks: int,
                block_size: int) -> list[torch.Tensor]:
    """Rank `rank`'s KV caches mapped from its file: one [2, blocks, block_size, heads,
    head_dim] view per layer (the layout allocate_kv_caches gives)."""
    shape = _shape(cfg, rank, size, num_blocks, block_size)
    n = 1
    for d in shape:
        n *= d
    flat = torch.from_file(path, shared=True, size=n, dtype=torch.float32)
    whole = flat.view(shape)
    return [whole[layer] for layer in range(cfg.num_layers)]


def map_all_kv(paths: list[str], cfg: ModelConfig, num_blocks: int, block_size: int
               ) -> list[list[torch.Tensor]]:
    """Every rank's caches (rank order), for rank 0's KV connector."""
    return [map_rank_kv(p, cfg, r, len(paths), num_blocks, block_size)
            for r, p in enumerate(paths)]


def unlink_kv_files(paths: list[str]) -> None:
    for path in paths:
        if os.path.exists(path):
            os.unlink(path)
