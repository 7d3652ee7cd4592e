"""Packed weights expanded straight into oneDNN's blocked layout (quant/blocked.py and the
native `dequantize_blocked`): every weight lands at its `BlockedLayout` offset with the padding
rows zero, in every block width the kernel has a path for; oneDNN's own reorder puts weights
where the probe says; the GEMM on the blocked buffer equals oneDNN's on the prepacked fp32
weight bit for bit; and the large-M dispatch takes it from BLOCKED_M rows on.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.common.models.cpu_gemm import onednn_available, pack_weight
from pdserve.common.models.cpu_gemm import packed_linear as onednn_linear
from pdserve.common.models.quant import gemm
from pdserve.common.models.quant.blocked import (BlockedLayout, BlockedWeights, _match,
                                                 onednn_buffer, probe_layout)
from pdserve.common.models.quant.cpu_native import load_packed_kernels
from pdserve.common.models.quant.packed import QType
from pdserve.tests.unit.kquant_helpers import make_kquant_weight
from pdserve.tests.unit.packed_helpers import make_weight

torch.set_num_threads(2)
needs_onednn = pytest.mark.skipif(not onednn_available(), reason="torch without oneDNN")


def native():
    mod = load_packed_kernels()
    assert mod is not None, "the packed kernels must build on this machine"
    return mod


def blocked_reference(ref: torch.Tensor, layout: BlockedLayout) -> torch.Tensor:
    """ref [n, k] placed at the layout's offsets; padding zero."""
    out = torch.zeros(layout.numel)
    out[layout.offsets().reshape(-1)] = ref.reshape(-1)
    return out


@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0,
                                   QType.Q4_K, QType.IQ4_NL, QType.IQ4_XS], ids=lambda q: q.name)
# 64 and 16: whole vectors (register transposes); 8: whole vectors in the AVX2 build only;
# 5: element by element. n = 37 / 70 leave the last block part padding.
@pytest.mark.parametrize("ob,n", [(64, 70), (16, 37), (8, 37), (5, 37)])
def test_expansion_lands_at_the_layout_offsets(qtype, ob, n):
    k = 512
    w, ref = (make_kquant_weight(qtype, n, k) if qtype == QType.Q4_K
              else make_weight(qtype, n, k))
    layout = BlockedLayout(n, k, ob)
    out = torch.full((layout.numel,), float("nan"))  # padding must be written, not assumed
    native().dequantize_blocked(w.data, int(qtype), k, out, ob)
    assert torch.equal(out, blocked_reference(ref, layout))


def test_expansion_checks_its_arguments():
    w, _ = make_weight(QType.Q4_1, 37, 64)
    with pytest.raises(ValueError, match="elements"):
        native().dequantize_blocked(w.data, int(QType.Q4_1), 64, torch.empty(37 * 64), 64)
    with pytest.raises(ValueError, match="1 .. 1024"):
        native().dequantize_blocked(w.data, int(QType.Q4_1), 64, torch.empty(64), 0)


def test_layout_rejects_impossible_blocks():
    with pytest.raises(ValueError):
        BlockedLayout(10, 64, 0)
    with pytest.raises(ValueError):
        BlockedLayout(0, 64, 8)


def test_match_rejects_other_orders():
    """Column blocks outermost (a "Ba16b"-like order) or two weights swapped is not a
    BlockedLayout; all columns of all rows in one block (plain column-major) is one."""
    n, k = 32, 48
    index = torch.arange(1, n * k + 1, dtype=torch.float32).view(n, k)
    by_column_blocks = index.reshape(n, k // 16, 16).transpose(0, 1).reshape(-1)
    assert _match(n, k, by_column_blocks) is None
    assert _match(n, k, index.t().reshape(-1)) == BlockedLayout(n, k, n)
    layout = BlockedLayout(n, k, 16)
    flat = blocked_reference(index, layout)
    assert _match(n, k, flat) == layout
    swap = torch.arange(flat.numel())
    swap[[5, 9]] = swap[[9, 5]]
    assert _match(n, k, flat[swap]) is None


@needs_onednn
@pytest.mark.parametrize("n,k", [(192, 576), (100, 64), (7, 32)])
def test_probe_matches_onednns_own_reorder(n, k):
    probed = probe_layout(n, k)
    assert probed is not None, "oneDNN's fp32 weight layout changed: quant/blocked.py"
    layout, packed = probed
    assert (layout.n, layout.k) == (n, k)
    w = torch.randn(n, k)
    x = torch.randn(5, k)
    # the probe's tensor, filled with w at the layout's offsets, multiplies as w prepacked
    onednn_buffer(packed).copy_(blocked_reference(w, layout))
    assert torch.equal(onednn_linear(x, packed, None), onednn_linear(x, pack_weight(w), None))


@needs_onednn
@pytest.mark.parametrize("qtype", [QType.Q4_1, QType.Q8_0], ids=lambda q: q.name)
def test_blocked_gemm_equals_the_prepacked_fp32_gemm(qtype):
    """Past BLOCKED_M the GEMM is oneDNN's on the prepacked fp32 weight, bit for bit, bias and
    residual fused; a second weight of the shape reuses the buffer. (A build without a
    threshold runs the plain path: equal up to summation order.)"""
    w, ref = make_weight(qtype, 200, 320)
    w2, ref2 = make_weight(qtype, 200, 320, seed=1)
    blocked = BlockedWeights(native())
    simd = native().simd
    m = (gemm.BLOCKED_M[simd] or gemm.large_m(simd)) + 32
    x, bias, residual = torch.randn(m, 320), torch.randn(200), torch.randn(m, 200)
    got = gemm.packed_linear(x, w, bias, residual, blocked)
    got2 = gemm.packed_linear(x, w2, blocked=blocked)
    want = torch.ops.mkldnn._linear_pointwise.binary(x, residual, pack_weight(ref), bias, "add")
    want2 = onednn_linear(x, pack_weight(ref2), None)
    if gemm.BLOCKED_M[simd] is None:
        assert blocked.nbytes == 0
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(got2, want2, rtol=1e-5, atol=1e-4)
        return
    assert blocked.nbytes == probe_layout(200, 320)[0].numel * 4  # one buffer, padded rows
    assert torch.equal(got, want)
    assert torch.equal(got2, want2)


@needs_onednn
def test_weights_over_the_cap_take_the_plain_path():
    w, ref = make_weight(QType.Q4_1, 200, 320)
    blocked = BlockedWeights(native(), max_bytes=200 * 320 * 4 - 1)
    assert blocked.expand(w) is None and blocked.nbytes == 0
    x = torch.randn((gemm.BLOCKED_M[native().simd] or 256) + 32, 320)
    torch.testing.assert_close(gemm.packed_linear(x, w, blocked=blocked), x @ ref.t(),
                               rtol=1e-5, atol=1e-4)
