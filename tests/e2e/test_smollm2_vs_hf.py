"""Greedy SmolLM2 output equals Hugging Face transformers token for token, five ways.

Near-tie rule (as vLLM's check_logprobs_close): if the sequences diverge at step j, it is
accepted only when each side's token is in the other's top 2 at j and the two tokens'
log-probabilities (transformers' distribution) differ by less than NEAR_TIE nats; the comparison
of that prompt stops there. Any other divergence fails.
"""

import pytest
import torch

from pdserve.common.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.common.engine.llm import LLM
from pdserve.common.sampling_params import SamplingParams
from pdserve.tests.e2e.reference import MAX_TOKENS
NEAR_TIE = 0.05  # nats
LOGIT_ATOL = 2e-3  # first-step logits, absolute (logits are O(10))
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=2)


def _engine(smollm2, **kw):
    sched = kw.pop("scheduler", SchedulerConfig(max_num_batched_tokens=512))
    cache = kw.pop("cache", CacheConfig(num_blocks=256))
    return LLM(EngineConfig(model="smollm2", cache=cache, scheduler=sched, num_threads=2),
               loaded=smollm2)


def _assert_matches(outputs, refs):
    for out, (ref_toks, ref_lps) in zip(outputs, refs):
        ours = out.token_ids
        for j, (a, b) in enumerate(zip(ours, ref_toks)):
            if a == b:
                continue
            our_top = [t for t, _ in out.logprobs[j].top]
            hf_top = ref_lps[j].topk(2).indices.tolist()
            gap = abs(ref_lps[j][a].item() - ref_lps[j][b].item())
            assert a in hf_top and b in our_top and gap < NEAR_TIE, (
                f"diverged at {j}: ours {a} vs transformers {b} (gap {gap:.4f})")
            break
        else:
            assert ours == ref_toks[:len(ours)]
            assert len(ours) == len(ref_toks) or out.finish_reason.value == "stop"


def test_one_at_a_time(smollm2, chat_prompts, hf_reference):
    llm = _engine(smollm2)
    outs = [llm.generate([ids], GREEDY)[0] for ids in chat_prompts]
    _assert_matches(outs, hf_reference)


def test_one_batch_of_mixed_lengths(smollm2, chat_prompts, hf_reference):
    assert len({len(p) for p in chat_prompts}) > 4  # really mixed
    _assert_matches(_engine(smollm2).generate(chat_prompts, GREEDY), hf_reference)


def test_chunked_prefill(smollm2, chat_prompts, hf_reference):
    budget = 16
    assert min(len(p) for p in chat_prompts) > budget  # every prompt is split
    llm = _engine(smollm2, scheduler=SchedulerConfig(max_num_batched_tokens=budget))
    _assert_matches(llm.generate(chat_prompts, GREEDY), hf_reference)


def test_prefix_cache_second_pass(smollm2, chat_prompts, hf_reference):
    llm = _engine(smollm2)
    llm.generate(chat_prompts, GREEDY)
    hits_before = llm.engine.stats().prefix_cache_hits
    second = llm.generate(chat_prompts, GREEDY)
    assert llm.engine.stats().prefix_cache_hits > hits_before
    assert all(o.num_cached_tokens > 0 for o in second)
    _assert_matches(second, hf_reference)


def test_preemption_under_small_kv_budget(smollm2, chat_prompts, hf_reference):
    longest = max(len(p) for p in chat_prompts) + MAX_TOKENS
    num_blocks = 3 * (longest // 16 + 1)  # room for about three sequences, eight are sent
    llm = _engine(smollm2, cache=CacheConfig(num_blocks=num_blocks, block_size=16))
    outs = llm.generate(chat_prompts, GREEDY)
    assert llm.engine.stats().num_preemptions > 0
    assert llm.engine.num_free_blocks == num_blocks
    _assert_matches(outs, hf_reference)


def test_first_step_logits(smollm2, chat_prompts, hf_smollm2):
    llm = _engine(smollm2)
    captured = []
    model = llm.engine.executor.runner.model
    compute = model.compute_logits
    model.compute_logits = lambda h: captured.append(compute(h)) or captured[-1]
    llm.generate(chat_prompts[:3], SamplingParams(temperature=0, max_tokens=1))
    ours = captured[0]  # one row per prompt, all sampled in the same step
    with torch.inference_mode():
        for i, ids in enumerate(chat_prompts[:3]):
            ref = hf_smollm2(torch.tensor([ids])).logits[0, -1]
            assert (ours[i] - ref).abs().max().item() < LOGIT_ATOL
