"""Triton paged-attention kernels against the torch reference backend.

CPU cases run in Triton's interpreter (the kernels pick it per launch for CPU tensors, whatever
TRITON_INTERPRET said when triton was imported: see triton_kernels/_launch.py); CUDA cases run
compiled when a GPU is present (`make gpu-check`). Cases stay tiny: the interpreter runs every
program in Python.

Tolerance: fp32 atol 1e-5 / rtol 1e-4 (only summation order differs: online softmax in tiles vs
one SDPA); bf16 (CUDA only) atol = rtol = 2e-2 against an fp32 reference on the same bf16 inputs.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.common.attention.backend import AttentionMetadata
from pdserve.common.attention.torch_backend import TorchAttentionBackend
from pdserve.common.attention.triton_backend import TritonAttentionBackend, choose_num_splits
from pdserve.common.attention.triton_kernels import (decode_attention, extend_attention,
                                                     reshape_and_cache)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
NUM_KV_HEADS = 2
SHAPES = [(d, bs, g) for d in (64, 128) for bs in (16, 32) for g in (1, 3, 8)]
SHAPE_IDS = [f"d{d}-bs{bs}-gqa{g}" for d, bs, g in SHAPES]


def _dtypes(device):
    return [torch.float32] + ([torch.bfloat16] if device == "cuda" else [])


CASES = [(dev, dt) for dev in DEVICES for dt in _dtypes(dev)]
CASE_IDS = [f"{dev}-{str(dt)[6:]}" for dev, dt in CASES]


def make_batch(reqs, num_decodes, head_dim, block_size, group, device, dtype, seed=0):
    """reqs: [(cached_len, new_len)], decodes first. Returns (q, k, v, kv_cache, meta) with the
    cached prefixes already in kv_cache (random) and the new tokens not yet written."""
    gen = torch.Generator().manual_seed(seed)
    lens = [c + n for c, n in reqs]
    blocks_per_req = [-(-length // block_size) for length in lens]
    num_blocks = sum(blocks_per_req) + 3  # spare blocks hold garbage the kernels must not read
    perm = torch.randperm(num_blocks, generator=gen)[:sum(blocks_per_req)]  # scattered pages
    tables = torch.zeros(len(reqs), max(blocks_per_req), dtype=torch.int32)
    slots, used = [], 0
    for i, ((cached, new), nb) in enumerate(zip(reqs, blocks_per_req)):
        tables[i, :nb] = perm[used:used + nb].int()
        used += nb
        slots += [int(tables[i, p // block_size]) * block_size + p % block_size
                  for p in range(cached, cached + new)]
    heads, t = NUM_KV_HEADS * group, sum(n for _, n in reqs)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    q, k, v = rnd(t, heads, head_dim), rnd(t, NUM_KV_HEADS, head_dim), rnd(t, NUM_KV_HEADS,
                                                                            head_dim)
    kv_cache = rnd(2, num_blocks, block_size, NUM_KV_HEADS, head_dim)
    q_lens = [n for _, n in reqs]
    loc = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    meta = AttentionMetadata(
        num_tokens=t, num_decodes=num_decodes, query_start_loc=loc.to(device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device), slot_mapping=torch.tensor(slots, device=device),
        max_query_len=max(q_lens), max_seq_len=max(lens), query_lens_cpu=q_lens,
        seq_lens_cpu=lens)
    return q, k, v, kv_cache, meta


def reference(q, k, v, kv_cache, meta, scale):
    """Torch backend in fp32 on a written copy of the cache."""
    ref = TorchAttentionBackend()
    cache = kv_cache.float().clone()
    ref.write_kv(k.float(), v.float(), cache, meta.slot_mapping)
    return ref.forward(q.float(), k.float(), v.float(), cache, meta, scale), cache


def decode_lengths(bs):
    return [1, bs, bs + 1, 7 * bs + 3]  # single token, block boundary, one past it, long


@pytest.mark.parametrize("device,dtype", CASES, ids=CASE_IDS)
def test_reshape_and_cache(device, dtype):
    q, k, v, kv_cache, meta = make_batch([(0, 5), (17, 16), (3, 1)], 0, 64, 16, 1, device,
                                         dtype)
    _, expect = reference(q, k, v, kv_cache, meta, 1.0)
    reshape_and_cache(k, v, kv_cache, meta.slot_mapping)
    torch.testing.assert_close(kv_cache.float(), expect, atol=0, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_reshape_and_cache_skips_padding_slots(device):
    q, k, v, kv_cache, meta = make_batch([(0, 3)], 0, 64, 16, 1, device, torch.float32)
    before = kv_cache.clone()
    reshape_and_cache(k, v, kv_cache, torch.full_like(meta.slot_mapping, -1))
    assert torch.equal(kv_cache, before)


@pytest.mark.parametrize("device,dtype", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("head_dim,block_size,group", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_attention(head_dim, block_size, group, num_splits, device, dtype):
    reqs = [(n - 1, 1) for n in decode_lengths(block_size)]
    q, k, v, kv_cache, meta = make_batch(reqs, len(reqs), head_dim, block_size, group, device,
                                         dtype)
    scale = head_dim ** -0.5
    expect, _ = reference(q, k, v, kv_cache, meta, scale)
    reshape_and_cache(k, v, kv_cache, meta.slot_mapping)
    out = decode_attention(q, kv_cache, meta.block_tables, meta.seq_lens, scale,
                           num_splits=num_splits)
    torch.testing.assert_close(out.float(), expect, **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
def test_split_decode_with_empty_splits(device):
    """More splits than a short request has tiles: empty splits must not disturb the merge."""
    reqs = [(0, 1), (40, 1), (250, 1)]
    q, k, v, kv_cache, meta = make_batch(reqs, 3, 64, 16, 3, device, torch.float32)
    expect, _ = reference(q, k, v, kv_cache, meta, 0.125)
    reshape_and_cache(k, v, kv_cache, meta.slot_mapping)
    out = decode_attention(q, kv_cache, meta.block_tables, meta.seq_lens, 0.125, num_splits=8)
    torch.testing.assert_close(out, expect, **TOL[torch.float32])


def extend_requests(bs):
    """(cached, new): no prefix / one token / block-aligned / prefix of several blocks / long."""
    return [(0, 1), (0, bs), (2 * bs, 1), (3 * bs, 5), (5, 2 * bs + 3)]


@pytest.mark.parametrize("device,dtype", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("head_dim,block_size,group", SHAPES, ids=SHAPE_IDS)
def test_extend_attention(head_dim, block_size, group, device, dtype):
    q, k, v, kv_cache, meta = make_batch(extend_requests(block_size), 0, head_dim, block_size,
                                         group, device, dtype)
    scale = head_dim ** -0.5
    expect, _ = reference(q, k, v, kv_cache, meta, scale)
    reshape_and_cache(k, v, kv_cache, meta.slot_mapping)
    out = torch.zeros_like(q)
    extend_attention(q, kv_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                     scale, meta.max_query_len, out)
    torch.testing.assert_close(out.float(), expect, **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits,head_dim", [(None, 64), (2, 64), (2, 80)])
def test_backend_mixed_batch(device, num_splits, head_dim):
    """Decodes first, then extends, in one forward, from a non-contiguous query view; 80 is a
    head_dim that is not a power of two (masked tail)."""
    reqs = [(16, 1), (33, 1), (0, 7), (20, 12)]
    q, k, v, kv_cache, meta = make_batch(reqs, 2, head_dim, 16, 3, device, torch.float32)
    q = torch.cat([q, q], dim=-1)[..., :head_dim]  # a strided view, as a fused qkv split gives
    expect, expect_cache = reference(q, k, v, kv_cache, meta, 0.125)
    backend = TritonAttentionBackend(num_splits=num_splits)
    backend.write_kv(k, v, kv_cache, meta.slot_mapping)
    out = backend.forward(q, k, v, kv_cache, meta, 0.125)
    torch.testing.assert_close(kv_cache, expect_cache, atol=0, rtol=0)
    torch.testing.assert_close(out, expect, **TOL[torch.float32])


def test_choose_num_splits():
    assert choose_num_splits(1, 8, 100, 132) == 1  # short: never split
    assert choose_num_splits(256, 8, 4096, 132) == 1  # enough programs already
    assert choose_num_splits(1, 8, 4096, 132) == 16  # length-bound: 4096 / 256
    assert choose_num_splits(2, 8, 32768, 132) == 17  # occupancy-bound: ceil(264 / 16)


def test_bad_config_raises():
    with pytest.raises(ValueError):
        TritonAttentionBackend(num_splits=0)
    with pytest.raises(ValueError):
        decode_attention(torch.zeros(1, 3, 8), torch.zeros(2, 1, 16, 2, 8),
                         torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                         1.0)
