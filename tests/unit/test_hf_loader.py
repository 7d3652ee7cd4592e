"""HF directory loader (and the registry that routes names to loaders)."""

import json
import subprocess
import sys

import pytest
import torch

from pdserve.common.models.hf_loader import config_from_hf, load_hf_dir
from pdserve.common.models.registry import load_model, resolve_model

torch.set_num_threads(1)

_SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def _save(model, path, dtype=torch.float32):
    model.to(dtype).save_pretrained(path)
    return {k: v.float() for k, v in model.state_dict().items()}


def test_llama_bf16_dir_loads_as_fp32(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**_SMALL, tie_word_embeddings=False, rms_norm_eps=1e-5,
                                         bos_token_id=1, eos_token_id=[2, 3]))
    expected = _save(model, tmp_path, torch.bfloat16)
    config, weights = load_hf_dir(tmp_path)
    assert set(weights) == set(expected)
    for name, tensor in weights.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, expected[name]), name
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (2, 4, 2)
    assert config.head_dim == 8
    assert config.rms_norm_eps == 1e-5 and config.eos_token_ids == (2, 3)
    assert not config.tie_word_embeddings and not config.qkv_bias


def test_qwen2_tied_dir(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**_SMALL, tie_word_embeddings=True))
    expected = _save(model, tmp_path)
    config, weights = load_hf_dir(tmp_path)
    assert config.architecture == "qwen2" and config.qkv_bias and config.tie_word_embeddings
    assert "lm_head.weight" not in weights
    assert "model.layers.1.self_attn.k_proj.bias" in weights
    for name, tensor in weights.items():
        assert torch.equal(tensor, expected[name]), name


@pytest.mark.parametrize("rope_key", ["rope_scaling", "rope_parameters"])
def test_llama3_rope_scaling(rope_key):
    rope = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    if rope_key == "rope_parameters":  # transformers >= 5 nests rope_theta here
        rope["rope_theta"] = 500000.0
    cfg = {"model_type": "llama", **_SMALL, rope_key: rope, "rope_theta": 500000.0}
    scaling = config_from_hf(cfg).rope_scaling
    assert (scaling.type, scaling.factor, scaling.original_max_position) == ("llama3", 32.0, 8192)
    assert config_from_hf(cfg).rope_theta == 500000.0


def test_linear_rope_scaling_old_style():
    cfg = {"model_type": "llama", **_SMALL, "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert config_from_hf(cfg).rope_scaling.factor == 2.0


def test_unsupported_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", **_SMALL}))
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        load_hf_dir(tmp_path)


def test_hf_dir_through_registry(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM
    from pdserve.common.tokenizer import Tokenizer
    LlamaForCausalLM(LlamaConfig(**{**_SMALL, "vocab_size": 320}, bos_token_id=317,
                                 eos_token_id=319)).save_pretrained(tmp_path)
    # any tokenizer.json will do; build one from the tiny tokenizer
    Tokenizer.tiny().backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>",
         "chat_template": "{{ messages[0]['content'] }}"}))
    assert resolve_model(str(tmp_path)) == tmp_path
    loaded = load_model(str(tmp_path))
    assert loaded.tokenizer.eos_token_ids == (319,) and loaded.tokenizer.bos_token_id == 317
    assert loaded.tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "x"
    assert len(loaded.fingerprint) == 64


def test_unknown_model_path_names_it(tmp_path):
    missing = str(tmp_path / "nope.gguf")
    with pytest.raises(ValueError, match="unknown model.*nope.gguf"):
        resolve_model(missing)
    with pytest.raises(ValueError, match="unknown model 'llama-9000'"):
        load_model("llama-9000")


def test_tiny_model_is_seeded_and_fingerprinted():
    a, b, c = load_model("tiny", 0), load_model("tiny", 0), load_model("tiny", 1)
    assert a.config.vocab_size == a.tokenizer.vocab_size == 320
    assert a.fingerprint == b.fingerprint != c.fingerprint
    assert all(torch.equal(a.weights[k], b.weights[k]) for k in a.weights)
    # same fingerprint in a fresh process: nothing depends on Python's hash() or thread count
    code = ("import torch; torch.set_num_threads(1); from pdserve.common.models.registry import "
            "load_model; print(load_model('tiny', 0).fingerprint)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == a.fingerprint


def test_fingerprint_sees_config_and_weights():
    from pdserve.common.models.registry import model_fingerprint
    tiny = load_model("tiny", 0)
    changed = dict(tiny.weights)
    changed["model.norm.weight"] = changed["model.norm.weight"] + 1
    assert model_fingerprint(tiny.config, changed) != tiny.fingerprint
    assert model_fingerprint(tiny.config.replace(rope_theta=5e5), tiny.weights) != tiny.fingerprint
