"""Our decoder against transformers on small random models of each variant we claim:
Llama with llama3 and linear rope scaling, tied and untied embeddings, and Qwen2 (QKV bias).
Same weights through our HF-directory loader; greedy tokens must be equal."""

import pytest
import torch

from pdserve.common.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.common.engine.llm import LLM
from pdserve.common.models.hf_loader import load_hf_dir
from pdserve.common.models.registry import LoadedModel, model_fingerprint
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
VARIANTS = {
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM", dict(rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}, rope_theta=500000.0)),
    "linear-rope": ("LlamaConfig", "LlamaForCausalLM",
                    dict(rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_equals_transformers(variant, tmp_path):
    torch.manual_seed(0)
    cfg_cls, model_cls, extra = VARIANTS[variant]
    cfg = getattr(transformers, cfg_cls)(**BASE, **extra)
    hf = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():  # make outputs depend on every weight, biases included
        for p in hf.parameters():
            p.normal_(0, 0.3 if p.dim() > 1 else 0.5)
    hf.save_pretrained(tmp_path)
    config, weights = load_hf_dir(tmp_path)
    assert config.qkv_bias == (variant == "qwen2")
    loaded = LoadedModel(config, weights, Tokenizer.tiny(), model_fingerprint(config, weights))
    llm = LLM(EngineConfig(model="tiny", num_threads=1, cache=CacheConfig(num_blocks=64),
                           scheduler=SchedulerConfig(max_num_batched_tokens=16)), loaded=loaded)
    prompts = [[3, 17, 42, 99, 5], list(range(30, 70))]  # the long one is chunked
    ours = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for ids, out in zip(prompts, ours):
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        assert out.token_ids == ref, variant
