"""KV connector over a Mooncake-style block store (both halves of common's KVConnector).

Objects are whole blocks (every layer), keyed by the block's chained hash, so the store is also
a prefix cache shared by every instance: a block computed once is loadable anywhere.

Producer (prefill): before the forward, `begin_step` lists the blocks that become full in this
step and allocates one staging buffer for them (codec layout, header space included);
`save_layer` copies each layer's slice of those blocks into it right after the layer ran, so
the copy overlaps the forward; `end_step` hands the buffer to the I/O thread, which writes the
headers and puts the objects while the engine computes on. With layer segments
(ConnectorConfig.layer_segments > 1, connector/segments.py) a block is S objects, each a run of
layers: a segment's puts start as soon as its last layer is copied, while the later layers
compute, and `end_step` puts only the last segment (under the block's key, after the
others). A segment's objects of a step go to the store in one batched put, their headers
(MACs) written on the I/O thread's worker meanwhile (save_io.py; GMAC releases the GIL), so
the MACs overlap the sends and never stall the engine thread. The request's blocks stay
allocated (`request_finished` -> True) until its puts are done. A failed put only costs a
later reader a recomputation.

With pipeline stages (P > 1) the engine calls `stage_step` and `save_step` instead
(pipelined_save.py).

Consumer (decode): `get_num_new_matched_tokens` asks the store how many of the request's next
blocks exist (a prefix lookup; a caller's hint in request.kv_transfer.block_keys saves it).
The lookup runs on the I/O thread: the first call starts it and answers None ("ask again next
step"), so a slow or blackholed master never stalls the engine thread; the store client's
lookup deadline ends it, and a failed lookup answers 0 (recompute).
`update_state_after_alloc` starts fetching them into the allocated blocks. Each fetched block is
validated by the codec (its MAC checked on the I/O worker) before it is written to the
cache; the load stops at the first missing, unreadable, corrupted or late block, and reports
the blocks before it as loaded, so the engine recomputes from there.

Reuse (ConnectorConfig.reuse, on by default; docs/kv-reuse.md): a producer is a consumer too,
so a prefill instance loads the stored prefix of a prompt (a shared system prompt, a
conversation's history) through the same WAITING_FOR_KV path, validation and fallback ladder,
and computes only the rest; a consumer is a producer too, so the full blocks a decode
request computes (the answer, and a prompt tail it recomputed) are put under the same chained
keys, and the next turn of the conversation is a store hit on any instance.
Decode saves a block as soon as it becomes full, through the producer's path (staged before the
step, copied out layer by layer during it, put after it), not when the request finishes: a
chat client sends the next turn the moment the answer ends, and a finish-time save of the
whole answer was still in flight when that turn's lookup came (measured: turn 2 found only
turn 1's prompt), where now at most the block that filled in the answer's last step can be.
The copies are made during the forward, so a preemption or an eviction right after the step
cannot race them. Bounded by `save_budget_bytes` of encoded blocks in flight per instance
(the blocks of a step that do not fit are not saved, counted in `saves_over_budget`); a
request whose KVTransferParams say `store_output=False` saves nothing; a cancelled request
saves nothing more (what filled before the cancel may already be stored: it is valid KV).

The partial tail block is never stored: decode recomputes it (at most block_size - 1 tokens,
cheaper than a request-scoped object with its own lease, and it keeps every stored object
content-addressed and shareable).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Literal, Optional

import torch

from pdserve.common.engine.kv_connector import KVConnector
from pdserve.connector.codec import BlockCodec, BlockCodecError
from pdserve.connector.io_thread import IOThread
from pdserve.connector.layout import HeadShards
from pdserve.connector.pipelined_save import PipelinedSaves
from pdserve.connector.save_io import SaveIO
from pdserve.connector.segments import MAX_SEGMENTS, LayerSegments
from pdserve.connector.staging import Block, StagedStep, stage, staged_blocks
from pdserve.connector.store import BlockStore

log = logging.getLogger(__name__)
_MAX_LOOKUPS = 1024  # lookups in flight or answered but not yet taken
Role = Literal["producer", "consumer", "both"]


@dataclass(frozen=True)
class ConnectorConfig:
    role: Role = "both"
    lease_s: float = 30.0  # stored blocks are not evicted for this long
    load_timeout_s: float = 10.0  # a load taking longer fails (and is recomputed)
    max_inflight: int = 8  # parallel block reads of a load (puts are batched, save_io.py)
    reuse: bool = True  # prefill also loads, decode also saves the blocks it computes
    save_budget_bytes: int = 64 << 20  # decode's saves: encoded bytes in flight
    # objects per block, each a run of layers (connector/segments.py): > 1 puts a step's first
    # layers while its later layers compute; every engine sharing a store must agree
    layer_segments: int = 1
    # every tensor-parallel rank moves its own KV heads, one object per head
    # (rank_connector.py, docs/parallelism.md "Per-rank transfers"); every engine sharing a
    # store must agree (a whole-block reader of a head object fails its MAC and recomputes)
    per_rank: bool = False

    def __post_init__(self):
        if self.role not in ("producer", "consumer", "both"):
            raise ValueError(f"role must be producer, consumer or both, got {self.role!r}")
        for name in ("lease_s", "load_timeout_s"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {self.max_inflight}")
        if self.save_budget_bytes < 0:
            raise ValueError(f"save_budget_bytes must be >= 0, got {self.save_budget_bytes}")
        if not 1 <= self.layer_segments <= MAX_SEGMENTS:
            raise ValueError(f"layer_segments must be 1..{MAX_SEGMENTS}, got "
                             f"{self.layer_segments}")
        if not isinstance(self.per_rank, bool):
            raise ValueError(f"per_rank must be a bool, got {self.per_rank!r}")
        if self.per_rank and self.layer_segments != 1:  # objects x segments: not yet
            raise ValueError("per_rank and layer_segments > 1 exclude each other")


@dataclass
class ConnectorStats:
    blocks_saved: int = 0
    blocks_loaded: int = 0
    bytes_saved: int = 0
    bytes_loaded: int = 0
    save_failures: int = 0
    saves_over_budget: int = 0  # finish-time saves cut short by save_budget_bytes
    load_failures: int = 0  # loads that stopped early (miss, corrupt, timeout, store down)
    lookup_failures: int = 0
    save_seconds: float = 0.0
    load_seconds: float = 0.0
    failure_reasons: dict = field(default_factory=dict)


class StoreKVConnector(PipelinedSaves, SaveIO, KVConnector):
    def __init__(self, store: BlockStore, codec: BlockCodec, config: ConnectorConfig,
                 io: Optional[IOThread] = None):
        self.store, self.codec, self.config = store, codec, config
        self.segments = LayerSegments(codec, config.layer_segments)
        self.io = io or IOThread()
        self.stats = ConnectorStats()
        self.kv_caches: list[torch.Tensor] = []
        self.heads: Optional[HeadShards] = None  # every rank's heads (layout.py)
        self._lock = threading.Lock()  # the three result sets, _saving, _budget_used
        self._saved: set[str] = set()
        self._loaded: set[str] = set()
        self._failed: dict[str, int] = {}
        self._saving: dict[str, int] = {}  # request id -> save batches in flight
        self._started: set[str] = set()  # producer: requests whose first chunk ran
        self._store_from: dict[str, int] = {}  # request id -> first block it loaded
        self._budget_used = 0  # decode's save bytes in flight (under _lock)
        self._freed: set[str] = set()  # preempted while a backfill was in flight (under _lock)
        self._step: Optional[StagedStep] = None
        # request id -> (num_computed_tokens it was asked for, the lookup's future)
        self._lookups: dict[str, tuple[int, concurrent.futures.Future]] = {}

    @property
    def produces(self) -> bool:
        return self.config.role in ("producer", "both")

    @property
    def consumes(self) -> bool:
        return self.config.role in ("consumer", "both") or self.config.reuse

    @property
    def saves_output(self) -> bool:
        """A consumer that stores the blocks it computes (decode with reuse)."""
        return self.config.role == "consumer" and self.config.reuse

    def _stages(self, request) -> bool:
        """Whether the blocks this request fills in a step are staged and put."""
        return self.produces or self._may_save(request)

    # -- scheduler side --------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> Optional[int]:
        """Tokens loadable past num_computed_tokens; None while the store lookup runs."""
        if not self.consumes:
            return 0
        bs = self.codec.block_size
        keys = request.block_hashes[num_computed_tokens // bs:]
        if not keys:
            return 0
        hint = request.kv_transfer.block_keys
        if hint:
            start = num_computed_tokens // bs
            n = 0
            while start + n < len(hint) and n < len(keys) and hint[start + n] == keys[n]:
                n += 1
            return n * bs
        return self._lookup(request.request_id, num_computed_tokens, keys)

    def _lookup(self, rid: str, num_computed_tokens: int, keys) -> Optional[int]:
        pending = self._lookups.get(rid)
        if pending is None or pending[0] != num_computed_tokens:
            if pending is not None:
                pending[1].cancel()
            elif len(self._lookups) >= _MAX_LOOKUPS:  # drop answers nobody came back for
                self._lookups = {r: p for r, p in self._lookups.items() if not p[1].done()}
            self._lookups[rid] = (num_computed_tokens,
                                  self.io.submit(self.store.prefix_lookup(list(keys))))
            return None
        if not pending[1].done():
            return None
        del self._lookups[rid]
        try:
            n = pending[1].result()
        except BaseException as exc:  # store unreachable or too slow: recompute
            self.stats.lookup_failures += 1
            self._note_failure(type(exc).__name__)
            return 0
        return min(max(int(n), 0), len(keys)) * self.codec.block_size

    def update_state_after_alloc(self, request, block_ids, num_computed_tokens,
                                 num_external_tokens) -> None:
        bs = self.codec.block_size
        first, last = num_computed_tokens // bs, (num_computed_tokens + num_external_tokens) // bs
        keys = list(request.block_hashes[first:last])
        self._store_from.setdefault(request.request_id, first)
        self.io.submit(self._load(request.request_id, keys, list(block_ids[first:last])))

    def request_finished(self, request, block_ids) -> bool:
        rid = request.request_id
        self._started.discard(rid)
        self._store_from.pop(rid, None)
        pending = self._lookups.pop(rid, None)
        if pending is not None:
            pending[1].cancel()
        with self._lock:
            return self._saving.get(rid, 0) > 0

    def _may_save(self, request) -> bool:
        return (self.saves_output and self.config.save_budget_bytes > 0
                and request.kv_transfer.store_output)

    def request_preempted(self, request, block_ids) -> None:
        """Nothing to copy: every full block a request computed here was copied out in the
        step that filled it. A backfill of its local hits still in flight must not read the
        blocks once they are freed (right after this): it reads them under _lock, and skips
        them from now on."""
        with self._lock:
            if self._saving.get(request.request_id):
                self._freed.add(request.request_id)

    # -- worker side -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self.register_kv_shards([kv_caches])

    def register_kv_shards(self, shards: list[list[torch.Tensor]]) -> None:
        self.kv_caches, self.heads = shards[0], HeadShards(shards)

    def begin_step(self, batch) -> None:
        self._step = self._stage(batch)

    def _stage(self, batch) -> Optional[StagedStep]:
        """Staging for the blocks that become full in this step (None: none)."""
        staged, reserved = self._blocks_to_save(batch)
        if not staged:
            return None
        views, bufs = stage(self.segments, len(staged))
        ids = torch.tensor([b for _, _, b in staged], dtype=torch.long)
        return StagedStep(staged, ids, views, bufs, reserved=reserved)

    def _blocks_to_save(self, batch) -> tuple[list[tuple[str, bytes, int]], int]:
        """(request id, key, block id) of the blocks that become full in this step, and the
        save budget bytes reserved for them; starts the backfill of a request's local
        prefix-cache hits on its first chunk. Decode's blocks take from save_budget_bytes:
        those of a step that do not fit are not saved."""
        bs = self.codec.block_size
        staged = []  # (request id, key, block id)
        for req, n, block_ids in batch:
            if not self._stages(req):
                continue
            c = req.num_computed_tokens
            if self.produces and req.request_id not in self._started:
                # its first chunk: back its local hits up (decode saves only what it computes)
                self._started.add(req.request_id)
                local = min(c // bs, self._store_from.get(req.request_id, c // bs))
                if local:  # (blocks loaded from the store are there already)
                    self._start_backfill(req.request_id, req.block_hashes[:local],
                                         block_ids[:local])
            for i in range(c // bs, (c + n) // bs):
                staged.append((req.request_id, req.block_hashes[i], block_ids[i]))
        if staged and not self.produces:
            return self._reserve(staged)
        return staged, 0

    def _reserve(self, staged: list) -> tuple[list, int]:
        """The leading staged blocks that fit in what is left of save_budget_bytes, and the
        bytes reserved for them (given back when their puts are done)."""
        size = self.segments.nbytes
        with self._lock:
            room = max((self.config.save_budget_bytes - self._budget_used) // size, 0)
            if room < len(staged):
                self.stats.saves_over_budget += 1
                staged = staged[:room]
            self._budget_used += len(staged) * size
        return staged, len(staged) * size

    def _start_backfill(self, rid: str, keys: list[bytes], block_ids: list[int]) -> None:
        with self._lock:
            self._save_started(rid)
        self.io.submit(self._backfill(rid, list(keys), list(block_ids)))

    def _copy_layer(self, views: list[torch.Tensor], layer: int, ids: torch.Tensor) -> None:
        s = self.segments.of_layer(layer)
        local = layer - self.segments.bounds[s]
        self.heads.copy_layer_into(views[s][:, local], layer, ids)  # [n, 2, bs, kvh, d]

    def save_layer(self, layer_idx: int, kv_cache: torch.Tensor) -> None:
        """Copy this layer of the step's full blocks out; once a segment's last layer is in,
        start its puts (but the last segment's: end_step) while the next layers compute."""
        step = self._step
        if step is None:
            return
        self._copy_layer(step.views, layer_idx, step.ids)
        s = self.segments.ends_at(layer_idx)
        if s is not None and s < self.segments.count - 1:
            keys = [self.segments.key(key, s) for _, key, _ in step.staged]
            whole, n = memoryview(step.bufs[s]), self.segments.codecs[s].nbytes
            objs = [(k, whole[j * n:(j + 1) * n]) for j, k in enumerate(keys)]
            step.earlier.append(self.io.submit(self._put_objects(s, objs)))

    def end_step(self) -> None:
        step, self._step = self._step, None
        if step is None:
            return
        with self._lock:
            for rid, _, _ in step.staged:
                self._save_started(rid)
        self._submit_save(step, [rid for rid, _, _ in step.staged], step.earlier,
                          step.reserved)

    def _save_started(self, rid: str) -> None:
        """(Under _lock.) One more save in flight for rid. A 'saved' already reported by an
        earlier batch (a backfill that finished during this step's forward) is withdrawn: rid
        is saved only when its last batch is."""
        self._saving[rid] = self._saving.get(rid, 0) + 1
        self._saved.discard(rid)

    def get_finished(self) -> tuple[set[str], set[str]]:
        with self._lock:
            saved, loaded = self._saved, self._loaded
            self._saved, self._loaded = set(), set()
        return saved, loaded

    def get_failed_loads(self) -> dict[str, int]:
        with self._lock:
            failed, self._failed = self._failed, {}
        return failed

    def finish_waits_for_save(self) -> bool:
        return self.config.role == "producer"

    def transfer_stats(self):
        return self.stats

    def close(self) -> None:
        self.io.close()

    # -- I/O (runs on the I/O thread) ------------------------------------------------------
    async def _backfill(self, rid: str, keys: list[bytes], block_ids: list[int]) -> None:
        """Store the blocks the store lacks among a producer's local prefix-cache hits
        (evicted there or never saved), read straight from the cache: the scheduler holds
        them until this is done, unless the request is preempted (request_preempted)."""
        try:
            have = await self.store.prefix_lookup(keys)
        except Exception as exc:  # noqa: BLE001 - store unreachable: nothing to backfill
            self._note_failure("backfill:" + type(exc).__name__)
            have = len(keys)
        blocks = []
        try:
            with self._lock:  # (a preemption frees the blocks only after taking _lock)
                if rid not in self._freed:
                    for key, block_id in zip(keys[have:], block_ids[have:]):
                        blocks.append((key, self._encode_payloads(
                            self.heads.read_block(block_id))))
        except Exception as exc:  # noqa: BLE001 - save what was encoded; never leak
            self._note_failure("backfill:" + type(exc).__name__)
        await self._put_blocks(blocks, [rid])

    def _encode_payloads(self, block: torch.Tensor) -> list[memoryview]:
        """block [L, 2, bs, kvh, d] -> one encoded object per segment, headers left blank."""
        b = self.segments.bounds
        return [c.write_payload(block[b[s]:b[s + 1]], bytearray(c.nbytes))
                for s, c in enumerate(self.segments.codecs)]

    async def _load(self, rid: str, keys: list[bytes], block_ids: list[int]) -> None:
        t0, seg = time.perf_counter(), self.segments
        skeys = [seg.key(k, s) for k in keys for s in range(seg.count)]
        views, bufs = stage(seg, len(keys))  # one buffer per segment: installed per layer
        objs = staged_blocks(seg, keys, bufs)
        fetch = self.store.get_many_into(skeys, [v for _, obj in objs for v in obj],
                                         self.config.max_inflight)
        try:
            results = await asyncio.wait_for(fetch, self.config.load_timeout_s)
        except Exception as exc:  # noqa: BLE001 - timeout or an unreachable store: recompute
            results = [exc] * len(skeys)
        # The MACs are checked on the I/O worker: the loop keeps moving other transfers.
        loaded, why = await self.io.offload(self._verify, objs, results)
        if loaded:
            ids = torch.tensor(block_ids[:loaded], dtype=torch.long)
            for layer in range(seg.codec.num_layers):
                s = seg.of_layer(layer)
                self.heads.write_layer_from(views[s][:loaded, layer - seg.bounds[s]], layer,
                                            ids)  # [loaded, 2, bs, kvh, d]
        if why is not None:
            self._note_failure(why)
        self.stats.blocks_loaded += loaded
        self.stats.bytes_loaded += loaded * seg.nbytes
        self.stats.load_seconds += time.perf_counter() - t0
        with self._lock:
            if loaded == len(keys):
                self._loaded.add(rid)
            else:
                self.stats.load_failures += 1
                self._failed[rid] = loaded * self.codec.block_size

    def _verify(self, objs: list[Block], results) -> tuple[int, Optional[str]]:
        """How many leading fetched blocks have every segment decode (MAC checked), and why
        the one after them did not (None when all did). results: block by block, segment by
        segment, as objs."""
        seg = self.segments
        for j, (key, views) in enumerate(objs):
            for s, (codec, view) in enumerate(zip(seg.codecs, views)):
                got = results[j * seg.count + s]
                if isinstance(got, BaseException) or got is None:
                    return j, "miss" if got is None else type(got).__name__
                try:
                    codec.decode(seg.key(key, s), view[:got])
                except BlockCodecError as exc:
                    log.warning("%s", exc)
                    return j, "codec"
        return len(objs), None

    def _note_failure(self, reason: str) -> None:
        self.stats.failure_reasons[reason] = self.stats.failure_reasons.get(reason, 0) + 1
