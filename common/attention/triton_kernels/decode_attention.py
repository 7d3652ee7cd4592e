"""Paged decode attention: one query token per request, grouped-query, KV read via block table.

Grid: (requests, kv_heads, splits). A program takes all the query heads that share one KV head
(padded to 16 rows so `tl.dot` runs on tensor cores), so each K/V tile is read from memory once
per group, and walks its range of the context in BLOCK_N-token tiles with an online softmax.
Each row of a tile finds its own page through the block table, so BLOCK_N need not equal the
page size.

With one split the program normalises and writes the output. With several (flash-decoding, for
long contexts where requests x kv_heads programs cannot fill the GPU) each split writes a
normalised partial output and its log-sum-exp, and `_reduce_kernel` merges the splits.
"""

from __future__ import annotations

import torch
import triton.language as tl

from pdserve.common.attention.triton_kernels._launch import (
    MAX_COMBINE, SUM_COMBINE, check_block_n, device_kernel, pow2)

LOG2E = 1.4426950408889634  # softmax runs in base 2: exp(x) == exp2(x * log2(e))


@device_kernel
def _decode_kernel(
    q_ptr,  # [R, heads, head_dim]
    k_cache_ptr, v_cache_ptr,  # [num_blocks, page_size, kv_heads, head_dim]
    block_tables_ptr,  # [R, max_blocks] int32
    seq_lens_ptr,  # [R] int32
    out_ptr,  # [R, heads, head_dim] (one split) or [R, heads, splits, head_dim]
    lse_ptr,  # [R, heads, splits] fp32, base-2 log-sum-exp (split only)
    qk_scale,  # softmax scale * log2(e)
    stride_qr, stride_qh,
    stride_cb, stride_cs, stride_ch,
    stride_bt,
    stride_or, stride_oh, stride_os,
    stride_lr, stride_lh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_SPLIT: tl.constexpr, PRECISION: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    seq_len = tl.load(seq_lens_ptr + req)
    # splits cover whole BLOCK_N tiles so that only the last tile of the context is ragged
    per_split = (seq_len + num_splits - 1) // num_splits
    split_len = (per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + req * stride_qr + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_G, BLOCK_D], 0.0, tl.float32)
    bt_row = block_tables_ptr + req.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        blk = tl.load(bt_row + n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_off = (blk * stride_cb + (n % PAGE_SIZE) * stride_cs + kv_head * stride_ch)[:, None] \
            + d[None, :]  # [BLOCK_N, BLOCK_D]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)  # half KV widened
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, MAX_COMBINE))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, SUM_COMBINE)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    # an empty split (start >= seq_len) leaves l_i == 0: write zeros and lse = -inf
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    o_ptrs = out_ptr + req * stride_or + heads[:, None] * stride_oh + split * stride_os + d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    if IS_SPLIT:
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(lse_ptr + req * stride_lr + heads * stride_lh + split, lse, mask=g_mask)


@device_kernel
def _reduce_kernel(
    mid_ptr,  # [R, heads, splits, head_dim] fp32, each split normalised on its own
    lse_ptr,  # [R, heads, splits] fp32, base 2
    out_ptr,  # [R, heads, head_dim]
    stride_mr, stride_mh, stride_ms,
    stride_lr, stride_lh,
    stride_or, stride_oh,
    NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid (requests, heads): out = sum_s w_s * mid_s with w_s = 2^lse_s / sum 2^lse."""
    req = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < NUM_SPLITS
    lse = tl.load(lse_ptr + req * stride_lr + head * stride_lh + s, mask=s_mask,
                  other=float("-inf"))  # [BLOCK_S]
    # split 0 is never empty (seq_len >= 1), so the max is finite
    w = tl.exp2(lse - tl.reduce(lse, 0, MAX_COMBINE))
    w = w / tl.reduce(w, 0, SUM_COMBINE)
    mid = tl.load(mid_ptr + req * stride_mr + head * stride_mh + s[:, None] * stride_ms
                  + d[None, :], mask=s_mask[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    out = tl.reduce(mid * w[:, None], 0, SUM_COMBINE)  # [BLOCK_D]
    tl.store(out_ptr + req * stride_or + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 runs as true fp32 ("ieee"): TF32 would break token-for-token parity with the CPU."""
    return "ieee" if dtype == torch.float32 else "tf32"


def decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, num_splits: int = 1,
                     out: torch.Tensor | None = None, block_n: int = 32) -> torch.Tensor:
    """query [R, heads, head_dim], one token per request at position seq_lens[r] - 1;
    kv_cache [2, num_blocks, page_size, kv_heads, head_dim]; block_tables [R, max_blocks] int32;
    seq_lens [R] int32. Returns out [R, heads, head_dim]."""
    num_reqs, num_heads, head_dim = query.shape
    num_kv_heads, page_size = kv_cache.shape[3], kv_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"heads ({num_heads}) must be a multiple of kv_heads ({num_kv_heads})")
    check_block_n(block_n)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if query.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("decode_attention needs head_dim contiguous in query and cache")
    out = torch.empty_like(query) if out is None else out
    if num_reqs == 0:
        return out
    group = num_heads // num_kv_heads
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    # tl.dot needs every block dim >= 16: pad the group's rows and head_dim up to it
    consts = dict(GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size, BLOCK_G=pow2(group, 16),
                  BLOCK_D=pow2(head_dim, 16), BLOCK_N=block_n,
                  PRECISION=dot_precision(query.dtype))
    common = (query, k_cache, v_cache, block_tables, seq_lens)
    strides = (query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1),
               k_cache.stride(2), block_tables.stride(0))
    kernel = _decode_kernel.on(query.device)
    if num_splits == 1:
        kernel[(num_reqs, num_kv_heads, 1)](
            *common, out, out, scale * LOG2E, *strides,
            out.stride(0), out.stride(1), 0, 0, 0, IS_SPLIT=False, **consts)
        return out
    mid = torch.empty(num_reqs, num_heads, num_splits, head_dim, dtype=torch.float32,
                      device=query.device)
    lse = torch.empty(num_reqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
    kernel[(num_reqs, num_kv_heads, num_splits)](
        *common, mid, lse, scale * LOG2E, *strides,
        mid.stride(0), mid.stride(1), mid.stride(2), lse.stride(0), lse.stride(1),
        IS_SPLIT=True, **consts)
    _reduce_kernel.on(query.device)[(num_reqs, num_heads)](
        mid, lse, out, mid.stride(0), mid.stride(1), mid.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1), NUM_SPLITS=num_splits, HEAD_DIM=head_dim,
        BLOCK_S=pow2(num_splits), BLOCK_D=pow2(head_dim, 16))
    return out
