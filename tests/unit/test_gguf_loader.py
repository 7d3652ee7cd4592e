"""GGUF loader: SmolLM2 weights equal transformers' exactly; small written GGUFs round-trip."""

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from pdserve.common.models.gguf_loader import load_gguf
from pdserve.common.models.registry import resolve_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def smollm2_path() -> Path:
    return resolve_model("smollm2")


@pytest.fixture(scope="module")
def ours(smollm2_path):
    return load_gguf(smollm2_path)


def test_smollm2_weights_equal_transformers(ours, hf_smollm2):
    config, weights = ours
    hf = hf_smollm2.state_dict()
    assert config.tie_word_embeddings and "lm_head.weight" not in weights
    assert set(hf) - {"lm_head.weight"} == set(weights)
    for name, tensor in weights.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, hf[name]), name


def test_smollm2_config_matches_transformers(ours, hf_smollm2):
    config, _ = ours
    hc = hf_smollm2.config
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (
        hc.vocab_size, hc.hidden_size, hc.intermediate_size)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (
        hc.num_hidden_layers, hc.num_attention_heads, hc.num_key_value_heads, hc.head_dim)
    assert config.rms_norm_eps == hc.rms_norm_eps
    assert config.rope_theta == hc.rope_parameters["rope_theta"]
    assert config.rope_scaling.type == "none"
    assert config.max_position_embeddings == hc.max_position_embeddings
    assert config.tie_word_embeddings == hc.tie_word_embeddings
    assert (config.bos_token_id, config.eos_token_ids) == (hc.bos_token_id, (hc.eos_token_id,))
    assert config.architecture == "llama" and not config.qkv_bias


# ---- round trip through gguf.GGUFWriter --------------------------------------------------------

H, HEADS, KV_HEADS, INTER, VOCAB, LAYERS = 64, 4, 2, 96, 128, 2


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's `permute` (what the loader must undo)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, -1, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_weights(rng, arch: str, tied: bool) -> dict[str, np.ndarray]:
    def r(*shape):
        return rng.standard_normal(shape).astype(np.float32)
    hd = H // HEADS
    w = {"model.embed_tokens.weight": r(VOCAB, H), "model.norm.weight": r(H)}
    if not tied:
        w["lm_head.weight"] = r(VOCAB, H)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w |= {p + "self_attn.q_proj.weight": r(H, H),
              p + "self_attn.k_proj.weight": r(KV_HEADS * hd, H),
              p + "self_attn.v_proj.weight": r(KV_HEADS * hd, H),
              p + "self_attn.o_proj.weight": r(H, H),
              p + "mlp.gate_proj.weight": r(INTER, H), p + "mlp.up_proj.weight": r(INTER, H),
              p + "mlp.down_proj.weight": r(H, INTER), p + "input_layernorm.weight": r(H),
              p + "post_attention_layernorm.weight": r(H)}
        if arch == "qwen2":
            w |= {p + "self_attn.q_proj.bias": r(H), p + "self_attn.k_proj.bias": r(KV_HEADS * hd),
                  p + "self_attn.v_proj.bias": r(KV_HEADS * hd)}
    return w


_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
            "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
            "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
            "post_attention_layernorm": "ffn_norm"}


def _gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_TO_GGUF[module]}.{kind}"


def _encode(name: str, w: np.ndarray, index: int):
    """Spread F32 / F16 / Q8_0 over the 2-D tensors; return (payload, expected after load)."""
    if w.ndim == 1 or index % 3 == 0:
        return w, w
    if index % 3 == 1:
        return w.astype(np.float16), w.astype(np.float16).astype(np.float32)
    q = gguf.quants.quantize(w, QT.Q8_0)
    return q, gguf.quants.dequantize(q, QT.Q8_0)


def _write(path, arch, weights, extra_meta=None, permute=True):
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(H)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(VOCAB)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for key_fn, value in (extra_meta or {}).items():
        getattr(writer, key_fn)(value)
    expected = {}
    for index, (name, w) in enumerate(sorted(weights.items())):
        heads = HEADS if "q_proj" in name else KV_HEADS
        permuted = permute and arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight"))
        payload, back = _encode(name, _llama_cpp_permute(w, heads) if permuted else w, index)
        writer.add_tensor(_gguf_name(name), payload,
                          raw_dtype=QT.Q8_0 if payload.dtype == np.uint8 else None)
        expected[name] = _unpermute(back, heads) if permuted else back
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.mark.parametrize("arch,tied", [("llama", True), ("llama", False), ("qwen2", True)])
def test_roundtrip(tmp_path, arch, tied):
    hf = _hf_weights(np.random.default_rng(0), arch, tied)
    expected = _write(tmp_path / "m.gguf", arch, hf)
    config, weights = load_gguf(tmp_path / "m.gguf")
    assert set(weights) == set(hf)
    for name, want in expected.items():
        assert np.array_equal(weights[name].numpy(), want), name
    # Whatever the storage type, every tensor is back in HF layout, close to the original.
    for name, w in hf.items():
        assert np.allclose(weights[name].numpy(), w, atol=0.05, rtol=0.01), name
    assert config.architecture == arch and config.qkv_bias == (arch == "qwen2")
    assert config.tie_word_embeddings == tied
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (
        LAYERS, H, HEADS, KV_HEADS)
    assert (config.rope_theta, config.rms_norm_eps, config.vocab_size) == (50000.0,
                                                                          pytest.approx(1e-6), VOCAB)
    assert config.eos_token_ids == (2,) and config.bos_token_id == 1


def test_linear_rope_scaling(tmp_path):
    hf = _hf_weights(np.random.default_rng(1), "llama", True)
    _write(tmp_path / "m.gguf", "llama", hf,
           {"add_rope_scaling_type": gguf.RopeScalingType.LINEAR, "add_rope_scaling_factor": 4.0})
    config, _ = load_gguf(tmp_path / "m.gguf")
    assert (config.rope_scaling.type, config.rope_scaling.factor) == ("linear", 4.0)


def test_unknown_architecture_is_rejected(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "mamba")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="architecture 'mamba'"):
        load_gguf(tmp_path / "m.gguf")


def test_unsupported_tensor_type_is_rejected(tmp_path):
    hf = _hf_weights(np.random.default_rng(2), "llama", True)
    hf["model.norm.weight"] = np.arange(H, dtype=np.int8)  # stored as ggml I8
    _write(tmp_path / "m.gguf", "llama", hf)
    with pytest.raises(ValueError, match="output_norm.weight.*unsupported type I8"):
        load_gguf(tmp_path / "m.gguf")
