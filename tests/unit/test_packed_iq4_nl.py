"""IQ4_NL (what llama.cpp's IQ4_XS files hold for rows narrower than 256): the
benchmark quantizers (IQ4_NL, IQ4_XS) write blocks gguf-py reads back close to the values, and a
GGUF whose every matrix is IQ4_NL (the tied embedding and LM head too) stays packed through the
loader and the engine, with the same greedy tokens (logprobs up to summation order) as its
weights expanded to fp32. The kernels' bit-exactness against gguf-py is in test_packed_gemm /
test_packed_blocked / test_packed_triton (IQ4_NL among their types) and test_packed_kquants
(IQ4_XS among the super-block types)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from pdserve.bench.iq4_quant import IQ4_GRID, quantize_iq4_nl, quantize_iq4_xs
from pdserve.common.models.gguf_loader import load_gguf
from pdserve.common.models.quant import gemm
from pdserve.common.models.quant.cpu_native import load_packed_kernels
from pdserve.common.models.quant.embedding import PackedEmbedding
from pdserve.common.models.quant.packed import PackedWeight, QType
from pdserve.common.models.registry import expand_weights
from pdserve.common.sampling_params import SamplingParams
from pdserve.tests.unit.packed_helpers import (assert_same_greedy, engine,
                                               write_tiny_llama_gguf)
from pdserve.tests.unit.test_packed_layer import assert_equals_module_path

H, HEADS, KV_HEADS, INTER, VOCAB = 64, 4, 2, 96, 320


def test_quantizer_round_trips_through_gguf_py():
    x = np.random.default_rng(0).standard_normal((16, 256)).astype(np.float32)
    x[3, 32:64] = 0.0  # an all-zero block stays zero
    q = quantize_iq4_nl(x)
    assert q.dtype == np.uint8 and q.shape == (16, 256 // 32 * 18)
    back = gguf.quants.dequantize(q, QT.IQ4_NL)
    assert np.all(back[3, 32:64] == 0.0)
    # each element is d * a grid level
    d = q.reshape(16, 8, 18)[..., :2].copy().view(np.float16).astype(np.float32)  # [16, 8, 1]
    levels = back.reshape(16, 8, 32) / np.where(d == 0, 1, d)
    assert np.all(np.isin(levels[d[..., 0] != 0], IQ4_GRID))
    # no worse than Q4_0 (same bits per weight) on Gaussian values
    q4 = gguf.quants.dequantize(gguf.quants.quantize(x, QT.Q4_0), QT.Q4_0)
    assert np.mean((back - x) ** 2) < np.mean((q4 - x) ** 2)


def write_gguf(path) -> None:
    rng = np.random.default_rng(1)

    def encode(hf_name, shape, heads):  # every matrix IQ4_NL, the tied embedding and head too
        values = (rng.standard_normal(shape) * shape[1] ** -0.5).astype(np.float32)
        return quantize_iq4_nl(values), QT.IQ4_NL

    write_tiny_llama_gguf(path, (H, HEADS, KV_HEADS, INTER, VOCAB), True, encode)


def test_iq4_nl_blocks_load_packed_and_expand_to_the_fp32_weights(tmp_path):
    write_gguf(tmp_path / "m.gguf")
    _, packed = load_gguf(tmp_path / "m.gguf", packed=True)
    _, fp32 = load_gguf(tmp_path / "m.gguf")
    linears = [n for n in packed if "norm" not in n]
    assert len(linears) == 15  # 7 per layer and the embedding
    assert all(isinstance(packed[n], PackedWeight) and packed[n].qtype == QType.IQ4_NL
               for n in linears)
    expanded = expand_weights(packed)
    for name in fp32:
        assert torch.equal(expanded[name], fp32[name]), name


def test_engine_iq4_nl_packed_equals_fp32(tmp_path, monkeypatch):
    simd = load_packed_kernels().simd
    if gemm.BLOCKED_M[simd] is not None:  # within the test engine's 512-token step budget
        monkeypatch.setitem(gemm.BLOCKED_M, simd, 512)
    write_gguf(tmp_path / "m.gguf")
    ours, ref = engine(tmp_path / "m.gguf", True), engine(tmp_path / "m.gguf", False)
    layer = ours.engine.model.layers[0]
    assert layer.self_attn.qkv_proj.packed_weight.qtype == QType.IQ4_NL
    assert layer.mlp.down_proj.packed_weight.qtype == QType.IQ4_NL
    model = ours.engine.model
    assert isinstance(model.embed_tokens, PackedEmbedding)  # rows looked up from IQ4_NL blocks
    assert model.lm_head.packed_weight is model.embed_tokens.packed_weight
    assert (ours.engine.weights_footprint.resident_bytes
            < 0.5 * ref.engine.weights_footprint.resident_bytes)
    assert_same_greedy(ours, ref, VOCAB)


@pytest.mark.parametrize("batch", [1, 3])
def test_native_decode_path_equals_the_module_path(tmp_path, batch):
    """Every layer packed in IQ4_NL: small decode steps run the native whole-stack call, with
    logprobs equal to the module path's."""
    write_gguf(tmp_path / "m.gguf")
    ours = engine(tmp_path / "m.gguf", True)
    model = ours.engine.model
    assert model._packed_layers is not None and model._packed_stack is not None
    prompts = [[(5 * i + 11 * j) % (VOCAB - 1) + 1 for i in range(4 + 9 * j)]
               for j in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    assert_equals_module_path(ours, prompts, params, ours.generate(prompts, params))


def test_iq4_xs_quantizer_round_trips_through_gguf_py():
    x = np.random.default_rng(2).standard_normal((8, 512)).astype(np.float32)
    x[1, 256:] = 0.0  # an all-zero super-block stays zero
    x[2, 32:64] *= 40.0  # sub-block scales far apart use the 6-bit range
    q = quantize_iq4_xs(x)
    assert q.dtype == np.uint8 and q.shape == (8, 2 * 136)
    back = gguf.quants.dequantize(q, QT.IQ4_XS)
    assert np.all(back[1, 256:] == 0.0)
    q4 = gguf.quants.dequantize(gguf.quants.quantize(x, QT.Q4_0), QT.Q4_0)
    assert np.mean((back - x) ** 2) < np.mean((q4 - x) ** 2)
    assert np.max(np.abs(back[2, 32:64] - x[2, 32:64])) < 0.1 * np.max(np.abs(x[2, 32:64]))


def test_quantizers_want_whole_blocks():
    with pytest.raises(ValueError, match="32-weight blocks"):
        quantize_iq4_nl(np.zeros((2, 48), np.float32))
    with pytest.raises(ValueError, match="256-weight blocks"):
        quantize_iq4_xs(np.zeros((2, 288), np.float32))


def test_quantizers_refuse_what_an_fp16_scale_cannot_hold():
    x = np.random.default_rng(3).standard_normal((1, 256)).astype(np.float32)
    for quantize in (quantize_iq4_nl, quantize_iq4_xs):
        with pytest.raises(ValueError, match="fp16 block scale"):
            quantize(x * 3e8)
        with pytest.raises(ValueError, match="finite"):
            quantize(np.where(x > 1, np.nan, x).astype(np.float32))
