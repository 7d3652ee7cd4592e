"""Model runner: packs one scheduler step into a single forward and samples.

Decode requests (one new token) go first, then prefill / extend chunks, all flattened into T
tokens with per-token positions and cache slots, plus per-request block tables. Only requests
whose chunk reaches their last token are sampled. Host-side index arrays are built with numpy
(no per-token Python objects on the prefill path).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from pdserve.common.attention.backend import AttentionMetadata
from pdserve.common.engine.kv_connector import KVConnector
from pdserve.common.engine.request import Request
from pdserve.common.engine.sampler import Sampler, SamplerOutput
from pdserve.common.kv.kv_cache_manager import KVCacheManager
from pdserve.common.models.llama import LlamaForCausalLM


@dataclass
class StepResult:
    sampled: list[Request]  # requests that got a new token, in sampler order
    output: SamplerOutput


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_caches: list[torch.Tensor],
                 kv: KVCacheManager, sampler: Sampler, device: str = "cpu",
                 connector: Optional[KVConnector] = None):
        self.model, self.kv_caches, self.kv, self.sampler = model, kv_caches, kv, sampler
        self.connector = connector
        self.block_size = kv.block_size
        self.device = device

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Request, int]]) -> StepResult:
        batch = sorted(scheduled, key=lambda rn: rn[1] != 1)  # decodes first, stable
        input_ids, positions, meta = self._prepare(batch)
        hook = None
        if self.connector is not None:
            for r, _ in batch:
                self.kv.update_block_hashes(r)
            self.connector.begin_step([(r, n, self.kv.block_ids(r.request_id))
                                       for r, n in batch])
            hook = self.connector.save_layer
        hidden = self.model(input_ids, positions, self.kv_caches, meta, hook)  # [T, H]
        if self.connector is not None:
            self.connector.end_step()
        ends = meta.query_start_loc[1:].long() - 1  # last token of each request
        sampled = [i for i, (r, n) in enumerate(batch) if r.num_computed_tokens + n == r.num_tokens]
        reqs = [batch[i][0] for i in sampled]
        if not reqs:
            return StepResult([], SamplerOutput([], None))
        logits = self.model.compute_logits(hidden[ends[sampled]]).float()  # [N, V]
        return StepResult(reqs, self.sampler(logits, reqs))

    def _prepare(self, batch: list[tuple[Request, int]]):
        q_lens = np.array([n for _, n in batch], dtype=np.int64)
        starts = np.array([r.num_computed_tokens for r, _ in batch], dtype=np.int64)
        seq_lens = starts + q_lens
        total = int(q_lens.sum())
        cu = np.zeros(len(batch) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu[1:])
        tables = [self.kv.block_ids(r.request_id) for r, _ in batch]
        width = max(len(t) for t in tables)
        block_tables = np.zeros((len(batch), width), dtype=np.int32)
        tokens = np.empty(total, dtype=np.int64)
        positions = np.empty(total, dtype=np.int64)
        slots = np.empty(total, dtype=np.int64)
        for i, (r, n) in enumerate(batch):
            s, e = cu[i], cu[i + 1]
            block_tables[i, :len(tables[i])] = tables[i]
            pos = np.arange(starts[i], seq_lens[i])
            tokens[s:e] = r.all_token_ids[starts[i]:seq_lens[i]]
            positions[s:e] = pos
            slots[s:e] = block_tables[i, pos // self.block_size] * self.block_size + pos % self.block_size
        dev = self.device
        meta = AttentionMetadata(
            num_tokens=total,
            num_decodes=int((q_lens == 1).sum()),
            query_start_loc=torch.from_numpy(cu.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            block_tables=torch.from_numpy(block_tables).to(dev),
            slot_mapping=torch.from_numpy(slots).to(dev),
            max_query_len=int(q_lens.max()),
            max_seq_len=int(seq_lens.max()),
            query_lens_cpu=q_lens.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
        )
        return torch.from_numpy(tokens).to(dev), torch.from_numpy(positions).to(dev), meta
