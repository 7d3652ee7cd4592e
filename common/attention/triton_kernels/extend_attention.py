"""Paged prefill / extend attention: each request brings a chunk of query tokens that attends to
its cached prefix and causally to the chunk itself; ragged chunk lengths share one launch.

By the time this runs, write_kv has put the chunk's own K/V into the cache too, so every key is
read through the block table: one code path for prefix and chunk.

Grid: (query tiles, requests, kv_heads). A program takes BLOCK_Q query tokens x all the query
heads of one KV head, flattened into BLOCK_M = BLOCK_Q * BLOCK_G rows (row = token * BLOCK_G +
head-in-group), so each K/V tile is read once per group. It walks keys 0 .. (last position of
its tile) in BLOCK_N tiles with an online softmax; the causal mask compares positions. Tiles past
a request's chunk length run zero iterations and store nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.common.attention.triton_kernels._launch import (
    MAX_COMBINE, SUM_COMBINE, check_block_n, device_kernel, pow2)
from pdserve.common.attention.triton_kernels.decode_attention import LOG2E, dot_precision


@device_kernel
def _extend_kernel(
    q_ptr,  # [T, heads, head_dim]
    k_cache_ptr, v_cache_ptr,  # [num_blocks, page_size, kv_heads, head_dim]
    block_tables_ptr,  # [R, max_blocks] int32
    query_start_loc_ptr,  # [R+1] int32
    seq_lens_ptr,  # [R] int32
    out_ptr,  # [T, heads, head_dim]
    qk_scale,  # softmax scale * log2(e)
    req_offset,  # first request handled (the decodes before it are done elsewhere)
    stride_qt, stride_qh,
    stride_cb, stride_cs, stride_ch,
    stride_bt,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    req = tl.program_id(1) + req_offset
    kv_head = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    prefix = seq_len - q_len  # tokens cached before this chunk

    rows = tl.arange(0, BLOCK_Q * BLOCK_G)
    tok = tile * BLOCK_Q + rows // BLOCK_G  # index in the chunk
    g = rows % BLOCK_G
    heads = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    row_mask = (tok < q_len) & (g < GROUP)
    q_rows = (q_start + tok).to(tl.int64) * stride_qt + heads * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=row_mask[:, None] & d_mask[None, :],
                other=0.0)  # [BLOCK_M, BLOCK_D]
    q_pos = prefix + tok  # absolute position of each row's token

    # keys needed by this tile: 0 .. position of its last valid token (none if tile is empty)
    last_tok = tl.minimum((tile + 1) * BLOCK_Q, q_len)
    hi = tl.where(tile * BLOCK_Q < q_len, prefix + last_tok, 0)

    m_i = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_Q * BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_Q * BLOCK_G, BLOCK_D], 0.0, tl.float32)
    bt_row = block_tables_ptr + req.to(tl.int64) * stride_bt
    for n0 in range(0, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < hi
        blk = tl.load(bt_row + n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_off = (blk * stride_cb + (n % PAGE_SIZE) * stride_cs + kv_head * stride_ch)[:, None] \
            + d[None, :]  # [BLOCK_N, BLOCK_D]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)  # half KV widened
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        # every row keeps key 0 visible, so no row's max is -inf (rows past q_len see more
        # keys than they should, but they are never stored)
        s = tl.where((n[None, :] <= q_pos[:, None]) & n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, MAX_COMBINE))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, SUM_COMBINE)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_rows = (q_start + tok).to(tl.int64) * stride_ot + heads * stride_oh
    tl.store(out_ptr + o_rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & d_mask[None, :])


def extend_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                     query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     max_query_len: int, out: torch.Tensor, req_offset: int = 0,
                     block_n: int = 32) -> torch.Tensor:
    """Attention for requests req_offset .. R-1 of a packed batch.

    query/out [T, heads, head_dim] indexed by query_start_loc [R+1]; the chunk of request r ends
    at position seq_lens[r] - 1; kv_cache [2, num_blocks, page_size, kv_heads, head_dim] already
    holds every key up to there; block_tables [R, max_blocks] int32. Rows of the first req_offset
    requests in `out` are left untouched."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, page_size = kv_cache.shape[3], kv_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"heads ({num_heads}) must be a multiple of kv_heads ({num_kv_heads})")
    if query.stride(-1) != 1 or out.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("extend_attention needs head_dim contiguous in query, out and cache")
    check_block_n(block_n)
    num_reqs = seq_lens.shape[0] - req_offset
    if num_reqs <= 0 or max_query_len <= 0:
        return out
    group = num_heads // num_kv_heads
    block_g = pow2(group)
    # ~64 rows per program (tl.dot wants >= 16): fewer tokens per tile when the group is large
    block_q = max(64 // block_g, 1)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    grid = (triton.cdiv(max_query_len, block_q), num_reqs, num_kv_heads)
    _extend_kernel.on(query.device)[grid](
        query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        scale * LOG2E, req_offset,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size, BLOCK_Q=block_q, BLOCK_G=block_g,
        BLOCK_D=pow2(head_dim, 16), BLOCK_N=block_n, PRECISION=dot_precision(query.dtype))
    return out
