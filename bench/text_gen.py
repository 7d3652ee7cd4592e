"""Random prompts from a tokenizer's ordinary (non-special) token ids, as vLLM's random dataset.

Token ids give exact prompt lengths on servers that accept them (completions, gRPC); chats
need text, which is the ids decoded (re-tokenizing it may give a slightly different length).
"""

from __future__ import annotations

import numpy as np


class RandomText:
    def __init__(self, tokenizer):
        self._tok = tokenizer
        special = set(tokenizer.backend.get_added_tokens_decoder())
        self._ids = np.array([i for i in range(tokenizer.vocab_size) if i not in special])

    def ids(self, rng: np.random.Generator, n: int) -> tuple[int, ...]:
        return tuple(int(x) for x in rng.choice(self._ids, size=n))

    def text(self, ids) -> str:
        return self._tok.decode(list(ids))

    def count(self, text: str) -> int:
        return len(self._tok.encode(text))


def load_tokenizer(model: str):
    """The served model's tokenizer (no weights read): 'tiny', 'smollm2', a GGUF or HF dir."""
    from pdserve.services.router.api.tokenizer_loader import load_tokenizer as load

    return load(model)
