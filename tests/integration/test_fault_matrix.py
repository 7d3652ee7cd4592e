"""Issue 13's fault matrix: each fault hits a live disaggregated stack (tests/integration/
fault_stack.py: tiny model, real processes) with requests in flight, and every request must
end within its deadline either with the uninterrupted greedy text or with a clean OpenAI-style
error: never a hang, never a 200 whose text is empty or short (the defect reported: a stream
in flight when prefill or the store died ended in HTTP 200, empty text, finish_reason "stop").

One case per (target, fault): SIGKILL and SIGSTOP of decode, prefill, the storage node, the
store master and Redis, and the router-to-decode link blackholed. Each case:
1. starts two streams (round robin: one on each decode instance) and waits until both stream;
2. freezes the target (SIGSTOP, or the link cut), then sends a streamed and a non-streamed
   request, which reach the frozen part (prefill, store, lookup, decode) and wait there;
3. SIGKILL cases then kill the frozen target; SIGSTOP and cut cases leave it frozen;
4. collects every answer (each with its deadline), then revives the target and waits until
   the stack answers a request right again, so the next case starts on a whole stack.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import threading
import time

import httpx
import pytest

from pdserve.common.sampling_params import SamplingParams
from pdserve.common.tokenizer import Tokenizer
from pdserve.tests.integration.disagg_helpers import _store_nodes as store_nodes
from pdserve.tests.integration.fault_stack import fault_stack
from pdserve.tests.integration.services_helpers import offline_engine

MAX_TOKENS = 120
PROMPTS = [[(13 * i + 7 * j) % 180 + 11 for j in range(24 + 5 * i)] for i in range(4)]
DEADLINE_S = 60.0  # a request's whole life, fault included (router deadlines are ~8 s)
RECOVER_S = 120.0
ROUTER_ARGS = ("--decode-policy", "round_robin", "--stream-idle-timeout", "6",
               "--prefill-timeout", "6", "--request-timeout", "45")

CASES = [(t, s) for t in ("decode0", "prefill0", "kv-node", "kv-master", "redis")
         for s in ("SIGKILL", "SIGSTOP")] + [("decode0", "cut")]


@pytest.fixture(scope="module")
def texts():
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    outs = offline_engine(num_blocks=256).generate(PROMPTS, params)
    tok = Tokenizer.tiny()
    return [tok.decode(o.token_ids) for o in outs]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with fault_stack(tmp_path_factory.mktemp("faults"), router_args=ROUTER_ARGS) as s:
        yield s


def _body(i: int, stream: bool) -> dict:
    return {"model": "tiny", "prompt": PROMPTS[i], "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": stream}


def complete(url: str, i: int) -> tuple[str, str]:
    """("ok", text) of a whole 200 answer, or ("error", "") of a clean 5xx error."""
    r = httpx.post(url + "/v1/completions", json=_body(i, False), timeout=DEADLINE_S)
    body = r.json()
    if r.status_code == 200:
        choice = body["choices"][0]
        assert choice["finish_reason"] == "length", body
        assert body["usage"]["completion_tokens"] == MAX_TOKENS, body
        return "ok", choice["text"]
    assert r.status_code >= 500 and body["error"]["message"], (r.status_code, body)
    return "error", ""


def stream(url: str, i: int, streaming: threading.Event) -> tuple[str, str]:
    """("ok", text) of a stream that ended with finish_reason "length" and [DONE], or
    ("error", text so far) of one that ended in an error event (or a 5xx before it started).
    `streaming` is set once it streamed some text (or ended)."""
    try:
        return _stream(url, i, streaming)
    finally:
        streaming.set()


def _stream(url: str, i: int, streaming: threading.Event) -> tuple[str, str]:
    text, finish = "", None
    with httpx.stream("POST", url + "/v1/completions", json=_body(i, True),
                      timeout=DEADLINE_S) as r:
        if r.status_code != 200:
            body = json.loads(r.read())
            assert r.status_code >= 500 and body["error"]["message"], (r.status_code, body)
            return "error", ""
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                assert finish == "length", (finish, text)
                return "ok", text
            event = json.loads(line[6:])
            if "error" in event:
                assert event["error"]["message"], event
                return "error", text
            choice = event["choices"][0]
            text += choice["text"]
            finish = choice["finish_reason"] or finish
            if len(text) > 8:
                streaming.set()
    raise AssertionError(f"stream ended without [DONE] or an error event: {text!r}")


def _freeze(stack, target: str, fault: str) -> None:
    if fault == "cut":
        stack.proxies[target].cut()
    else:
        os.kill(stack.pid(target), signal.SIGSTOP)


def _revive(stack, target: str, fault: str) -> None:
    if fault == "cut":
        stack.proxies[target].heal()
    else:
        stack.revive(target)


def _wait_whole(stack, text: str) -> None:
    """Until the stack answers right and the store has its node again."""
    deadline = time.monotonic() + RECOVER_S
    while True:
        try:
            if complete(stack.http_url, 0) == ("ok", text) and store_nodes(stack.master) > 0:
                return
        except (httpx.HTTPError, AssertionError):
            pass
        assert time.monotonic() < deadline, "the stack did not recover"
        time.sleep(0.5)


@pytest.mark.parametrize("target,fault", CASES, ids=[f"{t}-{s}" for t, s in CASES])
def test_fault(stack, texts, target, fault):
    url = stack.http_url
    _wait_whole(stack, texts[0])
    t0 = time.monotonic()
    events = [threading.Event() for _ in range(2)]
    with cf.ThreadPoolExecutor(4) as pool:
        futs = {i: pool.submit(stream, url, i, events[i]) for i in range(2)}
        for e in events:
            e.wait(DEADLINE_S)
        try:
            _freeze(stack, target, fault)
            futs[2] = pool.submit(stream, url, 2, threading.Event())
            futs[3] = pool.submit(complete, url, 3)
            time.sleep(1.0)  # they reach the frozen part and wait there
            if fault == "SIGKILL":
                os.kill(stack.pid(target), signal.SIGKILL)
                stack.children[target].proc.wait(10)
            done, late = cf.wait(futs.values(), timeout=DEADLINE_S + 5)
            elapsed = time.monotonic() - t0
        finally:
            _revive(stack, target, fault)
        assert not late, f"{len(late)} request(s) still open after {DEADLINE_S + 5} s"
        outcomes = {i: f.result() for i, f in futs.items()}
    for i, (kind, text) in outcomes.items():
        if kind == "ok":
            assert text == texts[i], f"request {i}: a 200 with the wrong text {text!r}"
        else:  # what was streamed before the error is right
            assert texts[i].startswith(text), f"request {i}: wrong text {text!r}"
    print(f"\n{target} {fault}: {elapsed:.1f}s {sorted(k for k, _ in outcomes.values())}")
    _wait_whole(stack, texts[0])
