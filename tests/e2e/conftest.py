"""Shared fixtures for tests against the real SmolLM2 and transformers (loaded once)."""

import pytest
import torch

from pdserve.common.models.registry import load_model
from pdserve.tests.e2e.reference import greedy_reference

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
def hf_reference(hf_smollm2, chat_prompts):
    """Per chat prompt: transformers' greedy tokens and log-softmax at every step."""
    return greedy_reference(hf_smollm2, chat_prompts)
