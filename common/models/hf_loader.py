"""Load a Hugging Face model directory (`config.json` + `*.safetensors`): config + fp32 weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from pdserve.common.config import ModelConfig, RopeScaling

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


def load_hf_dir(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    path = Path(path)
    config = config_from_hf(read_config(path), path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(str(file)).items():
            # We serve in fp32 whatever the checkpoint's dtype (bf16/fp16 upcast exactly).
            weights[name] = tensor.to(torch.float32) if tensor.is_floating_point() else tensor
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    elif "lm_head.weight" not in weights:
        raise ValueError(f"{path}: untied model without lm_head.weight")
    return config, weights


def read_config(path: Path) -> dict:
    file = path / "config.json"
    if not file.is_file():
        raise ValueError(f"{path}: no config.json")
    return json.loads(file.read_text(encoding="utf-8"))


def config_from_hf(cfg: dict, path: Path | str = "") -> ModelConfig:
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{path}: model_type {model_type!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    _check_unsupported(cfg, path)
    heads = cfg["num_attention_heads"]
    # transformers >= 5 keeps rope_theta inside rope_parameters; older configs at top level.
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    eos = cfg.get("eos_token_id")
    return ModelConfig(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
        num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or 0, rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        rope_scaling=rope_scaling_from_hf(cfg.get("rope_scaling") or rope),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2", bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        architecture="qwen2" if model_type == "qwen2" else "llama",
    )


def _check_unsupported(cfg: dict, path) -> None:
    # Llama's attention_bias also adds an o_proj bias and mlp_bias biases the MLP; our decoder
    # has neither, so refuse rather than silently drop weights.
    if cfg.get("model_type") != "qwen2" and cfg.get("attention_bias"):
        raise ValueError(f"{path}: attention_bias=True is not supported for llama")
    if cfg.get("mlp_bias"):
        raise ValueError(f"{path}: mlp_bias=True is not supported")
    window = cfg.get("sliding_window")
    windowed = cfg.get("use_sliding_window", cfg.get("model_type") == "mistral")
    if window and windowed and window < cfg.get("max_position_embeddings", 2048):
        raise ValueError(f"{path}: sliding-window attention ({window}) is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{path}: hidden_act {cfg.get('hidden_act')!r} is not supported")


def rope_scaling_from_hf(rope: dict) -> RopeScaling:
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind == "default":
        return RopeScaling()
    if kind == "linear":
        return RopeScaling(type="linear", factor=float(rope["factor"]))
    if kind == "llama3":
        return RopeScaling(
            type="llama3", factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position=int(rope["original_max_position_embeddings"]))
    raise ValueError(f"rope scaling type {kind!r} is not supported (default, linear, llama3)")
