"""K-quant packed weights (Q2_K .. Q6_K: 256-weight super-blocks of 8 sub-blocks of 32), and
IQ4_XS (IQ4_NL's grid in the same super-blocks).

gguf-py has no quantizer for them, so the weights are random valid blocks built from bytes
(kquant_helpers.py). Checked: the torch and native expansions equal `gguf.quants.dequantize` bit
for bit; the native kernel (register path under 4 rows, panel path from 4 on, the large-M
expand + GEMM path) and the Triton kernel (interpreted) equal the fp32 GEMM of the dequantized
weight up to summation order; a tiny K-quant GGUF loads packed and greedy-decodes the tokens
the fp32 weights give.
"""

from __future__ import annotations

import gguf
import pytest
import torch

from pdserve.common.models.gguf_loader import load_gguf
from pdserve.common.models.quant import gemm
from pdserve.common.models.quant.cpu_native import load_packed_kernels
from pdserve.common.models.quant.embedding import PackedEmbedding
from pdserve.common.models.quant.packed import PackedWeight, QType
from pdserve.common.models.quant.triton_gemm import triton_packed_linear
from pdserve.common.models.registry import expand_weights, model_fingerprint
from pdserve.tests.unit.kquant_helpers import KQUANTS, make_kquant_weight, random_kquant_rows
from pdserve.tests.unit.packed_helpers import (LARGE_M, assert_same_greedy, engine, reference, tol,
                                               weights_read_one_hot, write_tiny_llama_gguf)

torch.set_num_threads(2)
IDS = dict(ids=lambda q: q.name)
# M = 1, 3: the register path; 4, 37: the panel path; N odd for the row tails
SHAPES = [(1, 1, 256), (1, 9, 512), (3, 33, 768), (4, 16, 256), (37, 70, 512)]


@pytest.mark.parametrize("qtype", KQUANTS, **IDS)
def test_torch_expansion_is_bit_identical_to_gguf(qtype):
    w, ref = make_kquant_weight(qtype, 37, 768, seed=1)
    assert torch.equal(w.dequantize(), ref)
    rows = torch.tensor([36, 0, 5, 5])
    assert torch.equal(w.dequantize(rows), ref[rows])


@pytest.mark.parametrize("qtype", KQUANTS, **IDS)
def test_native_expansion_is_bit_identical_to_gguf(qtype):
    native = load_packed_kernels()
    assert native is not None, "the packed kernels must build on this machine"
    w, ref = make_kquant_weight(qtype, 37, 768, seed=2)
    assert torch.equal(native.dequantize(w.data, int(qtype), 768, 0, 37), ref)
    assert torch.equal(native.dequantize(w.data, int(qtype), 768, 3, 9), ref[3:9])
    rows = torch.tensor([36, 0, 5, 5])
    assert torch.equal(native.dequantize(w.data, int(qtype), 768, rows=rows), ref[rows])


@pytest.mark.parametrize("qtype", KQUANTS, **IDS)
@pytest.mark.parametrize("m,n,k", SHAPES, ids=str)
def test_native_kernel_matches_fp32_gemm(qtype, m, n, k):
    native = load_packed_kernels()
    w, ref = make_kquant_weight(qtype, n, k, seed=m + n)
    g = torch.Generator().manual_seed(k)
    x = torch.randn(m, k, generator=g)
    bias, residual = torch.randn(n, generator=g), torch.randn(m, n, generator=g)
    scale = ref.abs().max().item()  # the weights run to ~100: tolerance relative to them
    t = {key: v * scale for key, v in tol(k).items()}
    torch.testing.assert_close(native.packed_gemm(x, w.data, int(qtype)), reference(x, ref), **t)
    torch.testing.assert_close(native.packed_gemm(x, w.data, int(qtype), bias, residual),
                               reference(x, ref, bias, residual), **t)


# every packed type on random blocks (subnormal fp16 scales and mins among them): the
# super-block types at K = 768, three super-blocks a row, so the few-row paths' two scale
# buffers (super_scales, computed a super-block ahead) are each refilled; the 32-weight block
# types at SmolLM2's width
EXACT = [(q, 768) for q in KQUANTS] + [(q, 576) for q in (
    QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0, QType.IQ4_NL)]


@pytest.mark.parametrize("qtype,k", EXACT, ids=lambda v: getattr(v, "name", v))
@pytest.mark.parametrize("m", [1, 2, 3, 5])
def test_native_gemm_reads_each_weight_exactly(qtype, k, m):
    """Every weight read back through one-hot activations (weights_read_one_hot) gives gguf-py's
    value bit for bit, not just within a summation-order tolerance: at M = 1, 2, 3 the few-row
    paths (on AVX-512 the table lookups: 16 entries for Q4_0 / Q4_1 / IQ4_NL / IQ4_XS / Q4_K,
    32 for Q5_0 / Q5_1 / Q5_K), at M = 5 the panel path's expansion."""
    w, ref = make_kquant_weight(qtype, 37, k, seed=m)
    assert torch.equal(weights_read_one_hot(load_packed_kernels(), w, m), ref)


@pytest.mark.parametrize("qtype", KQUANTS, **IDS)
def test_dispatch_large_m_path(monkeypatch, qtype):
    monkeypatch.setattr(gemm, "EXPAND_BYTES", 64 * 4 * 256)  # large M tiles N = 150
    w, ref = make_kquant_weight(qtype, 150, 256, seed=3)
    x = torch.randn(LARGE_M, 256, generator=torch.Generator().manual_seed(0))
    t = {key: v * ref.abs().max().item() for key, v in tol(256).items()}
    torch.testing.assert_close(gemm.packed_linear(x, w), reference(x, ref), **t)


@pytest.mark.parametrize("qtype", KQUANTS, **IDS)
@pytest.mark.parametrize("m,n", [(1, 5), (17, 9)], ids=str)
def test_triton_interpreted_matches_fp32_gemm(qtype, m, n):
    w, ref = make_kquant_weight(qtype, n, 512, seed=m * n)
    g = torch.Generator().manual_seed(m)
    x, bias = torch.randn(m, 512, generator=g), torch.randn(n, generator=g)
    t = {key: v * ref.abs().max().item() for key, v in tol(512).items()}
    torch.testing.assert_close(triton_packed_linear(x, w, bias), reference(x, ref, bias), **t)


def test_kquant_width_must_be_whole_super_blocks():
    with pytest.raises(ValueError, match="multiple of 256"):
        PackedWeight(QType.Q4_K, torch.zeros(2, 18, dtype=torch.uint8), 32)
    native = load_packed_kernels()
    w, _ = make_kquant_weight(QType.Q6_K, 4, 256)
    with pytest.raises(ValueError, match="multiple of 256"):
        native.packed_gemm(torch.randn(2, 32), w.data[:, :18].contiguous(), int(QType.Q6_K))
    with pytest.raises(ValueError, match="weight"):
        native.packed_gemm(torch.randn(2, 512), w.data, int(QType.Q6_K))


# --- a tiny Q4_K_M-like GGUF through the loader and the engine ---------------------------------
H, HEADS, KV_HEADS, INTER, VOCAB = 256, 4, 2, 512, 320
# rough |weight| per unit of the fp16 scale, to give every type weights ~ 1 / sqrt(K)
_SPREAD = {QType.Q2_K: 18.0, QType.Q3_K: 38.0, QType.Q4_K: 300.0, QType.Q5_K: 600.0,
           QType.Q6_K: 1500.0, QType.IQ4_XS: 800.0}


def storage_type(name: str) -> QType:
    """Layer 0: Q4_K, v and down Q6_K (as Q4_K_M files mix them), o Q3_K; layer 1: Q5_K,
    o IQ4_XS, gate / up Q2_K, down Q6_K; embedding Q6_K, LM head Q4_K."""
    part = name.split(".")[-2]
    if part == "o_proj" and "layers.1." in name:
        return QType.IQ4_XS
    if part == "down_proj" or part == "embed_tokens" or (part == "v_proj" and "layers.0." in name):
        return QType.Q6_K
    if part == "o_proj" and "layers.0." in name:
        return QType.Q3_K
    if part in ("gate_proj", "up_proj") and "layers.1." in name:
        return QType.Q2_K
    return QType.Q5_K if "layers.1." in name and part in ("q_proj", "k_proj", "v_proj",
                                                          "o_proj") else QType.Q4_K


def write_kquant_gguf(path, tied: bool) -> None:
    seeds = iter(range(1000))

    def encode(hf_name, shape, heads):  # random rows: no permutation to undo at write time
        qt = storage_type(hf_name)
        rows = random_kquant_rows(qt, shape[0], shape[1], next(seeds),
                                  scale=shape[1] ** -0.5 / _SPREAD[qt])
        return rows, gguf.GGMLQuantizationType(int(qt))

    write_tiny_llama_gguf(path, (H, HEADS, KV_HEADS, INTER, VOCAB), tied, encode)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_kquant_gguf_loads_packed_and_decodes_like_fp32(tmp_path, tied):
    write_kquant_gguf(tmp_path / "m.gguf", tied)
    config, packed = load_gguf(tmp_path / "m.gguf", packed=True)
    _, fp32 = load_gguf(tmp_path / "m.gguf")
    for name, wt in packed.items():
        if name.endswith("proj.weight") or "embed" in name or "lm_head" in name:
            assert isinstance(wt, PackedWeight) and wt.qtype == storage_type(name), name
    expanded = expand_weights(packed)
    for name in fp32:
        assert torch.equal(expanded[name], fp32[name]), name
    assert model_fingerprint(config, packed) == model_fingerprint(config, fp32)

    ours, ref = engine(tmp_path / "m.gguf", True), engine(tmp_path / "m.gguf", False)
    model = ours.engine.model
    layer0, layer1 = model.layers
    assert layer0.mlp.gate_up_proj.packed_weight.qtype == QType.Q4_K
    assert layer0.mlp.down_proj.packed_weight.qtype == QType.Q6_K
    assert layer1.self_attn.qkv_proj.packed_weight.qtype == QType.Q5_K
    assert layer0.self_attn.o_proj.packed_weight.qtype == QType.Q3_K
    assert layer1.self_attn.o_proj.packed_weight.qtype == QType.IQ4_XS
    assert layer1.mlp.gate_up_proj.packed_weight.qtype == QType.Q2_K
    qkv0 = layer0.self_attn.qkv_proj  # Q4_K q/k with a Q6_K v, as a Q4_K_M file: two parts
    assert qkv0.weight is None and [p.qtype for p in qkv0.packed_parts] == [QType.Q4_K,
                                                                            QType.Q6_K]
    # small steps still run every layer natively, layer 0's v as its qkv's tail
    assert model._packed_stack is not None
    assert model._packed_layers[0].qkv_tail.qtype == int(QType.Q6_K)
    assert isinstance(model.embed_tokens, PackedEmbedding)
    assert model.embed_tokens.packed_weight.qtype == QType.Q6_K
    head = model.lm_head.packed_weight
    assert (head is model.embed_tokens.packed_weight) if tied else head.qtype == QType.Q4_K
    assert ours.engine.weights_footprint.resident_bytes < (
        0.5 * ref.engine.weights_footprint.resident_bytes)
    assert_same_greedy(ours, ref, VOCAB)
