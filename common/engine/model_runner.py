"""Model runner: executes one `SchedulerOutput` as a single forward on this rank.

The chunks (decodes first, as the scheduler orders them) are flattened into T tokens with
per-token positions and cache slots, plus per-request block tables, all from the output itself:
the runner holds no scheduler or KV-manager state, so every tensor-parallel rank runs the same
step from the same value. Host-side index arrays are built with numpy (no per-token Python
objects on the prefill path). Rank 0 gets the logits of the sampled rows; sampling is the
engine's.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch

from pdserve.common.attention.backend import AttentionMetadata
from pdserve.common.engine.scheduler_output import SchedulerOutput
from pdserve.common.models.llama import LlamaForCausalLM

# layer_done(i, rank 0's cache of layer i): called on rank 0 once every tensor rank wrote layer
# i's K/V for the step (a collective ends each layer), so it may read their shared caches
LayerDone = Callable[[int, torch.Tensor], None]


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_caches: list[torch.Tensor],
                 block_size: int, device: str = "cpu"):
        self.model, self.kv_caches = model, kv_caches
        self.block_size = block_size
        self.device = device
        # host input buffers [capacity] reused by every step; grown (counted) only when a step
        # is longer than any before: warm-up reserves the scheduler's largest
        self._tokens = np.empty(0, dtype=np.int64)
        self._positions = np.empty(0, dtype=np.int64)
        self.num_buffer_allocs = 0

    def reserve(self, num_tokens: int) -> None:
        """Size the reused input buffers for steps of up to `num_tokens` tokens."""
        if num_tokens > len(self._tokens):
            self._tokens = np.empty(num_tokens, dtype=np.int64)
            self._positions = np.empty(num_tokens, dtype=np.int64)
            self.num_buffer_allocs += 1

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, layer_done: Optional[LayerDone] = None,
                hidden_in: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """Run `out` (non-empty). Returns logits [N, V] fp32 for the sampled chunks in order
        on the last pipeline stage's tensor rank 0 (an [0, V] tensor when none is sampled),
        None on its other ranks; a stage before the last returns its hidden states [T, H]
        for the next stage. `hidden_in` [T, H]: the previous stage's (every stage but the
        first). `layer_done(i, kv_cache)` runs after layer i wrote its K/V (the connector)."""
        input_ids, positions, meta = self._prepare(out)
        keep = self._sampled_rows(out, meta) if self.model.pp.is_last else None
        # [T, H] before the last stage; the sampled rows [N, H] on it
        hidden = self.model(input_ids, positions, self.kv_caches, meta, layer_done,
                            hidden_in, keep=keep)
        if not self.model.pp.is_last:
            return hidden
        logits = self.model.compute_logits(hidden)  # [N, V] on rank 0
        return None if logits is None else logits.float()

    @staticmethod
    def _sampled_rows(out: SchedulerOutput, meta: AttentionMetadata) -> Optional[torch.Tensor]:
        """The token rows whose logits are sampled, [N] (the last token of each sampled
        chunk); None for a decode step, whose every row is sampled."""
        if meta.num_decodes == len(out.chunks) and all(c.sample for c in out.chunks):
            return None
        ends = meta.query_start_loc[1:].long() - 1  # last token of each chunk
        rows = [i for i, c in enumerate(out.chunks) if c.sample]
        return ends[rows]

    def _prepare(self, out: SchedulerOutput):
        chunks = out.chunks
        if all(len(c.token_ids) == 1 for c in chunks):
            return self._prepare_decodes(chunks)
        return self._prepare_chunks(chunks)

    def _prepare_chunks(self, chunks):
        """Input ids [T], positions [T] and the attention metadata of any step."""
        q_lens = np.array([c.num_tokens for c in chunks], dtype=np.int64)
        starts = np.array([c.start for c in chunks], dtype=np.int64)
        seq_lens = starts + q_lens
        total = int(q_lens.sum())
        cu = np.zeros(len(chunks) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu[1:])
        width = max(len(c.block_ids) for c in chunks)
        block_tables = np.zeros((len(chunks), width), dtype=np.int32)
        self.reserve(total)
        tokens, positions = self._tokens[:total], self._positions[:total]  # used in this step only
        slots = np.empty(total, dtype=np.int64)
        for i, c in enumerate(chunks):
            s, e = cu[i], cu[i + 1]
            block_tables[i, :len(c.block_ids)] = c.block_ids
            pos = np.arange(starts[i], seq_lens[i])
            tokens[s:e] = c.token_ids
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

    def _prepare_decodes(self, chunks):
        """`_prepare` for a step of single-token chunks (every decode step), the same tensors
        from one numpy call per field: at batch 1 the general path's ~25 small numpy calls
        were a few percent of a ~4 ms step (each slow, its caches evicted by the weights a
        step streams)."""
        n, bs = len(chunks), self.block_size
        width = max(len(c.block_ids) for c in chunks)
        block_tables = np.zeros((n, width), dtype=np.int32)
        for i, c in enumerate(chunks):
            block_tables[i, :len(c.block_ids)] = c.block_ids
        self.reserve(n)
        tokens, pos = self._tokens[:n], self._positions[:n]  # used in this step only
        tokens[:] = [c.token_ids[0] for c in chunks]
        pos[:] = [c.start for c in chunks]
        slots = block_tables[np.arange(n), pos // bs].astype(np.int64) * bs + pos % bs
        seq_lens = (pos + 1).astype(np.int32)
        dev = self.device
        meta = AttentionMetadata(
            num_tokens=n,
            num_decodes=n,
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=dev),
            seq_lens=torch.from_numpy(seq_lens).to(dev),
            block_tables=torch.from_numpy(block_tables).to(dev),
            slot_mapping=torch.from_numpy(slots).to(dev),
            max_query_len=1,
            max_seq_len=int(seq_lens.max()),
            query_lens_cpu=[1] * n,
            seq_lens_cpu=seq_lens.tolist(),
        )
        return torch.from_numpy(tokens).to(dev), torch.from_numpy(pos).to(dev), meta
