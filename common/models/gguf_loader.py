"""Load a llama.cpp GGUF checkpoint as a `ModelConfig` plus weights under Hugging Face names.

The weights must equal what transformers builds from the same file (`from_pretrained(...,
gguf_file=...)`), so we dequantize with the same library (`gguf.quants.dequantize`) and undo
llama.cpp's Q/K row permutation exactly as transformers' `LlamaTensorProcessor` does.

With `packed=True`, 2-D tensors of a type the packed kernels take (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
IQ4_NL, IQ4_XS and the K-quants Q2_K .. Q6_K: quant/packed.py) stay as their GGUF blocks
(`PackedWeight`, rows permuted the same way; a packed block expands to exactly what `dequantize`
returns). Every other type is dequantized to fp32 as before, and the types that fall back are
logged once per file with the reason.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from pdserve.common.config import ModelConfig, RopeScaling
from pdserve.common.models.gguf_file import open_gguf
from pdserve.common.models.quant.packed import PackedWeight, QType

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def load_gguf(path: str | Path, packed: bool = False, reader: GGUFReader | None = None
              ) -> tuple[ModelConfig, dict[str, torch.Tensor | PackedWeight]]:
    """Read `path` and return its architecture and every weight under HF names: fp32 tensors,
    or with `packed`, `PackedWeight`s for the 2-D tensors of a packable type. `reader`: the
    file already open (`open_gguf(path)`), so the tokenizer and the weights parse it once."""
    reader = reader or open_gguf(path)
    config = config_from_gguf(reader, path)
    weights: dict[str, torch.Tensor | PackedWeight] = {}
    expanded: Counter[str] = Counter()
    for tensor in reader.tensors:
        hf_name = hf_tensor_name(tensor.name, path)
        qtype = QType.from_ggml(tensor.tensor_type) if packed else None
        if (qtype is not None and len(tensor.shape) == 2
                and int(tensor.shape[0]) % qtype.block_size == 0):
            n, k = int(tensor.shape[1]), int(tensor.shape[0])
            rows = np.asarray(tensor.data).reshape(n, -1)  # [N, row_bytes], rows whole
            rows = _unpermute(config, hf_name, rows)
            weights[hf_name] = PackedWeight.from_numpy(qtype, rows, k)
            continue
        if packed and len(tensor.shape) == 2 and tensor.tensor_type != GGMLQuantizationType.F32:
            expanded[GGMLQuantizationType(tensor.tensor_type).name] += 1
        weights[hf_name] = _to_torch(_unpermute(config, hf_name, _dequantize(tensor, path)))
    if expanded:
        logger.info("GGUF %s: expanded to fp32 at load (no packed kernel for the type): %s",
                    Path(path).name, ", ".join(f"{n} x {t}" for t, n in sorted(expanded.items())))
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    return config, weights


def _unpermute(config: ModelConfig, hf_name: str, rows: np.ndarray) -> np.ndarray:
    """llama.cpp permutes Q/K rows; rows (fp32 values or whole packed rows) go back to HF's."""
    if config.architecture == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = config.num_heads if ".q_proj." in hf_name else config.num_kv_heads
        return reverse_permute(rows, heads)
    return rows


def gguf_metadata(reader: GGUFReader) -> dict:
    """Every scalar/string field, plus short arrays; the large tokenizer arrays are skipped."""
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and len(field.data) > 1:
            continue
        meta[key] = field.contents()
    return meta


def config_from_gguf(reader: GGUFReader, path: str | Path = "") -> ModelConfig:
    meta = gguf_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"GGUF {path}: architecture {arch!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        # llama.cpp bakes Llama-3 rope scaling into per-frequency factors; the original
        # (factor, low/high_freq_factor, original_max_position) cannot be recovered from them.
        raise ValueError(f"GGUF {path}: rope_freqs (Llama-3 rope scaling) is not supported; "
                         "load the Hugging Face directory instead")

    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    vocab = get("vocab_size") or _token_count(reader)
    # llama.cpp writes rope.dimension_count == head_dim for llama; key_length is explicit.
    head_dim = get("attention.key_length") or (get("rope.dimension_count") if arch == "llama"
                                               else None) or hidden // heads
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
           if k in meta]
    return ModelConfig(
        vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")), num_layers=int(get("block_count")),
        num_heads=heads, num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(head_dim), rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)), rope_scaling=_rope_scaling(meta, arch),
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in names, qkv_bias=arch == "qwen2",
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos)), architecture=arch,
    )


def _token_count(reader: GGUFReader) -> int:
    field = reader.fields.get("tokenizer.ggml.tokens")
    if field is None:
        raise ValueError("GGUF has no {arch}.vocab_size and no tokenizer.ggml.tokens")
    return len(field.data)


def _rope_scaling(meta: dict, arch: str) -> RopeScaling:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return RopeScaling()
    if kind == "linear":
        return RopeScaling(type="linear", factor=float(meta[f"{arch}.rope.scaling.factor"]))
    raise ValueError(f"GGUF rope scaling type {kind!r} is not supported (none, linear)")


def hf_tensor_name(gguf_name: str, path: str | Path = "") -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.match(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ValueError(f"GGUF {path}: unexpected tensor {gguf_name!r}")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def _dequantize(tensor, path) -> np.ndarray:
    qtype = GGMLQuantizationType(tensor.tensor_type)
    try:
        values = dequantize(tensor.data, qtype)
    except NotImplementedError as exc:  # gguf-py names the types it cannot unpack
        raise ValueError(f"GGUF {path}: tensor {tensor.name!r} has unsupported type "
                         f"{qtype.name}") from exc
    # GGUF lists dims fastest-first; numpy/torch want them slowest-first.
    return values.reshape(tuple(reversed([int(d) for d in tensor.shape])))


def _to_torch(values: np.ndarray) -> torch.Tensor:
    values = np.ascontiguousarray(values, dtype=np.float32)
    if not values.flags.writeable:  # F32 tensors are views into the read-only file mapping
        values = values.copy()
    return torch.from_numpy(values)


def reverse_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of Q/K rows (interleaved rotary halves -> HF's split halves).

    Same arithmetic as transformers' `LlamaTensorProcessor._reverse_permute_weights`.
    """
    dim = weights.shape[0] // num_heads // 2
    w = weights.reshape(num_heads, dim, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)
