"""A seeded request gives one text on every path (issue 14 item 6), on the tiny model: alone or
in any batch, on another engine, prefill on one engine then decode on another, preempted and
recomputed, and chunked prefill; n choices get distinct derived seeds."""

import pytest
import torch

from pdserve.common.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.common.engine.llm import LLM
from pdserve.common.random_stream import derive_seed
from pdserve.common.sampling_params import SamplingParams

PROMPT = list(range(40, 61))
OTHERS = [[5, 6, 7, 8, 9], [100, 3, 200, 7], list(range(80, 110))]
KINDS = [dict(temperature=1.0), dict(temperature=0.8, top_p=0.9, top_k=40, min_p=0.02)]


def engine(**kw):
    torch.set_num_threads(1)
    cache = kw.pop("cache", CacheConfig(num_blocks=128))
    return LLM(EngineConfig(model="tiny", cache=cache, num_threads=1, **kw))


@pytest.fixture(scope="module")
def llm():
    return engine()


def params(seed=11, **kw):
    return SamplingParams(**{"max_tokens": 16, "ignore_eos": True, "seed": seed, **kw})


def run(llm, prompts, plist):
    return [o.token_ids for o in llm.generate(prompts, plist)]


@pytest.mark.parametrize("kind", KINDS, ids=["temperature", "filtered"])
def test_any_batch_any_row_any_engine(llm, kind):
    (alone,) = run(llm, [PROMPT], [params(**kind)])
    mixed = [params(temperature=0.0), params(seed=3, temperature=1.2), params(seed=4, **kind)]
    for row in (0, 2, 3):
        prompts = OTHERS[:row] + [PROMPT] + OTHERS[row:]
        plist = mixed[:row] + [params(**kind)] + mixed[row:]
        assert run(llm, prompts, plist)[row] == alone, row
    assert run(engine(seed=99), [PROMPT], [params(**kind)])[0] == alone  # another instance
    assert run(llm, [PROMPT], [params(seed=12, **kind)])[0] != alone


def test_prefill_on_one_engine_then_decode_on_another(llm):
    """What disaggregation does: the prefill instance samples token 0, the decode instance
    gets it as first_token_id and samples tokens 1.. from the same stream."""
    (full,) = run(llm, [PROMPT], [params()])
    (first,) = run(llm, [PROMPT], [params(max_tokens=1)])
    assert first == full[:1]
    decode = engine(seed=5)
    decode.engine.add_request("d", PROMPT, params(), first_token_id=first[0])
    rest = []
    while decode.engine.has_unfinished_requests():
        for out in decode.engine.step():
            rest += out.new_token_ids
    assert [first[0]] + rest == full


def test_preempted_and_chunked_prefill_keep_the_stream(llm):
    """A KV cache too small for all requests forces preemption (recompute) and a tiny token
    budget forces chunked prefills; every seeded output equals its solo run."""
    prompts = [PROMPT] + OTHERS
    plist = [params(seed=20 + i, max_tokens=24) for i in range(len(prompts))]
    solo = [run(llm, [p], [q])[0] for p, q in zip(prompts, plist)]
    tight = engine(cache=CacheConfig(num_blocks=12, block_size=8),
                   scheduler=SchedulerConfig(max_num_batched_tokens=16, max_model_len=96))
    assert run(tight, prompts, plist) == solo
    assert tight.engine.stats().num_preemptions > 0


def test_n_choices_get_derived_seeds(llm):
    first, second = run(llm, [PROMPT, PROMPT], [params(seed=7), params(seed=derive_seed(7, 1))])
    assert first != second
    assert run(llm, [PROMPT], [params(seed=7)])[0] == first  # choice 0 = the n=1 answer
