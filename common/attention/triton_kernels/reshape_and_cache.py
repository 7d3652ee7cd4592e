"""Write the new tokens' keys and values into their paged-cache slots.

Grid: one program per new token. A program moves that token's whole [kv_heads, head_dim] key and
value tile in one masked load/store each; a slot of -1 marks a padding token and is skipped.
"""

from __future__ import annotations

import torch
import triton.language as tl

from pdserve.common.attention.triton_kernels._launch import device_kernel, pow2


@device_kernel
def _reshape_and_cache_kernel(
    key_ptr, value_ptr,  # [T, kv_heads, head_dim]
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, kv_heads, head_dim]
    slot_ptr,  # [T] int64
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    # slot < 0: a padding token, nothing to store. (Folded into the head bound because the
    # interpreter turns `tensor_mask & scalar_bool` into an int32 mask it then rejects.)
    num_heads = tl.where(slot >= 0, NUM_KV_HEADS, 0)
    mask = (heads[:, None] < num_heads) & (dims[None, :] < HEAD_DIM)
    blk = slot // PAGE_SIZE
    off = slot % PAGE_SIZE
    dst = blk * stride_cb + off * stride_cs + heads[:, None] * stride_ch + dims[None, :]
    k = tl.load(key_ptr + tok * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(value_ptr + tok * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """key/value [T, kv_heads, head_dim] -> kv_cache [2, num_blocks, block_size, kv_heads,
    head_dim] at slot_mapping [T] (slot = block_id * block_size + offset)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1 or value.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("reshape_and_cache needs head_dim contiguous in key, value and cache")
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _reshape_and_cache_kernel.on(key.device)[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=kv_cache.shape[2],
        BLOCK_H=pow2(num_kv_heads), BLOCK_D=pow2(head_dim),
    )
