"""Triton paged-attention backend: KV never leaves the paged cache (no dense gather).

Per forward: decodes (the first num_decodes requests) go to the paged decode kernel, split-KV
(flash-decoding) when a few long requests could not otherwise fill the GPU; the prefill / extend
requests after them go to one ragged extend launch. On the CPU the same kernels run in Triton's
interpreter (slow; for tests), see triton_kernels/_launch.py.
"""

from __future__ import annotations

import torch

from pdserve.common.attention.backend import AttentionBackend, AttentionMetadata
from pdserve.common.attention.triton_kernels import (decode_attention, extend_attention,
                                                     reshape_and_cache)


def choose_num_splits(num_decodes: int, num_kv_heads: int, max_seq_len: int, num_sms: int,
                      min_split_len: int = 256, max_splits: int = 32) -> int:
    """KV splits per decode request: enough programs for ~2 waves over the SMs, but no split
    shorter than min_split_len tokens (each split costs a partial write and a reduce read)."""
    programs = num_decodes * num_kv_heads
    by_occupancy = -(-2 * num_sms // max(programs, 1))  # ceil
    by_length = max_seq_len // min_split_len
    return max(1, min(by_occupancy, by_length, max_splits))


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self, min_split_len: int = 256, max_splits: int = 32,
                 num_splits: int | None = None):
        """num_splits: force this many decode splits (tests, benchmarks); None picks per step."""
        if min_split_len < 1 or max_splits < 1:
            raise ValueError(f"min_split_len and max_splits must be >= 1, got "
                             f"{min_split_len}, {max_splits}")
        if num_splits is not None and num_splits < 1:
            raise ValueError(f"num_splits must be >= 1 or None, got {num_splits}")
        self.min_split_len = min_split_len
        self.max_splits = max_splits
        self.num_splits = num_splits
        self._num_sms: dict[str, int] = {}  # per device; a property query is not free

    def _sms(self, device: torch.device) -> int:
        # the interpreter runs programs one after another: splitting only costs time there
        if device.type != "cuda":
            return 1
        key = str(device)
        if key not in self._num_sms:
            self._num_sms[key] = torch.cuda.get_device_properties(device).multi_processor_count
        return self._num_sms[key]

    def _decode_splits(self, meta: AttentionMetadata, num_kv_heads: int,
                       device: torch.device) -> int:
        if self.num_splits is not None:
            return self.num_splits
        max_len = max(meta.seq_lens_cpu[:meta.num_decodes])
        return choose_num_splits(meta.num_decodes, num_kv_heads, max_len, self._sms(device),
                                 self.min_split_len, self.max_splits)

    def write_kv(self, key, value, kv_cache, slot_mapping):
        reshape_and_cache(key, value, kv_cache, slot_mapping)

    def forward(self, query, key, value, kv_cache, meta, scale):
        out = torch.empty_like(query)  # [T, heads, head_dim]
        n_dec = meta.num_decodes
        if n_dec:
            splits = self._decode_splits(meta, kv_cache.shape[3], query.device)
            decode_attention(query[:n_dec], kv_cache, meta.block_tables[:n_dec],
                             meta.seq_lens[:n_dec], scale, num_splits=splits, out=out[:n_dec])
        if meta.num_reqs > n_dec:
            extend_attention(query, kv_cache, meta.block_tables, meta.query_start_loc,
                             meta.seq_lens, scale, meta.max_query_len, out, req_offset=n_dec)
        return out
