"""A small GGUF with Q4_0 / Q4_1 / Q8_0 matrices (and a type without a packed kernel) through the
loader and the engine with --weights packed vs fp32: the packed blocks expand to exactly the fp32
weights (Q/K rows un-permuted alike), a fused layer whose shards mix types stays packed as parts,
the fingerprint is the same, and greedy tokens are equal with logprobs equal up to summation
order. Long prompts cross quant.gemm.LARGE_M and BLOCKED_M, so every CPU path runs."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from pdserve.common.models.gguf_loader import load_gguf
from pdserve.common.models.quant.embedding import PackedEmbedding
from pdserve.common.models.quant.footprint import loaded_weights_footprint, weights_footprint
from pdserve.common.models.quant.packed import PackedWeight, QType
from pdserve.common.models.registry import expand_weights, model_fingerprint
from pdserve.common.models.quant import gemm
from pdserve.common.models.quant.cpu_native import load_packed_kernels
from pdserve.tests.unit.packed_helpers import (assert_same_greedy, blocked_m, engine,
                                               write_tiny_llama_gguf)

H, HEADS, KV_HEADS, INTER, VOCAB = 64, 4, 2, 96, 320


def storage_type(name: str) -> QT:
    """Layer 0 all Q4_0; layer 1 Q4_1 but v in Q8_0 (mixed qkv) and down in F16 (no kernel)."""
    if "layers.0." in name:
        return QT.Q4_0
    if "layers.1." in name:
        return {"v_proj": QT.Q8_0, "down_proj": QT.F16}.get(name.split(".")[-2], QT.Q4_1)
    return QT.Q8_0  # embedding and LM head


def permute(w: np.ndarray, heads: int) -> np.ndarray:  # llama.cpp's, which the loader undoes
    return w.reshape(heads, 2, w.shape[0] // heads // 2, w.shape[1]).swapaxes(1, 2).reshape(
        w.shape)


def write_gguf(path, tied: bool, vocab: int = VOCAB) -> None:
    rng = np.random.default_rng(0)

    def encode(hf_name, shape, heads):
        values = (rng.standard_normal(shape) * shape[1] ** -0.5).astype(np.float32)
        values = permute(values, heads) if heads else values
        qt = storage_type(hf_name)
        return gguf.quants.quantize(values, qt), qt

    write_tiny_llama_gguf(path, (H, HEADS, KV_HEADS, INTER, vocab), tied, encode)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_packed_blocks_expand_to_the_fp32_weights(tmp_path, tied):
    write_gguf(tmp_path / "m.gguf", tied)
    config, packed = load_gguf(tmp_path / "m.gguf", packed=True)
    _, fp32 = load_gguf(tmp_path / "m.gguf")
    assert set(packed) == set(fp32)
    kinds = {n: (w.qtype if isinstance(w, PackedWeight) else None) for n, w in packed.items()}
    assert kinds["model.layers.0.self_attn.q_proj.weight"] == QType.Q4_0
    assert kinds["model.layers.1.self_attn.v_proj.weight"] == QType.Q8_0
    assert kinds["model.layers.1.mlp.down_proj.weight"] is None  # F16: expanded at load
    expanded = expand_weights(packed)
    for name in fp32:
        assert torch.equal(expanded[name], fp32[name]), name
    assert model_fingerprint(config, packed) == model_fingerprint(config, fp32)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_engine_packed_equals_fp32(tmp_path, tied, monkeypatch):
    simd = load_packed_kernels().simd
    if gemm.BLOCKED_M[simd] is not None:  # within the test engine's 512-token step budget
        monkeypatch.setitem(gemm.BLOCKED_M, simd, 512)
    write_gguf(tmp_path / "m.gguf", tied)
    ours, ref = engine(tmp_path / "m.gguf", True), engine(tmp_path / "m.gguf", False)
    model = ours.engine.model
    layer0, layer1 = model.layers
    assert layer0.self_attn.qkv_proj.packed_weight.qtype == QType.Q4_0
    assert layer0.mlp.gate_up_proj.packed_weight.shape == (2 * INTER, H)
    qkv1 = layer1.self_attn.qkv_proj  # Q4_1 q/k with a Q8_0 v: two packed parts, no fp32
    assert qkv1.packed_weight is None and qkv1.weight is None and qkv1.packed is None
    head_dim = H // HEADS
    assert [(p.qtype, p.shape) for p in qkv1.packed_parts] == [
        (QType.Q4_1, ((HEADS + KV_HEADS) * head_dim, H)), (QType.Q8_0, (KV_HEADS * head_dim, H))]
    assert layer1.mlp.down_proj.packed_weight is None and layer1.mlp.gate_up_proj.packed_weight
    assert isinstance(model.embed_tokens, PackedEmbedding)
    assert (model.lm_head.packed_weight is model.embed_tokens.packed_weight) == tied
    fp, fp_ref = ours.engine.weights_footprint, ref.engine.weights_footprint
    assert fp.fp32_bytes == sum(w.numel() * 4 for w in expand_weights(
        load_gguf(tmp_path / "m.gguf")[1]).values())  # each weight once, as fp32
    assert fp.resident_bytes < 0.5 * fp_ref.resident_bytes
    # what the model holds (the plan's count) is what the checkpoint estimate says: the mixed
    # q/k/v stays packed as the estimate assumes
    assert fp == weights_footprint(model)
    assert fp.resident_bytes == loaded_weights_footprint(
        load_gguf(tmp_path / "m.gguf", packed=True)[1]).resident_bytes
    assert_same_greedy(ours, ref, VOCAB)
    # the packed layers share one set of oneDNN-layout buffers, used from BLOCKED_M rows on
    blocked = layer0.self_attn.qkv_proj.blocked_weights
    assert blocked is not None and layer1.mlp.gate_up_proj.blocked_weights is blocked
    assert qkv1.blocked_weights is blocked
    assert (blocked.nbytes > 0) == (blocked_m() is not None)


def test_a_device_move_keeps_the_tied_head_on_the_embeddings_blocks(tmp_path):
    """`.to(device)` applies to each packed weight in its module; the tied head is tied again
    to the moved embedding blocks, not left with a second copy (here: a clone standing in
    for the device move, which a CPU-only machine cannot make)."""
    write_gguf(tmp_path / "m.gguf", tied=True)
    model = engine(tmp_path / "m.gguf", True).engine.model
    before = model.embed_tokens.packed_weight
    model._apply(lambda t: t.clone())
    moved = model.embed_tokens.packed_weight
    assert moved is not before and moved.data.data_ptr() != before.data.data_ptr()
    assert model.lm_head.packed_weight is moved
