"""A fused weight whose shards differ in GGUF type stays packed as parts (quant/packed.py's
`stack_runs`) and multiplies part by part (quant/gemm.py's `packed_linear_parts`): the same
product as the dequantized fp32 weight, on every CPU path (the packed kernel below LARGE_M,
the expansion above, oneDNN's blocked layout from BLOCKED_M), with the bias split by part."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pdserve.common.models.quant import gemm
from pdserve.common.models.quant.blocked import BlockedWeights
from pdserve.common.models.quant.cpu_native import load_packed_kernels
from pdserve.common.models.quant.packed import PackedWeight, QType, stack_runs

K = 64


def packed(qtype: QType, rows: int, seed: int) -> PackedWeight:
    rng = np.random.default_rng(seed)
    values = (rng.standard_normal((rows, K)) * K ** -0.5).astype(np.float32)
    data = gguf.quants.quantize(values, gguf.GGMLQuantizationType(int(qtype)))
    return PackedWeight.from_numpy(qtype, data, K)


def test_stack_runs_merges_consecutive_shards_of_one_type():
    q, k, v = packed(QType.Q4_1, 32, 0), packed(QType.Q4_1, 16, 1), packed(QType.Q8_0, 16, 2)
    parts = stack_runs([q, k, v])
    assert [(p.qtype, p.out_features) for p in parts] == [(QType.Q4_1, 48), (QType.Q8_0, 16)]
    assert torch.equal(parts[0].data, torch.cat([q.data, k.data]))
    assert parts[1] is v
    # a type that returns later is a part of its own: output order is kept
    split = stack_runs([v, q, packed(QType.Q8_0, 8, 3)])
    assert [p.qtype for p in split] == [QType.Q8_0, QType.Q4_1, QType.Q8_0]
    assert stack_runs([q]) == (q,)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("m", [1, 7, gemm.LARGE_M["avx512"], gemm.LARGE_M["avx2"] + 3, 800])
def test_parts_multiply_like_the_fp32_weight(m, bias):
    parts = stack_runs([packed(QType.Q4_1, 48, 4), packed(QType.Q8_0, 16, 5),
                        packed(QType.Q4_0, 32, 6)])
    full = torch.cat([p.dequantize() for p in parts])  # [96, K]
    b = torch.randn(full.shape[0]) if bias else None
    x = torch.randn(m, K)
    ref = torch.nn.functional.linear(x.double(), full.double(),
                                     None if b is None else b.double()).float()
    native = load_packed_kernels()
    blocked = BlockedWeights(native) if native is not None else None
    for with_blocked in (None, blocked):
        y = gemm.packed_linear_parts(x, parts, b, blocked=with_blocked)
        assert y.shape == (m, 96)
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
        n0 = 0  # each part's columns are exactly that part's own product
        for p in parts:
            own = gemm.packed_linear(x, p, None if b is None else b[n0:n0 + p.out_features],
                                     blocked=with_blocked)
            assert torch.equal(y[:, n0:n0 + p.out_features], own)
            n0 += p.out_features
