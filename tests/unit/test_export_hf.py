"""bench/export_hf.py: a model exported as a Hugging Face directory reads back through our own
HF loader with the same weights, config and tokenizer (what vLLM's server is given in
bench/vllm_reference.sh)."""

import torch

from pdserve.bench.export_hf import export
from pdserve.common.models.hf_loader import load_hf_dir
from pdserve.common.models.registry import load_model
from pdserve.common.tokenizer import Tokenizer

torch.set_num_threads(1)


def test_tiny_model_round_trips_through_the_hf_directory(tmp_path):
    export("tiny", tmp_path)
    ours = load_model("tiny", weights="fp32")
    config, weights = load_hf_dir(tmp_path)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.vocab_size) == (
        ours.config.num_layers, ours.config.num_heads, ours.config.num_kv_heads,
        ours.config.vocab_size)
    assert config.eos_token_ids == ours.tokenizer.eos_token_ids
    assert set(weights) >= {k for k in ours.weights if k != "lm_head.weight"}
    for name, tensor in ours.weights.items():
        if name in weights:
            assert torch.equal(weights[name], tensor.float()), name
    tok = Tokenizer.from_hf_dir(tmp_path)
    text = "hello world, 123"
    assert tok.encode(text) == ours.tokenizer.encode(text)
    assert tok.bos_token_id == ours.tokenizer.bos_token_id
