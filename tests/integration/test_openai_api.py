"""The official openai client against the router + a unified tiny engine, as real processes."""

import json

import httpx
import pytest

from pdserve.common.sampling_params import SamplingParams
from pdserve.tests.integration.services_helpers import offline_engine, tiny_stack

openai = pytest.importorskip("openai")

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with tiny_stack(tmp_path_factory.mktemp("logs")) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    c = openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0,
                      timeout=60)
    yield c
    c.close()


@pytest.fixture(scope="module")
def llm():
    return offline_engine()


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def test_completion_greedy_matches_offline_engine(client, llm):
    want = llm.generate("The quick brown fox", greedy(12))[0]
    got = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=12,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == "length"
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == 12


def test_completion_stream_matches_offline_engine(client, llm):
    want = llm.generate("jumps over", greedy(10))[0]
    chunks = list(client.completions.create(model="tiny", prompt="jumps over", max_tokens=10,
                                            temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_chat_greedy_and_stream_match_offline_engine(client, llm):
    want = llm.chat(CHAT, greedy(9))[0]
    got = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=9,
                                         temperature=0, extra_body={"ignore_eos": True})
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    stream = list(client.chat.completions.create(
        model="tiny", messages=CHAT, max_completion_tokens=9, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == want.text
    assert stream[-1].choices == [] and stream[-1].usage.completion_tokens == 9
    assert stream[-1].usage.prompt_tokens == len(want.prompt_token_ids)
    assert all(c.usage is None for c in stream[:-1])


def test_sse_wire_format_ends_with_done(stack):
    body = {"model": "tiny", "prompt": "ab", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", stack.http_url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [ln for ln in r.iter_lines() if ln]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert all(json.loads(e[6:])["object"] == "text_completion" for e in events[:-1])


def test_n_seed_logprobs_and_stop(client):
    got = client.completions.create(model="tiny", prompt="seeded", max_tokens=6, n=2,
                                    temperature=1.0, seed=7, logprobs=2)
    assert [c.index for c in got.choices] == [0, 1]
    for choice in got.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
        assert all(v <= 0 for v in lp.token_logprobs)
        assert all(1 <= len(t) <= 2 for t in lp.top_logprobs)
    again = client.completions.create(model="tiny", prompt="seeded", max_tokens=6, n=2,
                                      temperature=1.0, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in got.choices]
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4,
                                          logprobs=True, top_logprobs=1, temperature=0)
    assert len(chat.choices[0].logprobs.content) == 4
    full = client.completions.create(model="tiny", prompt="stop test", max_tokens=20,
                                     temperature=0, extra_body={"ignore_eos": True})
    text = full.choices[0].text
    cut = next(text[i:i + 2] for i in range(3, len(text)) if text[i:i + 2].isprintable())
    stopped = client.completions.create(model="tiny", prompt="stop test", max_tokens=20,
                                        temperature=0, stop=[cut],
                                        extra_body={"ignore_eos": True})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[:text.index(cut)]


def test_models_health_and_metrics(client, stack):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(stack.http_url + "/health").json()["healthy_instances"] == 1
    for _ in client.completions.create(model="tiny", prompt="count me", max_tokens=3,
                                       stream=True):
        pass
    text = httpx.get(stack.http_url + "/metrics").text
    for name in ("pdserve_requests_total", "pdserve_time_to_first_token_seconds_bucket",
                 "pdserve_inter_token_latency_seconds_bucket", "pdserve_num_requests_running",
                 "pdserve_num_requests_waiting"):
        assert name in text
    count = [ln for ln in text.splitlines()
             if ln.startswith("pdserve_time_to_first_token_seconds_count")]
    assert count and float(count[0].split()[-1]) >= 1
