"""Packed GGUF weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL; the K-quants and IQ4_XS:
test_packed_kquants.py): expansion equals gguf-py's dequantize bit for bit, and x @ W^T on every
path equals the dequantized fp32 GEMM up to summation order.

The reference is `gguf.quants.dequantize` (what the fp32 path loads and transformers uses) and
torch's fp32 matmul in float64 (so the tolerance only has to cover our summation order). Odd M
and N cover the kernels' row tiles and tails; K = 32 is a single block.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.common.models.quant import gemm
from pdserve.common.models.quant.cpu_native import load_packed_kernels
from pdserve.common.models.quant.packed import PackedWeight, QType
from pdserve.tests.unit.packed_helpers import (LARGE_M, make_weight, reference, tol,
                                               weights_read_one_hot)

torch.set_num_threads(2)
QTYPES = [QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0, QType.IQ4_NL]
# M < 4: blocks expanded per row (Q4_0 / Q4_1 / IQ4_NL by table lookup on AVX-512, the scales of
# a row widened 16 at a time: K = 576 and 1536 cover partial and whole groups of 16 blocks)
SHAPES = [(1, 1, 32), (1, 7, 64), (3, 33, 96), (2, 9, 576), (1, 40, 1536), (5, 64, 576),
          (17, 130, 320), (40, 1100, 64)]


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_torch_expansion_is_bit_identical_to_gguf(qtype):
    w, ref = make_weight(qtype, 37, 320)
    assert torch.equal(w.dequantize(), ref)
    rows = torch.tensor([36, 0, 5, 5])
    assert torch.equal(w.dequantize(rows), ref[rows])


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_native_expansion_is_bit_identical_to_gguf(qtype):
    native = load_packed_kernels()
    assert native is not None, "the packed kernels must build on this machine"
    w, ref = make_weight(qtype, 37, 320)
    assert torch.equal(native.dequantize(w.data, int(qtype), 320, 0, 37), ref)
    assert torch.equal(native.dequantize(w.data, int(qtype), 320, 3, 9), ref[3:9])
    rows = torch.tensor([36, 0, 5, 5])
    assert torch.equal(native.dequantize(w.data, int(qtype), 320, rows=rows), ref[rows])


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("m", [1, 2, 3])
def test_decode_kernel_weights_are_bit_identical_to_gguf(qtype, m):
    """Under 4 rows (the decode path: Q4_0 / Q4_1 / IQ4_NL and Q5_0 / Q5_1 by table lookup in the
    AVX-512 build, Q4_0 / Q4_1 / IQ4_NL in the scalar build, expanded in registers in the AVX2
    build, as Q8_0 in all), read back through one-hot activation rows: the kernel's weights
    equal gguf-py's dequantize bit for bit (+0 for -0), in whichever build runs here
    (test_packed_gemm_narrow_isa.py runs this under AVX2 and scalar)."""
    native = load_packed_kernels()
    assert native is not None, "the packed kernels must build on this machine"
    # 19 blocks a row: an odd block count and a partial vector of scales
    w, ref = make_weight(qtype, 21, 608, seed=m)
    assert torch.equal(weights_read_one_hot(native, w, m), ref)


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("m,n,k", SHAPES, ids=lambda s: str(s))
def test_native_kernel_matches_fp32_gemm(qtype, m, n, k):
    native = load_packed_kernels()
    w, ref = make_weight(qtype, n, k, seed=m + n)
    g = torch.Generator().manual_seed(k)
    x = torch.randn(m, k, generator=g)
    bias, residual = torch.randn(n, generator=g), torch.randn(m, n, generator=g)
    torch.testing.assert_close(native.packed_gemm(x, w.data, int(qtype)), reference(x, ref),
                               **tol(k))
    torch.testing.assert_close(native.packed_gemm(x, w.data, int(qtype), bias, residual),
                               reference(x, ref, bias, residual), **tol(k))


def test_native_kernel_takes_row_strided_views():
    native = load_packed_kernels()
    w, ref = make_weight(QType.Q4_1, 24, 64)
    wide = torch.randn(6, 160)
    x, residual = wide[:, 32:96], torch.randn(6, 40)[:, 8:32]  # row strides 160 and 40
    torch.testing.assert_close(native.packed_gemm(x, w.data, 3, None, residual),
                               reference(x, ref, residual=residual), **tol(64))


@pytest.mark.parametrize("tile", [64, None], ids=["tiled", "whole"])
@pytest.mark.parametrize("m", [LARGE_M - 1, LARGE_M, 70])
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_dispatch_both_sides_of_the_switch(monkeypatch, qtype, m, tile):
    if tile:  # the large-M path expands N = 150 in tiles of 64 rows, else all at once
        monkeypatch.setattr(gemm, "EXPAND_BYTES", tile * 4 * 96)
    w, ref = make_weight(qtype, 150, 96)
    g = torch.Generator().manual_seed(m)
    x, bias, residual = torch.randn(m, 96, generator=g), torch.randn(150), torch.randn(m, 150)
    torch.testing.assert_close(gemm.packed_linear(x, w, bias, residual),
                               reference(x, ref, bias, residual), **tol(96))


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("m", [1, 3, 5, LARGE_M])
@pytest.mark.parametrize("bias", [False, True])
def test_silu_and_mul_matches_fp32(qtype, m, bias):
    """gate/up's SiLU-and-mul: fused in the packed kernel below the switch (rows expanded per
    row at M < 4, panels from 4); one GEMM on the expanded weight and one pass at large M."""
    w, ref = make_weight(qtype, 2 * 40, 96)
    g = torch.Generator().manual_seed(m)
    x, b = torch.randn(m, 96, generator=g), torch.randn(80, generator=g) if bias else None
    gate, up = reference(x, ref, b).split(40, dim=-1)
    torch.testing.assert_close(gemm.packed_silu_and_mul(x, w, b),
                               torch.nn.functional.silu(gate) * up, **tol(96))


@pytest.mark.parametrize("rows,h", [(1, 1), (3, 7), (2, 40), (5, 1536)])
def test_native_silu_mul_matches_float64(rows, h):
    """The one-pass SiLU-and-mul after a plain GEMM (16- or 8-lane bodies and a scalar tail,
    Cephes exp within 2 ulp) against silu(gate) * up in float64, on contiguous rows and on rows
    of a wider tensor; gates span -120 .. 120, past the exp's clamp on both sides."""
    native = load_packed_kernels()
    g = torch.Generator().manual_seed(rows * 10000 + h)
    wide = torch.randn(rows, 2 * h + 3, generator=g) * 6
    wide[0, :h] = torch.linspace(-120, 120, h)
    for y in (wide[:, :2 * h], wide[:, :2 * h].contiguous()):
        gate, up = y.double().split(h, dim=-1)
        out = native.silu_mul(y)
        assert out.shape == (rows, h) and out.dtype == torch.float32
        torch.testing.assert_close(out.double(), torch.nn.functional.silu(gate) * up,
                                   rtol=1e-6, atol=1e-30)


def test_native_silu_mul_keeps_nan_and_checks_its_input():
    native = load_packed_kernels()
    y = torch.ones(2, 34)
    y[1, 5] = float("nan")  # a gate in the 8/16-lane body
    y[1, 16] = float("nan")  # and one in the tail
    out = native.silu_mul(y)
    assert out[1, 5].isnan() and out[1, 16].isnan() and not out[0].isnan().any()
    for bad in (torch.ones(3, 5), torch.ones(8), torch.ones(2, 8, dtype=torch.bfloat16),
                torch.ones(8, 2).t()):
        with pytest.raises(ValueError, match="silu_mul"):
            native.silu_mul(bad)


def test_silu_and_mul_without_native_is_torchs(monkeypatch):
    y = torch.randn(9, 2 * 33)
    native = gemm.silu_and_mul(y)
    # rows the native pass does not take (a column-strided view) go to torch's ops, not an error
    torch.testing.assert_close(gemm.silu_and_mul(y.t().contiguous().t()), native,
                               rtol=1e-6, atol=1e-7)
    monkeypatch.setattr(gemm, "load_packed_kernels", lambda: None)
    torch.testing.assert_close(gemm.silu_and_mul(y), native, rtol=1e-6, atol=1e-7)


def test_silu_and_mul_needs_gate_and_up_halves():
    w, _ = make_weight(QType.Q4_1, 39, 64)
    with pytest.raises(ValueError, match="even number of rows"):
        load_packed_kernels().packed_gemm_silu_mul(torch.randn(1, 64), w.data, 3)


def test_torch_fallback_without_native(monkeypatch):
    monkeypatch.setattr(gemm, "load_packed_kernels", lambda: None)
    w, ref = make_weight(QType.Q4_0, 20, 64)
    x = torch.randn(3, 64)
    torch.testing.assert_close(gemm.packed_linear(x, w), reference(x, ref), **tol(64))


def test_bad_inputs_are_value_errors():
    native = load_packed_kernels()
    w, _ = make_weight(QType.Q8_0, 8, 64)
    with pytest.raises(ValueError, match="qtype"):
        native.packed_gemm(torch.randn(2, 64), w.data, 9)  # Q8_1: no packed kernel
    with pytest.raises(ValueError, match="weight"):
        native.packed_gemm(torch.randn(2, 96), w.data, 8)  # K disagrees with the row bytes
    with pytest.raises(ValueError, match="residual"):
        native.packed_gemm(torch.randn(2, 64), w.data, 8, None, torch.randn(3, 8))
    with pytest.raises(IndexError, match="out of range"):
        native.dequantize(w.data, 8, 64, rows=torch.tensor([8]))
    with pytest.raises(ValueError, match="x must be"):
        gemm.packed_linear(torch.randn(2, 32), w)
    with pytest.raises(ValueError, match="multiple of 32"):
        PackedWeight(QType.Q8_0, torch.zeros(2, 34, dtype=torch.uint8), 33)


@pytest.mark.parametrize("m", [2, 16, 64])
def test_output_independent_of_threads(m):
    """Which thread computes which output columns depends on the thread count; the result must
    not. Bit-identical over 1, 2 and 3 threads and three calls each, for the plain GEMM
    (N = 200: a partial last panel) and the fused gate/up + SiLU, and equal to the
    dequantized reference."""
    native = load_packed_kernels()
    assert native is not None, "the packed kernels must build on this machine"
    w, ref = make_weight(QType.Q4_1, 200, 576, seed=m)
    x = torch.randn(m, 576, generator=torch.Generator().manual_seed(m))
    before = torch.get_num_threads()
    outs, fused = [], []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for _ in range(3):
                outs.append(native.packed_gemm(x, w.data, int(QType.Q4_1)))
                fused.append(native.packed_gemm_silu_mul(x, w.data, int(QType.Q4_1)))
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(outs[0], reference(x, ref), **tol(576))
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert all(torch.equal(fused[0], f) for f in fused[1:])


def test_large_expansion_is_split_over_threads_and_bit_identical():
    """A matrix above 256K weights expands on every thread (each a share of rows): at 1, 2
    and 3 threads the result is gguf-py's dequantize bit for bit."""
    native = load_packed_kernels()
    assert native is not None, "the packed kernels must build on this machine"
    w, ref = make_weight(QType.Q4_1, 1000, 576, seed=5)  # 576K weights
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            assert torch.equal(native.dequantize(w.data, int(QType.Q4_1), 576, 0, 1000), ref)
            assert torch.equal(native.dequantize(w.data, int(QType.Q4_1), 576, 100, 900),
                               ref[100:900])
    finally:
        torch.set_num_threads(before)
