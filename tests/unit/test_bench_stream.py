"""SSE chunks -> token arrivals, the breakdown contract, and the runner with a fake server."""

import asyncio
import json
import time

import pytest

from pdserve.bench.arrivals import ArrivalConfig
from pdserve.bench.breakdown import BREAKDOWN_KEY, LatencyBreakdown, aggregate_breakdowns
from pdserve.bench.record import StreamTrace
from pdserve.bench.request import BenchRequest
from pdserve.bench.runner import run_load
from pdserve.bench.sse import apply_chunk


def feed(trace, *chunks):
    for t, obj in chunks:
        apply_chunk(trace, obj if isinstance(obj, str) else json.dumps(obj), t)


def chat(delta, finish=None):
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def test_chat_stream_counts_tokens_not_the_opening_or_the_bare_finish():
    trace = StreamTrace(sent_t=0.0)
    feed(trace, (0.1, chat({"role": "assistant", "content": ""})),
         (0.2, chat({"content": "Hel"})),
         (0.3, chat({"content": ""})),  # a token whose text is held back
         (0.4, chat({"content": "lo"}, "length")),
         (0.5, chat({}, "stop")),  # vLLM's empty closing chunk
         (0.6, {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3},
                BREAKDOWN_KEY: {"prefill_compute_s": 0.01}}))
    assert apply_chunk(trace, "[DONE]", 0.7) is False
    assert [t for t, _ in trace.arrivals] == [0.2, 0.3, 0.4]
    assert trace.text == "Hello"
    assert (trace.usage_prompt, trace.usage_completion) == (5, 3)
    assert trace.breakdown == {"prefill_compute_s": 0.01}


def test_completion_stream_and_an_error_in_the_stream():
    trace = StreamTrace(sent_t=0.0)
    feed(trace, (0.1, {"choices": [{"index": 0, "text": "a", "finish_reason": None}]}),
         (0.2, {"error": {"message": "engine died", "type": "server_error"}}))
    assert len(trace.arrivals) == 1 and trace.error == "engine died"


def test_breakdown_fields_and_aggregation():
    assert "kv_load_s" in LatencyBreakdown.field_names()
    b = LatencyBreakdown.from_json({"kv_load_s": 0.5, "unknown_s": 1, "decode_queue_s": None})
    assert b.to_json() == {"kv_load_s": 0.5}
    with pytest.raises(ValueError):
        LatencyBreakdown(kv_save_s=-1.0)
    agg = aggregate_breakdowns([{"kv_load_s": 1.0}, {"kv_load_s": 3.0}, {}])
    assert agg["kv_load_s"]["count"] == 2 and agg["kv_load_s"]["p50"] == pytest.approx(2.0)
    assert "kv_save_s" not in agg


class FakeClient:
    """Streams max_tokens tokens 10 ms apart; remembers what it was sent and peak in-flight."""

    def __init__(self):
        self.sent, self.in_flight, self.peak = [], 0, 0

    async def send(self, req, messages, trace):
        self.sent.append(messages)
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        for k in range(req.max_tokens):
            await asyncio.sleep(0.01)
            trace.add(time.perf_counter(), 1, f"r{k}")
        self.in_flight -= 1
        trace.done_t = time.perf_counter()


def test_runner_keeps_chat_history_and_a_concurrency_limit():
    reqs = [BenchRequest("c", 2, messages=(("user", f"turn{t}"),), conversation=0, turn=t)
            for t in range(2)] + [BenchRequest("r", 3, prompt_ids=(1, 2)) for _ in range(4)]
    client = FakeClient()
    out = asyncio.run(run_load(reqs, client, ArrivalConfig("concurrency", concurrency=2),
                               progress=False))
    assert client.peak == 2
    second = next(m for m in client.sent if m and len(m) == 3)
    assert second == [{"role": "user", "content": "turn0"},
                      {"role": "assistant", "content": "r0r1"},
                      {"role": "user", "content": "turn1"}]
    assert all(r.ok for r in out.records)
    assert [r.output_tokens for r in out.records] == [2, 2, 3, 3, 3, 3]
    r = out.records[2]
    assert r.ttft_s == pytest.approx(0.01, abs=0.03) and len(r.itl_s) == 2
    assert out.duration_s >= 0.03
