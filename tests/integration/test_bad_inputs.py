"""Bad requests get OpenAI-style errors with fitting codes and never disturb requests in flight."""

import json
import threading
import time

import httpx
import pytest

from pdserve.tests.integration.services_helpers import tiny_stack

openai = pytest.importorskip("openai")

MSGS = [{"role": "user", "content": "x"}]
CASES = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404, "model"),
    ("/v1/chat/completions", {"model": "tiny"}, 422, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 422, "messages"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "temperature": "hot"}, 422,
     "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "x" * 600}, 400, "prompt"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user",
                                                            "content": "x" * 600}]},
     400, "messages"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "n": 1000}, 400, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": [10 ** 6]}, 400, None),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSGS, "top_logprobs": 2}, 400,
     "top_logprobs"),
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with tiny_stack(tmp_path_factory.mktemp("logs")) as s:
        yield s


def test_bad_inputs_do_not_disturb_a_stream_in_flight(stack):
    """The bad requests go out once the stream's first token has arrived; the arrival times show
    that tokens were still coming after the last of them was answered."""
    result, first_token = {}, threading.Event()

    def long_stream():
        body = {"model": "tiny", "prompt": "steady", "max_tokens": 480, "ignore_eos": True,
                "stream": True}
        events, arrivals = [], []
        with httpx.stream("POST", stack.http_url + "/v1/completions", json=body,
                          timeout=60) as r:
            for ln in r.iter_lines():
                if ln.startswith("data: "):
                    events.append(ln)
                    arrivals.append(time.monotonic())
                    first_token.set()
        result["events"], result["arrivals"] = events, arrivals

    t = threading.Thread(target=long_stream)
    t.start()
    assert first_token.wait(30), "the stream produced nothing"
    answered_at = []
    with httpx.Client(base_url=stack.http_url, timeout=30) as c:
        for path, body, status, param in CASES:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = c.post(path, content=content, headers={"Content-Type": "application/json"})
            answered_at.append(time.monotonic())
            assert r.status_code == status, (body, r.text)
            assert r.headers["content-type"] == "application/json", (body, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"]
            if param is not None:
                assert err["param"] == param, err
    t.join(60)
    token_arrivals = result["arrivals"][:-2]  # before the final chunk and [DONE]
    # every bad request was answered while tokens were still coming (here: all 16 in ~20 ms of
    # a ~350 ms stream)
    assert token_arrivals[-1] > answered_at[-1], "the stream ended before the bad requests did"
    events = result["events"]
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][6:])
    assert last["choices"][0]["finish_reason"] == "length"
    texts = [json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]]
    assert sum(len(x) > 0 for x in texts) > 0


def test_openai_client_raises_typed_errors(stack):
    client = openai.OpenAI(base_url=stack.http_url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="x")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=MSGS, temperature=-2)
    assert info.value.body["param"] == "temperature"
