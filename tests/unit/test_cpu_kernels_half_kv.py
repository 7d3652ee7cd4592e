"""The native CPU attention kernels on a bf16 / fp16 KV cache (`--kv-cache-dtype`).

The kernels widen each cached element to fp32 as they load it (prefill: a tile's rows into fp32
scratch; decode: in registers), so against the torch reference
(which widens the gathered K/V with `.to(float32)`) only the summation order differs: the fp32
tolerances of the fp32 tests hold. The fused step must round keys and values into the cache
exactly as torch's `.to(dtype)` does (bit-identical caches).
"""

from __future__ import annotations

import os

import pytest
import torch

from pdserve.common.attention import cpu_native
from pdserve.common.attention.torch_backend import TorchAttentionBackend, _decode, prefill_reference
from tests.unit.test_cpu_fused_kernels import NUM_KV_HEADS, _sdpa_attention, _step_case
from tests.unit.test_cpu_paged_attention import make_decode_batch
from tests.unit.test_cpu_prefill_attention import make_prefill_batch

TOL = dict(atol=1e-5, rtol=1e-4)
HALF = [torch.bfloat16, torch.float16]
IDS = ["bf16", "fp16"]


@pytest.fixture(scope="module")
def kernels():
    module = cpu_native.load_cpu_kernels()
    if module is None:
        pytest.skip("native CPU kernels unavailable (no compiler or PDSERVE_NO_NATIVE=1)")
    return module


def _half(kv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The test cache rounded to dtype (its 100 x randn garbage stays finite in fp16 too)."""
    assert torch.isfinite(kv.to(dtype)).all()
    return kv.to(dtype)


@pytest.mark.parametrize("dtype", HALF, ids=IDS)
@pytest.mark.parametrize("head_dim,block_size,group",
                         [(64, 16, 3), (128, 32, 1), (36, 8, 2), (80, 16, 3)])
def test_paged_decode_reads_a_half_cache(kernels, dtype, head_dim, block_size, group):
    lens = [1, block_size + 1, 3 * block_size + 7, 300]
    q, kv, meta = make_decode_batch(lens, head_dim, block_size, group)
    kv = _half(kv, dtype)
    out = kernels.paged_decode(q, kv, meta.block_tables, meta.seq_lens, 0.125, None, 0)
    ref = _decode(q, kv, meta, 0.125)  # gathers, widens, one SDPA
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("dtype", HALF, ids=IDS)
@pytest.mark.parametrize("head_dim,block_size,group", [(64, 16, 3), (36, 8, 2)])  # 36: tails
def test_paged_prefill_reads_a_half_cache(kernels, dtype, head_dim, block_size, group):
    if not kernels.fast_prefill:
        pytest.skip("no AVX2: the native prefill kernel is not used on this CPU")
    chunks = [(1, 1), (17, 17), (5, 37), (33, 300), (20, 70)]
    query, kv, tables, lens, qsl = make_prefill_batch(chunks, head_dim, block_size, group)
    kv = _half(kv, dtype)
    out = torch.empty_like(query)
    kernels.paged_prefill(query, kv, tables, lens, qsl, 0, 0.125, out)
    torch.testing.assert_close(out, prefill_reference(query, kv, tables, lens, qsl, 0, 0.125),
                               **TOL)


@pytest.mark.parametrize("dtype", HALF, ids=IDS)
def test_attention_step_rounds_into_a_half_cache_like_torch(kernels, dtype):
    lens, chunks = [9, 70], ([(33, 33), (16, 80)] if kernels.fast_prefill else [])
    qkv, (cos, sin), kv_cache, meta, heads, rope = _step_case(lens, chunks, 64, 16, 3)
    kv_cache = _half(kv_cache, dtype)
    t, q_size, kv_size = meta.num_tokens, heads * 64, NUM_KV_HEADS * 64
    backend = TorchAttentionBackend()
    ref_cache = kv_cache.clone()
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k = rope((cos, sin), q.reshape(t, heads, 64), k.reshape(t, NUM_KV_HEADS, 64))
    backend.write_kv(k, v.reshape(t, NUM_KV_HEADS, 64), ref_cache, meta.slot_mapping)
    fused_cache = kv_cache.clone()
    out = backend.fused_forward(qkv, cos, sin, fused_cache, meta, 0.125, heads)
    assert out is not None
    assert fused_cache.dtype == dtype
    assert torch.equal(fused_cache, ref_cache)  # rounded to nearest even, as .to(dtype)
    torch.testing.assert_close(out, _sdpa_attention(q, ref_cache, meta, 0.125), **TOL)


def test_an_avx512_cpu_runs_the_avx512_build(kernels):
    """The prefill kernel widens a half cache's rows 16 at a time in that build (widen_row)."""
    if "avx512f" not in cpu_native._cpu_flags():
        pytest.skip("this CPU has no AVX-512F: the AVX-512 build is not made here")
    if os.environ.get("PDSERVE_CPU_ISA", "native") != "native":
        pytest.skip("PDSERVE_CPU_ISA caps this build below AVX-512")
    assert kernels.simd == "avx512"


def test_other_cache_dtypes_are_refused(kernels):
    q, kv, meta = make_decode_batch([5], 64, 16, 1)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        kernels.paged_decode(q, kv.double(), meta.block_tables, meta.seq_lens, 0.125, None, 0)
