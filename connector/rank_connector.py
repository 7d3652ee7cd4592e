"""The KV connector's per-rank mode (ConnectorConfig.per_rank; docs/parallelism.md, "Per-rank
transfers"): rank 0 still decides everything a StoreKVConnector decides (lookups, which
blocks a step fills, the backfill of local hits, decode's save budget, the holds), but moves
no bytes itself: each save and load is a `Transfer` every tensor-parallel rank runs over its
own store client for its own KV heads (one object per head, head_objects.py), and saved /
loaded / failed come from the engine's `RankKVLink` once every rank reported.

Lifecycle: built by the connector factory from an engine given a `RankKVFactory`
(`EngineCore(rank_kv=...)`, whose `rank_kv` link it takes); the scheduler side is
StoreKVConnector's; `begin_step` picks the step's saves, `end_step` (after rank 0's forward)
sends them to every rank as one message with no step, which each worker runs after its own
forward of the step (its socket is in order); a load is sent when its blocks are
allocated; `get_finished` polls the link. The link is closed by the engine.

Why the saves go after the step and not in it: the scheduler books its steps by identity
and builds them before the connector sees the batch; one small extra message per saving
step is the cost (each worker reads it after its own forward of the step: socket order).
"""

from __future__ import annotations

import itertools
import time
from typing import Optional

import torch

from pdserve.common.engine.kv_rank_messages import BlockRef, Transfer
from pdserve.common.engine.rank_kv_link import Finished, RankKVLink
from pdserve.connector.codec import BlockCodec
from pdserve.connector.io_thread import IOThread
from pdserve.connector.store import BlockStore
from pdserve.connector.store_connector import ConnectorConfig, StoreKVConnector


class RankKVConnector(StoreKVConnector):
    def __init__(self, store: BlockStore, codec: BlockCodec, config: ConnectorConfig,
                 link: RankKVLink, io: Optional[IOThread] = None):
        if not config.per_rank:
            raise ValueError("RankKVConnector is the per_rank mode: set per_rank")
        super().__init__(store, codec, config, io)
        self.link = link
        self._seqs = itertools.count()
        self._pending: list[Transfer] = []  # this step's saves, sent at end_step
        # (request id, kind, seq) in flight -> (save budget bytes reserved, start time)
        self._sent: dict[tuple[str, str, int], tuple[int, float]] = {}

    def register_kv_shards(self, shards: list[list[torch.Tensor]]) -> None:
        self.kv_caches = shards[0]  # every rank moves its own heads: no view of the others

    def update_state_after_alloc(self, request, block_ids, num_computed_tokens,
                                 num_external_tokens) -> None:
        bs = self.codec.block_size
        first, last = num_computed_tokens // bs, (num_computed_tokens + num_external_tokens) // bs
        self._store_from.setdefault(request.request_id, first)
        t = self._transfer(request.request_id, "load", request.block_hashes[first:last],
                           block_ids[first:last])
        self.link.send((t,))

    def _transfer(self, rid: str, kind: str, keys, block_ids, reserved: int = 0) -> Transfer:
        t = Transfer(rid, kind, tuple(BlockRef(k, b) for k, b in zip(keys, block_ids)),
                     next(self._seqs))
        self._sent[(rid, kind, t.seq)] = (reserved, time.perf_counter())
        return t

    def begin_step(self, batch) -> None:
        staged, reserved = self._blocks_to_save(batch)
        by_request: dict[str, list[tuple[bytes, int]]] = {}
        for rid, key, block_id in staged:
            by_request.setdefault(rid, []).append((key, block_id))
        per_block = reserved // len(staged) if staged else 0
        for rid, blocks in by_request.items():
            self._pending.append(self._transfer(rid, "save", [k for k, _ in blocks],
                                                [b for _, b in blocks],
                                                per_block * len(blocks)))

    def _start_backfill(self, rid: str, keys: list[bytes], block_ids: list[int]) -> None:
        """A producer's local hits, saved with the step (blocks the store has already
        answer EXISTS: stored)."""
        self._pending.append(self._transfer(rid, "save", keys, block_ids))

    def save_layer(self, layer_idx: int, kv_cache: torch.Tensor) -> None:
        pass  # each rank encodes its heads after the forward

    def end_step(self) -> None:
        pending, self._pending = tuple(self._pending), []
        if not pending:
            return
        with self._lock:
            for t in pending:
                self._save_started(t.request_id)
        self.link.send(pending)

    def get_finished(self) -> tuple[set[str], set[str]]:
        for f in self.link.poll():
            self._book(f)
        return super().get_finished()

    def _book(self, f: Finished) -> None:
        t = f.transfer
        reserved, t0 = self._sent.pop((t.request_id, t.kind, t.seq))
        nbytes = f.blocks * self.segments.nbytes
        if t.kind == "save":
            self.stats.blocks_saved += f.blocks
            self.stats.bytes_saved += nbytes
            self.stats.save_failures += len(t.blocks) - f.blocks
            self.stats.save_seconds += time.perf_counter() - t0
            with self._lock:
                self._saves_done([t.request_id])
                self._budget_used -= reserved
            return
        self.stats.blocks_loaded += f.blocks
        self.stats.bytes_loaded += nbytes
        self.stats.load_seconds += time.perf_counter() - t0
        with self._lock:
            if f.blocks == len(t.blocks):
                self._loaded.add(t.request_id)
            else:
                self.stats.load_failures += 1
                self._failed[t.request_id] = f.blocks * self.codec.block_size
