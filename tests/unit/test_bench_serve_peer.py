"""`pdserve bench serve --peer-base-url`: each side's JSON block counts its own requests.

The JSON line once said 64 requests for our side of a 32-request run with a peer: the failure
fields of both runs together were written over our side's. These tests run the real command
line with the load itself replaced (no server), so they would have caught it.
"""

import json

import pytest

from pdserve.bench import cli as bench_cli
from pdserve.bench import serve
from pdserve.bench.failures import EXIT_TOO_MANY_FAILED
from pdserve.bench.record import RequestRecord
from pdserve.bench.request import BenchRequest
from pdserve.bench.summary import summarize_run

N = 32


def _records(failed: int) -> tuple[RequestRecord, ...]:
    return tuple(RequestRecord(i, "chat", 0.1 * i, 1.0, 0.2, (0.01,) * 7, 100, 8,
                               error="HTTP 500: boom" if i < failed else None)
                 for i in range(N))


@pytest.fixture
def fake_load(monkeypatch):
    """measure() answers from a table: target label -> failed requests of its run."""
    failed_by_target: dict[str, int] = {}
    sent: list[tuple[str, int]] = []

    def measure(target, requests, cfg):
        sent.append((target.name, len(requests)))
        records = _records(failed_by_target.get(target.label, 0))
        return summarize_run(records, 5.0, cfg.slo_map), records

    monkeypatch.setattr(serve, "build", lambda cfg: [
        BenchRequest("chat", 8, messages=(("user", "hi"),), conversation=i % 8, turn=i // 8)
        for i in range(cfg.workload.num_prompts)])
    monkeypatch.setattr(serve, "measure", measure)
    monkeypatch.setattr(serve, "write_outputs", lambda *a, **k: {"result": "x.json"})
    return failed_by_target, sent


def _run(capsys, *extra: str) -> tuple[int, dict]:
    code = bench_cli.main(["serve", "--base-url", "http://127.0.0.1:9", "--tokenizer", "tiny",
                           "--workload", "chat", "--turns", "4", "--num-prompts", str(N),
                           "--no-progress", *extra])
    return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_each_side_reports_its_own_request_count(fake_load, capsys):
    _, sent = fake_load
    code, line = _run(capsys, "--peer-base-url", "http://127.0.0.1:10")
    assert code == 0
    assert [n for _, n in sent] == [N, N]  # both got the same 32 requests
    assert line["requests"] == N and line["peer"]["requests"] == N
    assert line["failed"] == 0 and line["peer"]["failed"] == 0
    assert line["ratio_vs_peer"]["ttft_p50_s"] == pytest.approx(1.0)


def test_a_failing_peer_fails_the_run_without_touching_our_side(fake_load, capsys):
    failed_by_target, _ = fake_load
    failed_by_target["peer"] = 10
    code, line = _run(capsys, "--peer-base-url", "http://127.0.0.1:10")
    assert code == EXIT_TOO_MANY_FAILED
    assert (line["requests"], line["failed"], line["failed_fraction"]) == (N, 0, 0.0)
    assert "error" not in line
    assert (line["peer"]["requests"], line["peer"]["failed"]) == (N, 10)
    assert "10 of 32" in line["peer"]["error"]
    assert line["peer"]["first_errors"] == ["HTTP 500: boom"]


def test_without_a_peer_the_line_has_one_sides_fields(fake_load, capsys):
    failed_by_target, _ = fake_load
    failed_by_target[""] = 1
    code, line = _run(capsys)
    assert code == 0 and "peer" not in line and "failures" not in line
    assert (line["requests"], line["failed"]) == (N, 1)
