"""The packed-layer path (common/models/packed_layer.py): a model whose every layer is packed
runs its small steps as native calls, with exactly the module path's results (same kernels, same
order: equal logprobs, not just close), and greedy tokens equal to the fp32 weights'."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from pdserve.common.models.packed_layer import DecodeStep, PackedLayer
from pdserve.common.sampling_params import SamplingParams
from pdserve.tests.unit.packed_helpers import (assert_same_greedy, engine,
                                               write_tiny_llama_gguf)

H, HEADS, KV_HEADS, INTER, VOCAB = 64, 4, 2, 96, 320


def write_gguf(path, v_tail: bool = False) -> None:
    """Layer 0 in Q4_0, layer 1 in Q4_1 (both whole layers packed), the embedding in Q8_0.
    `v_tail`: layer 0's v in Q8_0, so its qkv is two parts (a Q4_0 head, a Q8_0 tail)."""
    rng = np.random.default_rng(1)

    def encode(hf_name, shape, heads):
        values = (rng.standard_normal(shape) * shape[1] ** -0.5).astype(np.float32)
        if heads:  # llama.cpp's q/k row order, which the loader undoes
            values = values.reshape(heads, 2, shape[0] // heads // 2, shape[1]).swapaxes(
                1, 2).reshape(shape)
        qt = QT.Q4_0 if "layers.0." in hf_name else QT.Q4_1 if "layers." in hf_name else QT.Q8_0
        if v_tail and hf_name.endswith("layers.0.self_attn.v_proj.weight"):
            qt = QT.Q8_0
        return gguf.quants.quantize(values, qt), qt

    write_tiny_llama_gguf(path, (H, HEADS, KV_HEADS, INTER, VOCAB), True, encode)


def assert_equals_module_path(ours, prompts, params, fast) -> None:
    """The same run through the module path gives the same tokens and EQUAL logprobs."""
    model = ours.engine.model
    saved, model._packed_layers = model._packed_layers, None
    ours.engine.pool.reset_prefix_cache()
    modules = ours.generate(prompts, params)
    model._packed_layers = saved
    for a, b in zip(fast, modules):
        assert a.token_ids == b.token_ids
        assert [x.logprob for x in a.logprobs] == [x.logprob for x in b.logprobs]


@pytest.mark.parametrize("v_tail", [False, True], ids=["uniform", "v-tail"])
def test_packed_layers_equal_the_module_path_and_fp32(tmp_path, v_tail):
    write_gguf(tmp_path / "m.gguf", v_tail)
    ours = engine(tmp_path / "m.gguf", True)
    model = ours.engine.model
    assert model._packed_layers is not None and len(model._packed_layers) == 2
    assert all(isinstance(p, PackedLayer) for p in model._packed_layers)
    tail = model._packed_layers[0].qkv_tail
    assert (tail is not None and tail.data.shape[0] == KV_HEADS * H // HEADS) == v_tail
    assert model._packed_layers[1].qkv_tail is None
    model._packed_stack = None  # decode steps layer by layer too (test_packed_stack.py)
    calls = []
    layer = model._packed_layers[0]
    forward = type(layer).forward
    object.__setattr__(layer, "forward",
                       lambda *a, **kw: calls.append(1) or forward(layer, *a, **kw))
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    prompts = [[3, 17, 42, 99, 5], [8, 1, 250, 7]]
    fast = ours.generate(prompts, params)
    assert len(calls) >= 10  # prompt steps and decode steps of the run took the path
    assert_equals_module_path(ours, prompts, params, fast)
    assert_same_greedy(ours, engine(tmp_path / "m.gguf", False), VOCAB)


def test_packed_layer_rejects_inconsistent_shapes(tmp_path):
    write_gguf(tmp_path / "m.gguf")
    layer = engine(tmp_path / "m.gguf", True).engine.model._packed_layers[0]
    with pytest.raises(ValueError, match="multiple of num_heads"):
        PackedLayer(layer.ln1, layer.ln2, layer.eps, layer.qkv, layer.o, layer.gate_up,
                    layer.down, num_heads=5, q_size=layer.q_size, scale=layer.scale)
    with pytest.raises(ValueError, match="one \\[hidden\\] shape"):
        PackedLayer(layer.ln1, layer.ln2[:8], layer.eps, layer.qkv, layer.o, layer.gate_up,
                    layer.down, num_heads=layer.num_heads, q_size=layer.q_size,
                    scale=layer.scale)


@pytest.mark.parametrize("v_tail", [False, True], ids=["uniform", "v-tail"])
@pytest.mark.parametrize("batch", [1, 3])
def test_one_call_layer_equals_the_module_path(tmp_path, batch, v_tail):
    """Steps of 1 or 3 decodes run each layer as one native call (packed_decode_layer), with
    logprobs equal to the module path's, over contexts that cross cache blocks; with a qkv
    tail the kernel writes each part's columns as the module path's part-by-part GEMMs."""
    write_gguf(tmp_path / "m.gguf", v_tail)
    ours = engine(tmp_path / "m.gguf", True)
    model = ours.engine.model
    model._packed_stack = None  # one call per layer, not the whole stack (test_packed_stack.py)
    calls = []
    for layer in model._packed_layers:
        one_call = type(layer)._decode
        object.__setattr__(layer, "_decode", lambda *a, layer=layer, f=one_call:
                           calls.append(len(a[2])) or f(layer, *a))
    prompts = [[(5 * i + 11 * j) % (VOCAB - 1) + 1 for i in range(4 + 9 * j)]
               for j in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
    fast = ours.generate(prompts, params)
    assert len(calls) >= 2 * 39 and max(calls) == batch  # both layers, every decode step
    assert_equals_module_path(ours, prompts, params, fast)


def test_decode_step_only_for_a_few_decodes():
    cos = torch.zeros(2, 1, 8)
    tables, lens = torch.zeros(2, 3, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    slots = torch.zeros(2, dtype=torch.int64)
    step = DecodeStep.of(2, 2, 2, 4, (cos, cos), slots, tables, lens)
    assert step is not None and step.cos.shape == (2, 8)
    assert DecodeStep.of(2, 1, 2, 4, (cos, cos), slots, tables, lens) is None  # a prefill
    assert DecodeStep.of(2, 2, 2, 2, (cos, cos), slots, tables, lens) is None  # too many rows
    assert DecodeStep.of(2, 2, 2, 4, (cos, cos), slots.int(), tables, lens) is None
    with pytest.raises(ValueError, match="disagree"):
        DecodeStep(cos[:, 0], cos[:, 0], slots, tables, lens[:1])


def test_one_call_layer_rejects_bad_metadata(tmp_path):
    write_gguf(tmp_path / "m.gguf")
    model = engine(tmp_path / "m.gguf", True).engine.model
    layer, gemm = model._packed_layers[0], model._packed_gemm
    d = H // HEADS
    cache = torch.zeros(2, 4, 16, KV_HEADS, d)
    cos = torch.ones(1, d)
    x = torch.randn(1, H)
    tables, lens = torch.zeros(1, 2, dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    ok = layer.forward(gemm, None, None, x, cache,
                       DecodeStep(cos, cos, torch.tensor([2]), tables, lens))
    assert ok.shape == (1, H) and torch.isfinite(ok).all()
    with pytest.raises(ValueError, match="slot_mapping"):
        layer.forward(gemm, None, None, x, cache,
                      DecodeStep(cos, cos, torch.tensor([64]), tables, lens))
    with pytest.raises(ValueError, match="outside the cache"):
        layer.forward(gemm, None, None, x, cache,
                      DecodeStep(cos, cos, torch.tensor([2]), tables + 9, lens))
    with pytest.raises(ValueError, match="1 <= T <"):
        layer.forward(gemm, None, None, torch.randn(4, H), cache,
                      DecodeStep(cos.expand(4, d).contiguous(), cos.expand(4, d).contiguous(),
                                 torch.tensor([2, 3, 4, 5]), tables.expand(4, 2).contiguous(),
                                 lens.expand(4).contiguous()))


def test_one_call_layer_rejects_a_bad_qkv_tail(tmp_path):
    write_gguf(tmp_path / "m.gguf", v_tail=True)
    model = engine(tmp_path / "m.gguf", True).engine.model
    layer, gemm = model._packed_layers[0], model._packed_gemm
    d = H // HEADS
    cache = torch.zeros(2, 4, 16, KV_HEADS, d)
    step = DecodeStep(torch.ones(1, d), torch.ones(1, d), torch.tensor([2]),
                      torch.zeros(1, 2, dtype=torch.int32), torch.tensor([3], dtype=torch.int32))
    x = torch.randn(1, H)
    assert torch.isfinite(layer.forward(gemm, None, None, x, cache, step)).all()
    tail = layer.qkv_tail
    short = dataclasses.replace(tail, data=tail.data[:-1])  # v one row short of k
    with pytest.raises(ValueError, match="equal k and v rows"):
        dataclasses.replace(layer, qkv_tail=short)
    with pytest.raises(ValueError, match="equal k and v rows"):  # no k and v rows at all
        dataclasses.replace(layer, qkv=dataclasses.replace(layer.qkv, data=layer.qkv.data[:64]),
                            qkv_tail=None)
    whole = dataclasses.replace(tail, data=torch.cat([layer.qkv.data] * 2))  # no head rows left
    with pytest.raises(ValueError, match="qkv tail must have"):
        dataclasses.replace(layer, qkv_tail=whole).forward(gemm, None, None, x, cache, step)
