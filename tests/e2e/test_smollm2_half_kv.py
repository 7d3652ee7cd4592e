"""Greedy SmolLM2 with a bf16 / fp16 KV cache (`--kv-cache-dtype`) against transformers in
fp32, under the near-tie rule of test_smollm2_vs_hf.py.

Only the cache is half: weights and activations stay fp32 (transformers runs the same
arithmetic except that K and V are not rounded), so a divergence must be a near-tie of
transformers' own distribution; anything else fails.
"""

import pytest

from pdserve.common.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.common.engine.llm import LLM
from tests.e2e.test_smollm2_vs_hf import GREEDY, _assert_matches


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16"])
def test_half_kv_cache_matches_transformers(smollm2, chat_prompts, hf_reference, kv_dtype):
    llm = LLM(EngineConfig(model="smollm2", kv_cache_dtype=kv_dtype, num_threads=2,
                           cache=CacheConfig(num_blocks=256),
                           scheduler=SchedulerConfig(max_num_batched_tokens=512)),
              loaded=smollm2)
    assert all(str(c.dtype) == f"torch.{kv_dtype}" for c in llm.engine.executor.runner.kv_caches)
    _assert_matches(llm.generate(chat_prompts, GREEDY), hf_reference)
