"""The native CPU kernels' fused pieces: `attention_step` (rotary + KV write + paged decode and
prefill attention for a layer) against the three torch steps with SDPA attention, and `rms_norm`
against torch.

The rotary inside `attention_step` rounds each product on its own, like torch's mul/mul/add, so
the cache it writes must be bit-identical to the torch path's; attention outputs use the
kernels' tolerance (fp32 atol 1e-5 / rtol 1e-4)."""

from __future__ import annotations

import pytest
import torch

from pdserve.common.attention import cpu_native
from pdserve.common.attention.backend import AttentionMetadata
from pdserve.common.attention.torch_backend import (TorchAttentionBackend, _decode,
                                                     prefill_reference)
from pdserve.common.config import RopeScaling
from pdserve.common.models.rope import RotaryEmbedding
from pdserve.tests.unit.test_cpu_paged_attention import NUM_KV_HEADS, make_decode_batch


@pytest.fixture(scope="module")
def kernels():
    module = cpu_native.load_cpu_kernels()
    assert module is not None, "native CPU kernels failed to build"
    return module


def _step_case(lens, chunks, head_dim, block_size, group):
    """A batch of decodes (context lengths `lens`) then prefill chunks ((chunk, context) each),
    metadata as the runner builds it, and a qkv with strided rows."""
    all_lens = list(lens) + [ctx for _, ctx in chunks]
    _, kv_cache, meta = make_decode_batch(all_lens, head_dim, block_size, group)
    q_lens = [1] * len(lens) + [q for q, _ in chunks]
    heads = NUM_KV_HEADS * group
    # every new token's position and slot (the last q_len positions of its context)
    pos = torch.cat([torch.arange(ctx - q, ctx) for q, ctx in zip(q_lens, all_lens)])
    req = torch.repeat_interleave(torch.arange(len(all_lens)), torch.tensor(q_lens))
    blocks = meta.block_tables[req, pos // block_size].long()
    t = len(pos)
    meta = AttentionMetadata(
        num_tokens=t, num_decodes=len(lens),
        query_start_loc=torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(),
                                     dtype=torch.int32),
        seq_lens=meta.seq_lens, block_tables=meta.block_tables,
        slot_mapping=blocks * block_size + pos % block_size, max_query_len=max(q_lens),
        max_seq_len=max(all_lens), query_lens_cpu=q_lens, seq_lens_cpu=all_lens)
    gen = torch.Generator().manual_seed(1)
    width = (heads + 2 * NUM_KV_HEADS) * head_dim
    qkv = torch.randn(t, width + 5, generator=gen)[:, :width]  # strided rows
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, RopeScaling())
    return qkv, rope.cos_sin(pos), kv_cache, meta, heads, rope


def _sdpa_attention(q, kv_cache, meta, scale):
    """The torch reference for every request: `_decode`, then SDPA per prefill chunk."""
    n = meta.num_decodes
    out = prefill_reference(q, kv_cache, meta.block_tables, meta.seq_lens,
                            meta.query_start_loc, n, scale)
    if n:
        out[:n] = _decode(q[:n], kv_cache, meta, scale)
    return out


CASES = [([1, 17, 16, 53], []),  # decodes only
         ([], [(20, 20), (7, 40), (1, 1)]),  # prefill chunks only, with and without a prefix
         ([9, 70], [(33, 33), (16, 80)])]  # mixed, decodes first


@pytest.mark.parametrize("lens,chunks", CASES, ids=["decode", "prefill", "mixed"])
@pytest.mark.parametrize("head_dim,block_size,group", [(64, 16, 3), (128, 32, 1), (64, 16, 8)])
def test_attention_step_equals_rotary_write_attend(kernels, head_dim, block_size, group, lens,
                                                   chunks):
    if chunks and not kernels.fast_prefill:
        pytest.skip("no AVX2: the fused step declines prefill chunks on this CPU")
    qkv, (cos, sin), kv_cache, meta, heads, rope = _step_case(lens, chunks, head_dim,
                                                              block_size, group)
    t, q_size, kv_size = meta.num_tokens, heads * head_dim, NUM_KV_HEADS * head_dim
    backend = TorchAttentionBackend()
    # the torch path, step by step
    ref_cache = kv_cache.clone()
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k = rope((cos, sin), q.reshape(t, heads, head_dim), k.reshape(t, NUM_KV_HEADS, head_dim))
    v = v.reshape(t, NUM_KV_HEADS, head_dim)
    backend.write_kv(k, v, ref_cache, meta.slot_mapping)
    ref = _sdpa_attention(q, ref_cache, meta, 0.125)
    # fused
    fused_cache = kv_cache.clone()
    out = backend.fused_forward(qkv, cos, sin, fused_cache, meta, 0.125, heads)
    assert out is not None
    assert torch.equal(fused_cache, ref_cache)  # same slots, bit-identical rotated keys
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    # the unfused backend path (native decode + native prefill) agrees too
    torch.testing.assert_close(backend.forward(q, k, v, ref_cache, meta, 0.125), ref,
                               atol=1e-5, rtol=1e-4)


def test_fused_forward_declines_an_empty_batch(kernels):
    qkv, (cos, sin), kv_cache, meta, heads, _ = _step_case([5], [], 64, 16, 3)
    meta.num_tokens = 0
    assert TorchAttentionBackend().fused_forward(qkv[:0], cos[:0], sin[:0], kv_cache, meta,
                                                 0.125, heads) is None


def _break_slot(meta, kv_cache, heads):
    meta.slot_mapping[1] = kv_cache.shape[1] * kv_cache.shape[2]  # one past the last slot
    return heads


def _break_table(meta, kv_cache, heads):
    meta.block_tables[1, 0] = kv_cache.shape[1]  # a block the cache does not have
    return heads


def _break_start_loc(meta, kv_cache, heads):
    meta.query_start_loc[1] = 2  # the first request is a decode: one row
    return heads


@pytest.mark.parametrize("break_it,match", [
    (_break_slot, "slot_mapping"), (_break_table, "block_tables"),
    (_break_start_loc, "query_start_loc"),
    (lambda meta, kv_cache, heads: heads - 1, "kv heads")])  # not a multiple of kv heads
def test_attention_step_checks_everything_before_writing(kernels, break_it, match):
    qkv, (cos, sin), kv_cache, meta, heads, _ = _step_case([5, 9], [(4, 20)], 64, 16, 3)
    heads = break_it(meta, kv_cache, heads)
    before = kv_cache.clone()
    t = meta.num_tokens
    with pytest.raises(ValueError, match=match):
        kernels.attention_step(qkv if heads == 6 else qkv[:, :-64], cos.reshape(t, -1),
                               sin.reshape(t, -1), kv_cache, meta.slot_mapping,
                               meta.block_tables, meta.seq_lens, meta.query_start_loc, 2, 0.125,
                               heads)
    assert torch.equal(kv_cache, before)  # nothing was written


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


def test_kernels_release_the_gil(kernels):
    """The services run the engine in a thread beside the asyncio loop: a long kernel must let
    Python code in other threads run meanwhile. The main thread spins while a worker runs one
    long prefill call; with the GIL held for the call, the spin loop would stall for all of it."""
    if not kernels.fast_prefill:
        pytest.skip("no AVX2: no native prefill kernel to run")
    import threading
    import time

    from pdserve.tests.unit.test_cpu_prefill_attention import make_prefill_batch
    query, kv, tables, lens, qsl = make_prefill_batch([(6000, 6000)], 64, 16, 3)
    out = torch.empty_like(query)
    call = {}

    def run():
        t0 = time.perf_counter()
        kernels.paged_prefill(query, kv, tables, lens, qsl, 0, 0.125, out)
        call["s"] = time.perf_counter() - t0

    worker = threading.Thread(target=run)
    last = time.perf_counter()
    max_gap = 0.0
    worker.start()
    while worker.is_alive():
        now = time.perf_counter()
        max_gap, last = max(max_gap, now - last), now
    worker.join()
    assert call["s"] > 0.05, "the call is too short to tell"
    assert max_gap < call["s"] / 2, (max_gap, call["s"])
