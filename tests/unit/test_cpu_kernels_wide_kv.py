"""The decode kernel's 16-lane forms on every cache dtype (paged_attention.cpp, AVX-512 builds).

With AVX-512 the decode kernel reads fp32 and fp16 rows 16 elements per vector and bf16 rows 32
per load, split into even and odd elements (queries and accumulators kept in that order), dots
16 tokens at a time reduced by one transposing tree, and falls back to the 8-lane code where the
head size is not a multiple of the chunk (bf16 at d = 48). The shapes below reach each of those
branches and every tail: one chunk and several, 16-token passes and the tokens after them, a
block size under 16 (no 16-token pass at all), GQA groups past the 8 heads one V pass holds.
The same cases run in the AVX2 and scalar builds (test_cpu_kernels_narrow_isa.py).
"""

from __future__ import annotations

import os

import pytest
import torch

from pdserve.common.attention import cpu_native
from pdserve.common.attention.torch_backend import _decode
from tests.unit.test_cpu_paged_attention import kernels, make_decode_batch  # noqa: F401 (fixture)

TOL = dict(atol=1e-5, rtol=1e-4)  # fp32 tolerances: widening is exact, only sums reorder
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (head_dim, block_size, group): bf16 chunks of 32, fp32 / fp16 chunks of 16
SHAPES = [(64, 16, 3),   # SmolLM2: two bf16 chunks, four fp32 ones
          (32, 16, 9),   # one chunk; 9 heads: a V pass of 8 and one of 1
          (96, 32, 4),   # three bf16 chunks; two 16-token passes per block
          (48, 16, 2),   # not a multiple of 32: bf16 takes the 8-lane code, fp32 / fp16 not
          (128, 8, 1)]   # blocks of 8: single dots only
LENS = [1, 15, 16, 17, 47, 200]


def test_an_avx512_cpu_runs_the_16_lane_build(kernels):
    if "avx512f" not in cpu_native._cpu_flags():
        pytest.skip("this CPU has no AVX-512F: the 16-lane forms are not built here")
    if os.environ.get("PDSERVE_CPU_ISA", "native") != "native":
        pytest.skip("PDSERVE_CPU_ISA caps this build below AVX-512")
    assert kernels.simd == "avx512"


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("head_dim,block_size,group", SHAPES)
def test_decode_on_every_cache_dtype_and_tail(kernels, dtype, head_dim, block_size, group):
    q, kv, meta = make_decode_batch(LENS, head_dim, block_size, group)
    kv = kv.to(dtype)
    out = kernels.paged_decode(q, kv, meta.block_tables, meta.seq_lens, 0.125, None, 0)
    torch.testing.assert_close(out, _decode(q, kv, meta, 0.125), **TOL)  # widened + SDPA
    # one kv head per work item: the same rows read through other item boundaries
    one = kernels.paged_decode(q, kv, meta.block_tables, meta.seq_lens, 0.125, None, 1)
    torch.testing.assert_close(one, out, **TOL)
