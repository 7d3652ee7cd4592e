"""Every CPU rank's KV cache in shared memory, so rank 0's KV connector can reach all heads of
all layers.

Used only when an engine with T x P > 1 has a KV connector (the store hand-off): the connector
runs in the engine process (rank 0), and a block in the store always holds every layer and KV
head, whatever layout wrote it (connector/layout.py). Lifecycle:
1. rank 0 creates one zeroed file per global rank in /dev/shm (`create_kv_files`), before the
   workers start; each file holds that rank's heads of its pipeline stage's layers, every
   block: [stage layers, 2, blocks, block_size, its KV heads, head_dim] fp32;
2. each rank maps its own file as its KV cache (`map_rank_kv`); rank 0 also maps every
   other rank's (`map_all_kv`) and joins each tensor rank's stages into one list of every
   layer (`by_tensor_rank`) for the connector;
3. once every worker is ready, rank 0 unlinks the names (the mappings stay); a failed start
   unlinks them in the executor's shutdown.
Ordering (why rank 0 sees the other ranks' writes; x86 total store order, and the
shared-memory barrier, gloo and the socket calls all synchronise):
- without stages, the connector reads layer i after rank 0 finished layer i, whose last
  all-reduce every rank joined after writing layer i's K/V;
- with stages, it reads a step's blocks only once that step's logits (or, for a step that
  samples nothing, the last stage's end-of-step marker) came back: every stage wrote its
  layers before it handed its hidden states on, and each stage's tensor ranks joined an
  all-reduce after writing, so the chain of messages ends at rank 0 after every write;
- a load writes blocks that no step in flight uses (the connector holds an aborted request's
  blocks until its step came back) and that no step reads until the scheduler saw the load
  finished (then sends that step to every rank over its socket).
"""

from __future__ import annotations

import os
import tempfile

import torch

from pdserve.common.config import ModelConfig
from pdserve.common.distributed.layout import RankPlace, kv_head_range, pipeline_stage


def _shape(cfg: ModelConfig, place: RankPlace, num_blocks: int,
           block_size: int) -> tuple[int, ...]:
    _, heads = kv_head_range(cfg.num_kv_heads, place.tp_rank, place.tp_size)
    layers = pipeline_stage(cfg.num_layers, place.stage, place.pp_size).num_layers
    return (layers, 2, num_blocks, block_size, heads, cfg.head_dim)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def create_kv_files(cfg: ModelConfig, tp_size: int, pp_size: int, num_blocks: int,
                    block_size: int) -> list[str]:
    """One zeroed /dev/shm file per global rank (rank order) sized for its caches."""
    paths: list[str] = []
    try:
        for rank in range(tp_size * pp_size):
            shape = _shape(cfg, RankPlace(rank, tp_size, pp_size), num_blocks, block_size)
            fd, path = tempfile.mkstemp(prefix=f"pdserve-kv{rank}-", dir="/dev/shm")
            paths.append(path)
            try:
                os.ftruncate(fd, 4 * _numel(shape))
            finally:
                os.close(fd)
    except BaseException:
        unlink_kv_files(paths)
        raise
    return paths


def map_rank_kv(path: str, cfg: ModelConfig, place: RankPlace, num_blocks: int,
                block_size: int) -> list[torch.Tensor]:
    """A rank's KV caches mapped from its file: one [2, blocks, block_size, heads, head_dim]
    view per layer of its stage (the layout allocate_kv_caches gives)."""
    shape = _shape(cfg, place, num_blocks, block_size)
    flat = torch.from_file(path, shared=True, size=_numel(shape), dtype=torch.float32)
    whole = flat.view(shape)
    return [whole[layer] for layer in range(shape[0])]


def map_all_kv(paths: list[str], cfg: ModelConfig, tp_size: int, pp_size: int,
               num_blocks: int, block_size: int) -> list[list[torch.Tensor]]:
    """Every global rank's caches (rank order), for rank 0's KV connector."""
    if len(paths) != tp_size * pp_size:
        raise ValueError(f"{len(paths)} KV files for {tp_size * pp_size} ranks")
    return [map_rank_kv(p, cfg, RankPlace(r, tp_size, pp_size), num_blocks, block_size)
            for r, p in enumerate(paths)]


def by_tensor_rank(per_rank: list[list[torch.Tensor]], tp_size: int
                   ) -> list[list[torch.Tensor]]:
    """Global ranks' caches (rank = stage * T + tensor rank) -> one list per tensor rank of
    every layer's cache, stages joined in layer order (stages hold contiguous layer runs in
    stage order): the view connector/layout.HeadShards takes."""
    pp_size = len(per_rank) // tp_size
    return [[cache for stage in range(pp_size) for cache in per_rank[stage * tp_size + j]]
            for j in range(tp_size)]


def unlink_kv_files(paths: list[str]) -> None:
    for path in paths:
        if os.path.exists(path):
            os.unlink(path)


def check_shareable_kv(device: str, kv_dtype: torch.dtype) -> None:
    """NotImplementedError unless a KV connector can reach every rank's cache this way."""
    if device != "cpu":
        raise NotImplementedError(
            "a KV connector (--kv-store) with tensor_parallel_size x pipeline_parallel_size "
            "> 1 needs CPU ranks: the connector in rank 0 reaches the other ranks' KV caches "
            "through shared memory, and CUDA ranks' caches are not shared with it")
    if kv_dtype != torch.float32:
        raise NotImplementedError(
            "a KV connector with tensor_parallel_size x pipeline_parallel_size > 1 keeps "
            "the ranks' caches in fp32 (--kv-cache-dtype float32)")
