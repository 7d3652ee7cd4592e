"""The disaggregated path through real processes (tiny model): router -> prefill (saves the
prompt's KV to the store) -> decode (loads it); greedy tokens equal the offline engine's, cold
and on a store hit served by another decode instance that never saw the prompt."""

import httpx
import pytest

from pdserve.common.sampling_params import SamplingParams
from pdserve.tests.integration.disagg_helpers import (disagg_stack, engine_load, generate,
                                                      metric)
from pdserve.tests.integration.services_helpers import offline_engine

PROMPTS = [list(range(5, 75)), [9, 8, 7] * 20 + [1]]  # 70 and 61 tokens: 4 and 3 full blocks
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def reference():
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return [o.token_ids for o in offline_engine().generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    # Round-robin decode: the test wants the repeat on the decode instance that never saw it.
    with disagg_stack(tmp_path_factory.mktemp("disagg"),
                      router_args=("--decode-policy", "round_robin")) as s:
        yield s


def test_cold_then_store_hit_on_another_decode(stack, reference):
    tokens, last = generate(stack.grpc_addr, PROMPTS[0], MAX_TOKENS)
    assert tokens == reference[0]
    assert last.usage.completion_tokens == MAX_TOKENS
    assert {"prefill_compute_s", "decode_compute_s"} <= set(last.breakdown)
    pre = engine_load(stack.prefill[0], "prefill")
    assert pre.kv.blocks_saved == 4 and pre.num_finished == 1
    # The router goes round-robin: the same prompt now lands on the other decode instance,
    # and since the store holds all 4 full blocks it skips prefill.
    again, _ = generate(stack.grpc_addr, PROMPTS[0], MAX_TOKENS)
    assert again == reference[0]
    assert engine_load(stack.prefill[0], "prefill").num_finished == 1  # no second prefill
    loads = [engine_load(a) for a in stack.decode]
    assert sorted(ld.num_finished for ld in loads) == [1, 1]  # one request each
    assert [ld.kv.blocks_loaded for ld in loads] == [4, 4]  # both loaded, none computed
    assert all(ld.num_kv_load_failures == 0 for ld in loads)
    assert metric(stack.http_url, "pdserve_router_prefill_skipped_total",
                  'reason="stored"') == 1
    assert metric(stack.http_url, "pdserve_router_kv_lookup_hit_tokens_total") == 64
    assert metric(stack.http_url, "pdserve_router_prefill_fallbacks_total") == 0


def test_http_stream_through_disagg_carries_the_breakdown(stack, reference):
    body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    import json

    chunks = []
    with httpx.stream("POST", f"{stack.http_url}/v1/completions", json=body,
                      timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    assert text == offline_engine().tokenizer.decode(reference[1])
    last = chunks[-1]
    assert last["usage"]["completion_tokens"] == MAX_TOKENS
    b = last["pdserve_breakdown"]
    assert b["prefill_compute_s"] > 0 and b["decode_compute_s"] > 0 and b["router_queue_s"] >= 0
