"""A long prompt is tokenized off the router's event loop: the job is built on a worker
thread (small bodies stay on the loop), through the tokenizer's GIL-releasing entry point,
with the same token ids as `encode`."""

import threading

from pdserve.common.tokenizer import Tokenizer
from pdserve.services.router.api.http_app import build_job
from pdserve.services.router.api.prompts import (LONG_TEXT_CHARS, OFF_LOOP_BODY_BYTES,
                                                 completion_prompts, encode_text)
from pdserve.tests.unit.fake_engine import FakeTokenizer
from pdserve.tests.unit.test_router_http_edge import router, run


def test_releasing_gil_encodes_as_encode():
    tok = Tokenizer.tiny()
    long_text = "the quick brown fox, 42 <|im_end|> jumps " * (LONG_TEXT_CHARS // 16)
    for text in ("short text", long_text):
        assert tok.encode_releasing_gil(text) == tok.encode(text)
        assert encode_text(tok, text) == tok.encode(text)
    assert completion_prompts([long_text, "x"], tok) == [tok.encode(long_text), tok.encode("x")]


def test_a_large_body_builds_its_job_on_a_worker_thread():
    seen = []

    def job_fn(body, state, request_id):
        seen.append((threading.get_ident(), body, len(request_id)))
        return "job"

    async def main():
        loop_thread = threading.get_ident()
        small = await build_job(job_fn, "small", None, OFF_LOOP_BODY_BYTES - 1)
        large = await build_job(job_fn, "large", None, OFF_LOOP_BODY_BYTES)
        return loop_thread, small, large

    loop_thread, small, large = run(main())
    assert small == large == "job"
    (t_small, b_small, n_small), (t_large, b_large, n_large) = seen
    assert (b_small, b_large) == ("small", "large") and n_small == n_large == 32
    assert t_small == loop_thread != t_large


def test_a_long_prompt_is_served_with_all_its_tokens_and_refused_when_too_long():
    prompt = "a" * 4000  # the fake instance's model length is 4096
    assert len(prompt) < OFF_LOOP_BODY_BYTES

    async def main():
        async with router(tokenizer=FakeTokenizer()) as c:
            # `user` pads the body past OFF_LOOP_BODY_BYTES: the job is built off the loop
            ok = await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2,
                                                       "user": "u" * 200})
            too_long = await c.post("/v1/completions", json={"prompt": prompt * 2})
            return ok, too_long

    ok, too_long = run(main())
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["prompt_tokens"] == len(prompt)
    assert too_long.status_code == 400  # an APIError raised on the worker thread
    assert too_long.json()["error"]["code"] == "context_length_exceeded"
