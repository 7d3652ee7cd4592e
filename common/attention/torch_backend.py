"""Torch reference attention backend (the CPU path, and the reference the Triton kernels are
tested against).

The cache may hold fp32, bf16 or fp16 (`--kv-cache-dtype`); queries and all arithmetic stay in
the activations' dtype, K/V widened as they are read (in registers in the native kernels).

Decodes are batched. On the CPU with fp32 queries they go to the native paged kernel
(cpu_native.py: reads K/V through the block table, no copy) when it built; otherwise (other
devices or dtypes, PDSERVE_NO_NATIVE=1, no compiler) their context is gathered from the paged
cache into a padded dense tensor and attended with one SDPA call (key-padding mask): `_decode`,
also the reference the native kernel is tested against.

Prefill / extend requests go to the native paged prefill kernel (all chunks in one call, K/V
read through the block table) where it built with AVX2 or wider; otherwise one at a time: a
prompt chunk with no cached prefix attends to its own keys (causal SDPA, no gather); a chunk with
a prefix gathers its blocks and uses an offset causal mask (`_prefill_one`, also the reference the
native kernel is tested against).

`fused_forward` does a layer's rotary, KV write and attention in one native call
(`attention_step`) when the kernels apply.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.common.attention.backend import AttentionBackend, AttentionMetadata
from pdserve.common.attention.cpu_native import load_cpu_kernels


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int):
    """Dense K, V [kv_heads, seq_len, head_dim] of one request from the paged cache."""
    block_size = kv_cache.shape[2]
    n_blocks = (seq_len + block_size - 1) // block_size
    blocks = kv_cache[:, block_table[:n_blocks].long()]  # [2, n, bs, kvh, d]
    kv = blocks.flatten(1, 2)[:, :seq_len]  # [2, L, kvh, d]
    return kv[0].transpose(0, 1), kv[1].transpose(0, 1)


KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the native kernels read


def _decode(query, kv_cache, meta: AttentionMetadata, scale):
    """query [D, heads, d] -> [D, heads, d] for the first D=num_decodes requests."""
    n = meta.num_decodes
    block_size = kv_cache.shape[2]
    max_len = max(meta.seq_lens_cpu[:n])
    n_blocks = (max_len + block_size - 1) // block_size
    tables = meta.block_tables[:n, :n_blocks].long()  # [D, nb]
    kv = kv_cache[:, tables]  # [2, D, nb, bs, kvh, d]
    kv = kv.flatten(2, 3)[:, :, :max_len]  # [2, D, L, kvh, d]
    k = kv[0].transpose(1, 2).to(query.dtype)  # [D, kvh, L, d]; a half cache widened
    v = kv[1].transpose(1, 2).to(query.dtype)
    seq_lens = meta.seq_lens[:n].long()
    mask = torch.arange(max_len, device=query.device)[None, :] < seq_lens[:, None]  # [D, L]
    q = query.unsqueeze(2)  # [D, heads, 1, d]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :],
                                         scale=scale, enable_gqa=True)
    return out.squeeze(2)


def _prefill_one(q, k_new, v_new, kv_cache, block_table, seq_len, scale):
    """q [Q, heads, d] of a chunk whose last token sits at position seq_len - 1."""
    q_len = q.shape[0]
    # 4-D [1, heads, Q, d]: the CPU flash-attention kernel only takes 4-D inputs; 3-D ones
    # fall back to the math path, which materializes the scores
    qh = q.transpose(0, 1).unsqueeze(0)
    if q_len == seq_len:  # no cached prefix: attend to the chunk itself
        # rounded to the cache's dtype first: the same values a later step reads back
        k, v = (t.transpose(0, 1).unsqueeze(0).to(kv_cache.dtype).to(q.dtype)
                for t in (k_new, v_new))
        out = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale,
                                             enable_gqa=True)
    else:
        k, v = (t.unsqueeze(0).to(q.dtype) for t in gather_kv(kv_cache, block_table, seq_len))
        # query i sits at position seq_len - q_len + i and sees keys 0 .. that position
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # [Q, L]
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale,
                                             enable_gqa=True)
    return out[0].transpose(0, 1)


def prefill_reference(query, kv_cache, block_tables, seq_lens, query_start_loc, first_req,
                      scale):
    """`_prefill_one` (SDPA) for each of requests first_req .. R - 1 in turn, their new K/V read
    back from the cache: the torch reference of the native paged prefill, and the per-request
    path it replaced. Returns [T, heads, d]; rows before first_req's chunk are zero."""
    out = torch.zeros_like(query)
    bs = kv_cache.shape[2]
    flat = kv_cache.view(2, -1, kv_cache.shape[3], kv_cache.shape[4])  # [2, slots, kvh, d]
    loc, lens = query_start_loc.tolist(), seq_lens.tolist()
    for r in range(first_req, len(lens)):
        s, e, ctx = loc[r], loc[r + 1], lens[r]
        slots = block_tables[r].long()[:, None] * bs + torch.arange(bs, device=kv_cache.device)
        slots = slots.flatten()[ctx - (e - s):ctx]  # the chunk's tokens: the context's last
        out[s:e] = _prefill_one(query[s:e], flat[0][slots], flat[1][slots], kv_cache,
                                block_tables[r], ctx, scale)
    return out


def _native_module(query, kv_cache, meta: AttentionMetadata):
    """The native kernels when they apply to these tensors, else None (use the torch paths)."""
    if (query.device.type != "cpu" or kv_cache.device.type != "cpu"
            or query.dtype != torch.float32 or kv_cache.dtype not in KV_DTYPES
            or not kv_cache.is_contiguous() or meta.block_tables.dtype != torch.int32
            or meta.seq_lens.dtype != torch.int32):
        return None
    return load_cpu_kernels()  # built once per machine, then cached per process


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def write_kv(self, key, value, kv_cache, slot_mapping):
        flat = kv_cache.view(2, -1, kv_cache.shape[3], kv_cache.shape[4])  # [2, slots, kvh, d]
        flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))  # rounds to a half cache
        flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))

    def fused_forward(self, qkv, cos, sin, kv_cache, meta, scale, num_heads):
        """The native fused step (attention_step) when the kernels apply to this batch."""
        if meta.num_tokens == 0:
            return None
        native = _native_module(qkv, kv_cache, meta)
        if (native is None or meta.slot_mapping.dtype != torch.int64
                or meta.query_start_loc.dtype != torch.int32
                or (meta.num_decodes < meta.num_reqs and not native.fast_prefill)):
            return None
        t = meta.num_tokens
        return native.attention_step(qkv, cos.reshape(t, -1), sin.reshape(t, -1), kv_cache,
                                     meta.slot_mapping, meta.block_tables, meta.seq_lens,
                                     meta.query_start_loc, meta.num_decodes, float(scale),
                                     num_heads)

    def fused_step(self, meta, kv_cache, cos, sin):
        """attention_step with this step's metadata bound (checked once, not per layer)."""
        if meta.num_tokens == 0:
            return None
        native = _native_module(cos, kv_cache, meta)  # cos: fp32 CPU like the fp32 qkv
        if (native is None or meta.slot_mapping.dtype != torch.int64
                or meta.query_start_loc.dtype != torch.int32
                or (meta.num_decodes < meta.num_reqs and not native.fast_prefill)):
            return None
        t = meta.num_tokens
        cos, sin = cos.reshape(t, -1), sin.reshape(t, -1)
        args = (meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                meta.num_decodes)

        def attend(qkv, cache, scale, num_heads):
            return native.attention_step(qkv, cos, sin, cache, *args, float(scale), num_heads)
        return attend

    def forward(self, query, key, value, kv_cache, meta, scale):
        out = torch.empty_like(query)
        n_dec = meta.num_decodes
        native = _native_module(query, kv_cache, meta)
        if n_dec:
            dec_out = out[:n_dec]
            if native is not None and dec_out.is_contiguous():
                native.paged_decode(query[:n_dec], kv_cache, meta.block_tables[:n_dec],
                                    meta.seq_lens[:n_dec], float(scale), dec_out)
            else:
                dec_out[:] = _decode(query[:n_dec], kv_cache, meta, scale)
        if meta.num_reqs == n_dec:
            return out
        if (native is not None and native.fast_prefill and out.is_contiguous()
                and meta.query_start_loc.dtype == torch.int32):
            native.paged_prefill(query, kv_cache, meta.block_tables, meta.seq_lens,
                                 meta.query_start_loc, n_dec, float(scale), out)
            return out
        loc = meta.query_start_loc.tolist()
        for i in range(n_dec, meta.num_reqs):
            s, e = loc[i], loc[i + 1]
            out[s:e] = _prefill_one(query[s:e], key[s:e], value[s:e], kv_cache,
                                    meta.block_tables[i], meta.seq_lens_cpu[i], scale)
        return out
