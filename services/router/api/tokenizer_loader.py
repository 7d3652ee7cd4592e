"""The router needs only the tokenizer (and its chat template), never the weights."""

from __future__ import annotations


def load_tokenizer(model: str):
    # The same name -> file resolution as the engine's loader, without reading any weights.
    from pdserve.common.models.registry import resolve_model
    from pdserve.common.tokenizer import Tokenizer

    if model == "tiny":
        return Tokenizer.tiny()
    path = resolve_model(model)
    return Tokenizer.from_gguf(path) if path.is_file() else Tokenizer.from_hf_dir(path)
