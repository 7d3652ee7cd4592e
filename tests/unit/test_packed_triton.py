"""The Triton packed GEMM (quant/triton_gemm.py) against gguf-py's dequantize + an fp64 matmul:
on the CPU under Triton's interpreter (tiny shapes: it runs every program in Python), and
compiled on CUDA when a GPU is present. Odd M and N cover the masked tile edges."""

from __future__ import annotations

import pytest
import torch

from pdserve.common.models.quant.packed import QType
from pdserve.common.models.quant.triton_gemm import triton_packed_linear
from pdserve.tests.unit.packed_helpers import make_weight, reference, tol

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0,
                                   QType.IQ4_NL], ids=lambda q: q.name)
@pytest.mark.parametrize("m,n,k", [(1, 5, 32), (3, 70, 64), (17, 9, 96)], ids=str)
def test_triton_matches_fp32_gemm(device, qtype, m, n, k):
    w, ref = make_weight(qtype, n, k, seed=m * n)
    g = torch.Generator().manual_seed(k)
    x, bias, residual = (torch.randn(m, k, generator=g), torch.randn(n, generator=g),
                         torch.randn(m, n, generator=g))
    wd = w.apply(lambda t: t.to(device))
    got = triton_packed_linear(x.to(device), wd, bias.to(device), residual.to(device))
    torch.testing.assert_close(got.cpu(), reference(x, ref, bias, residual), **tol(k))
    torch.testing.assert_close(triton_packed_linear(x.to(device), wd).cpu(), reference(x, ref),
                               **tol(k))


def test_triton_rejects_bad_shapes():
    w, _ = make_weight(QType.Q8_0, 4, 64)
    with pytest.raises(ValueError, match="x must be"):
        triton_packed_linear(torch.randn(2, 32), w)
    with pytest.raises(ValueError, match="residual"):
        triton_packed_linear(torch.randn(2, 64), w, None, torch.randn(3, 4))
