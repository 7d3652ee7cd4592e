"""The Triton attention kernels on half KV caches (`--kv-cache-dtype`), run in Triton's
interpreter on the CPU like tests/unit/test_triton_kernels.py.

fp32 queries over a bf16 / fp16 cache: the kernels widen each loaded K/V element to fp32, as
the torch backend does on the same cache, so only the summation order differs (fp32
tolerances). Half queries over a cache of their own type (the GPU's bf16 / fp16 activations):
against an fp32 reference on the same half inputs, the tolerance of the existing bf16 cases
(fp16 in the interpreter; bf16 only on a GPU).
"""

from __future__ import annotations

import pytest
import torch

from pdserve.common.attention.torch_backend import TorchAttentionBackend
from pdserve.common.attention.triton_backend import TritonAttentionBackend
from tests.unit.test_triton_kernels import make_batch

HALF = [torch.bfloat16, torch.float16]
IDS = ["bf16", "fp16"]
REQS = [(16, 1), (33, 1), (0, 7), (20, 12)]  # two decodes, then two extends


def _run(backend, q, k, v, kv_cache, meta):
    cache = kv_cache.clone()
    backend.write_kv(k, v, cache, meta.slot_mapping)
    return backend.forward(q, k, v, cache, meta, 0.125), cache


@pytest.mark.parametrize("cache_dtype", HALF, ids=IDS)
def test_fp32_queries_over_a_half_cache(cache_dtype):
    q, k, v, kv_cache, meta = make_batch(REQS, 2, 64, 16, 3, "cpu", torch.float32)
    kv_cache = kv_cache.to(cache_dtype)
    out, cache = _run(TritonAttentionBackend(num_splits=2), q, k, v, kv_cache, meta)
    _, ref_cache = _run(TorchAttentionBackend(), q, k, v, kv_cache, meta)
    # the interpreter's fp32 -> bf16 cast truncates where CUDA rounds to nearest even: within
    # one unit in the last place of the half type
    ulp = torch.finfo(cache_dtype).eps
    assert cache.dtype == cache_dtype
    torch.testing.assert_close(cache.float(), ref_cache.float(), atol=1e-6, rtol=ulp)
    ref = TorchAttentionBackend().forward(q, k, v, cache, meta, 0.125)  # the same cache
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


# bf16 dots are not emulated by Triton's interpreter (numpy has no bf16; its results are
# garbage), so bf16 activations run only where a GPU is present, as in test_triton_kernels.py
HALF_QUERY_CASES = [("cpu", torch.float16)] + (
    [("cuda", torch.float16), ("cuda", torch.bfloat16)] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device,dtype", HALF_QUERY_CASES,
                         ids=[f"{d}-{str(t)[6:]}" for d, t in HALF_QUERY_CASES])
def test_half_queries_over_a_half_cache(device, dtype):
    q, k, v, kv_cache, meta = make_batch(REQS, 2, 64, 16, 3, device, dtype)
    out, cache = _run(TritonAttentionBackend(num_splits=2), q, k, v, kv_cache, meta)
    ref, _ = _run(TorchAttentionBackend(), q.float(), k.float(), v.float(),
                  cache.float(), meta)  # the written half cache, widened
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
