"""The native CPU kernels' fused pieces: `decode_step` (rotary + KV write + paged decode
attention for a decode-only layer) against the three torch steps, and `rms_norm` against torch.

The rotary inside `decode_step` rounds each product on its own, like torch's mul/mul/add, so
the cache it writes must be bit-identical to the torch path's; attention outputs use the decode
kernel tolerance (fp32 atol 1e-5 / rtol 1e-4)."""

from __future__ import annotations

import pytest
import torch

from pdserve.common.attention import cpu_native
from pdserve.common.attention.torch_backend import TorchAttentionBackend
from pdserve.common.config import RopeScaling
from pdserve.common.models.rope import RotaryEmbedding
from pdserve.tests.unit.test_cpu_paged_attention import NUM_KV_HEADS, make_decode_batch


@pytest.fixture(scope="module")
def kernels():
    module = cpu_native.load_cpu_kernels()
    assert module is not None, "native CPU kernels failed to build"
    return module


def _decode_case(lens, head_dim, block_size, group):
    query, kv_cache, meta = make_decode_batch(lens, head_dim, block_size, group)
    heads = NUM_KV_HEADS * group
    gen = torch.Generator().manual_seed(1)
    # the new token sits at position len - 1: its slot in the request's last used block
    pos = torch.tensor(lens) - 1
    blocks = meta.block_tables[torch.arange(len(lens)), pos // block_size].long()
    meta.slot_mapping = blocks * block_size + pos % block_size
    width = (heads + 2 * NUM_KV_HEADS) * head_dim
    qkv = torch.randn(len(lens), width + 5, generator=gen)[:, :width]  # strided rows
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, RopeScaling())
    return qkv, rope.cos_sin(pos), kv_cache, meta, heads, rope


@pytest.mark.parametrize("head_dim,block_size,group", [(64, 16, 3), (128, 32, 1), (64, 16, 8)])
def test_decode_step_equals_rotary_write_attend(kernels, head_dim, block_size, group):
    lens = [1, 17, block_size, 3 * block_size + 5]
    qkv, (cos, sin), kv_cache, meta, heads, rope = _decode_case(lens, head_dim, block_size,
                                                                 group)
    t, q_size, kv_size = len(lens), heads * head_dim, NUM_KV_HEADS * head_dim
    backend = TorchAttentionBackend()
    # the torch path, step by step
    ref_cache = kv_cache.clone()
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k = rope((cos, sin), q.reshape(t, heads, head_dim), k.reshape(t, NUM_KV_HEADS, head_dim))
    v = v.reshape(t, NUM_KV_HEADS, head_dim)
    backend.write_kv(k, v, ref_cache, meta.slot_mapping)
    ref = backend.forward(q, k, v, ref_cache, meta, 0.125)
    # fused
    fused_cache = kv_cache.clone()
    out = backend.fused_decode(qkv, cos, sin, fused_cache, meta, 0.125, heads)
    assert out is not None
    assert torch.equal(fused_cache, ref_cache)  # same slots, bit-identical rotated keys
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


def test_fused_decode_declines_mixed_batches(kernels):
    qkv, (cos, sin), kv_cache, meta, heads, _ = _decode_case([5, 9], 64, 16, 3)
    meta.num_decodes = 1  # one of them is a prefill chunk: the model must do the steps itself
    before = kv_cache.clone()
    assert TorchAttentionBackend().fused_decode(qkv, cos, sin, kv_cache, meta, 0.125,
                                                heads) is None
    assert torch.equal(kv_cache, before)


def test_decode_step_rejects_bad_slots(kernels):
    qkv, (cos, sin), kv_cache, meta, heads, _ = _decode_case([5, 9], 64, 16, 3)
    meta.slot_mapping[1] = kv_cache.shape[1] * kv_cache.shape[2]  # one past the last slot
    with pytest.raises(ValueError, match="slot_mapping"):
        kernels.decode_step(qkv, cos.reshape(2, -1), sin.reshape(2, -1), kv_cache,
                            meta.slot_mapping, meta.block_tables, meta.seq_lens, 0.125, heads)


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_rms_norm_matches_torch(kernels, rows):
    gen = torch.Generator().manual_seed(rows)
    x = 3 * torch.randn(rows, 600, generator=gen)[:, :576]  # strided rows
    w = torch.randn(576, generator=gen)
    ref = torch.nn.functional.rms_norm(x, (576,), w, 1e-5)
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-5), ref, atol=1e-6, rtol=1e-5)


def test_rms_norm_bad_weight(kernels):
    with pytest.raises(ValueError, match="weight"):
        kernels.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-5)
