"""The packed-layer path (common/models/packed_layer.py): a model whose every layer is packed
runs its small steps as native calls, with exactly the module path's results (same kernels, same
order: equal logprobs, not just close), and greedy tokens equal to the fp32 weights'."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from pdserve.common.models.packed_layer import PackedLayer
from pdserve.common.sampling_params import SamplingParams
from pdserve.tests.unit.packed_helpers import (assert_same_greedy, engine,
                                               write_tiny_llama_gguf)

H, HEADS, KV_HEADS, INTER, VOCAB = 64, 4, 2, 96, 320


def write_gguf(path) -> None:
    """Layer 0 in Q4_0, layer 1 in Q4_1 (both whole layers packed), the embedding in Q8_0."""
    rng = np.random.default_rng(1)

    def encode(hf_name, shape, heads):
        values = (rng.standard_normal(shape) * shape[1] ** -0.5).astype(np.float32)
        if heads:  # llama.cpp's q/k row order, which the loader undoes
            values = values.reshape(heads, 2, shape[0] // heads // 2, shape[1]).swapaxes(
                1, 2).reshape(shape)
        qt = QT.Q4_0 if "layers.0." in hf_name else QT.Q4_1 if "layers." in hf_name else QT.Q8_0
        return gguf.quants.quantize(values, qt), qt

    write_tiny_llama_gguf(path, (H, HEADS, KV_HEADS, INTER, VOCAB), True, encode)


def test_packed_layers_equal_the_module_path_and_fp32(tmp_path):
    write_gguf(tmp_path / "m.gguf")
    ours = engine(tmp_path / "m.gguf", True)
    model = ours.engine.model
    assert model._packed_layers is not None and len(model._packed_layers) == 2
    assert all(isinstance(p, PackedLayer) for p in model._packed_layers)
    calls = []
    layer = model._packed_layers[0]
    forward = type(layer).forward
    object.__setattr__(layer, "forward", lambda *a: calls.append(1) or forward(layer, *a))
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    prompts = [[3, 17, 42, 99, 5], [8, 1, 250, 7]]
    fast = ours.generate(prompts, params)
    assert len(calls) >= 10  # prompt steps and decode steps of the run took the path
    saved, model._packed_layers = model._packed_layers, None
    ours.engine.pool.reset_prefix_cache()
    modules = ours.generate(prompts, params)
    model._packed_layers = saved
    for a, b in zip(fast, modules):
        assert a.token_ids == b.token_ids
        assert [x.logprob for x in a.logprobs] == [x.logprob for x in b.logprobs]
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
