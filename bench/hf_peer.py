"""The Hugging Face transformers peer for benchmarks: the same weights as our engine, fp32,
batched `generate` with left padding (transformers is a dev dependency, imported lazily)."""

from __future__ import annotations

import torch


def hf_model_from_loaded(loaded):
    """A transformers Llama/Qwen2 model holding exactly our loaded weights."""
    import transformers
    c = loaded.config
    kw = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
              intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
              num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
              head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
              max_position_embeddings=c.max_position_embeddings,
              tie_word_embeddings=c.tie_word_embeddings)
    if c.rope_scaling.type != "none":
        raise ValueError("the transformers peer is built only for unscaled rope models")
    if c.qkv_bias:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
    missing, unexpected = model.load_state_dict(loaded.weights, strict=False)
    missing = [m for m in missing if not (c.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"weights do not fit transformers: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    if c.tie_word_embeddings:
        model.tie_weights()
    return model.float().eval()


@torch.inference_mode()
def hf_generate(model, prompts: list[list[int]], output_len: int,
                temperature: float = 0.0) -> torch.Tensor:
    """Exactly output_len new tokens per prompt, prompts left-padded into one batch; greedy,
    or sampled at `temperature` > 0 with no top-k / top-p (as our engine samples then)."""
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) \
        if temperature > 0 else dict(do_sample=False)
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
                         min_new_tokens=output_len, pad_token_id=0, **sampling)
    return out[:, width:]
