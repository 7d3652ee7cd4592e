"""services/engine_host/step_log.py: every served step's work beside its time, and the
bench/step_log_split.py reading of it."""

import asyncio
import dataclasses
import json
from types import SimpleNamespace

import pytest

from pdserve.bench.step_log_split import decode_steps, main as split_main, since_bin, split
from pdserve.common.sampling_params import SamplingParams
from pdserve.services.engine_host.async_engine import AsyncEngine
from pdserve.services.engine_host.step_log import ENV, StepLog, StepLogRecord, step_log_from_env
from pdserve.tests.unit.fake_engine import FakeEngineCore


def _reqs(*ctx_by_id):
    return [SimpleNamespace(request_id=r, num_computed_tokens=c) for r, c in ctx_by_id]


def test_records_context_batch_change_and_steps_since_a_prompt(tmp_path):
    log = StepLog(str(tmp_path / "steps.jsonl"))
    # step 1: a's prompt (300 tokens computed, 1 sampled); 2: a decodes; 3: b joins with its
    # prompt beside a's decode; 4 and 5: both decode
    log.observe(0, 300, 1, 10, 8, 9, log.before_step([]))
    log.observe(1, 1, 1, 10, 8, 9, log.before_step(_reqs(("a", 300))))
    log.observe(2, 201, 2, 10, 8, 9, log.before_step(_reqs(("a", 301))))
    log.observe(3, 2, 2, 10, 8, 9, log.before_step(_reqs(("a", 302), ("b", 200))))
    log.observe(4, 2, 2, 10, 8, 9, log.before_step(_reqs(("a", 303), ("b", 201))))
    assert log.flush() == 5
    recs = [json.loads(x) for x in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [r["since_prompt"] for r in recs] == [1 << 30, 1, 2, 1, 2]
    assert [r["same_batch"] for r in recs] == [True, False, True, False, True]
    assert [r["running"] for r in recs] == [0, 1, 1, 2, 2]
    assert recs[4]["ctx_sum"] == 504 and recs[4]["ctx_max"] == 303
    assert recs[0]["gap_ns"] == 0  # no step before it
    assert all(r["gap_ns"] == -9 for r in recs[1:])  # t 0..4 and walls of 10: starts 9 early
    assert log.flush() == 0  # nothing kept twice
    log.observe(5, 2, 2, 10, 8, 9, log.before_step(_reqs(("a", 304), ("b", 202))))
    log.flush()
    assert len((tmp_path / "steps.jsonl").read_text().splitlines()) == 6  # appended


def test_bounded_and_validated(tmp_path):
    log = StepLog(str(tmp_path / "s"), max_records=2)
    for t in range(5):
        log.observe(t, 1, 1, 10, 8, 9, log.before_step(_reqs(("a", 5))))
    assert log.flush() == 2
    with pytest.raises(ValueError):
        StepLog("")
    with pytest.raises(ValueError):
        StepLog(str(tmp_path / "s"), max_records=0)
    with pytest.raises(ValueError):
        StepLogRecord(0, -1, 0, 0, 0, 0, 0, 0, 0, True, 1)


def test_from_env(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert step_log_from_env() is None
    monkeypatch.setenv(ENV, str(tmp_path / "x"))
    assert step_log_from_env().path == str(tmp_path / "x")


class _ProfiledFake(FakeEngineCore):
    """Counts its steps in the profile as EngineCore does; every request decodes each step."""

    def __init__(self):
        super().__init__(step_s=0)

    def running_requests(self):
        return [SimpleNamespace(request_id=r, num_computed_tokens=len(q["ids"]) + len(q["out"]))
                for r, q in self._reqs.items()]

    def step(self):
        n = len(self._reqs)
        self.profile.num_steps += 1
        self.profile.num_tokens += n
        self.profile.num_sampled += n
        self.profile.forward_ns += 1000
        return super().step()


def test_async_engine_writes_every_step_once_idle(tmp_path):
    path = tmp_path / "steps.jsonl"

    async def main():
        engine = AsyncEngine(_ProfiledFake(), idle_poll_s=0.01, step_log=StepLog(str(path)))
        engine.start(asyncio.get_running_loop())
        try:
            stream = await engine.submit("a", [65, 66], SamplingParams(max_tokens=4))
            [o async for o in stream]
            stream.close()
            for _ in range(200):  # the engine thread flushes once it idles
                if path.exists():
                    break
                await asyncio.sleep(0.01)
        finally:
            engine.stop()
    asyncio.run(main())
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["ctx_sum"] for r in recs] == [2, 3, 4, 5]
    assert all(r["tokens"] == r["sampled"] == r["running"] == 1 for r in recs)
    assert all(r["forward_ns"] == 1000 and r["wall_ns"] > 0 for r in recs)
    assert recs[0]["gap_ns"] == 0 and all(r["gap_ns"] > 0 for r in recs[1:])
    assert all(0 <= r["gap_cpu_ns"] for r in recs)


def _rec(sampled, wall_ms, since, same=True, tokens=None, ctx=300, t_ms=0):
    return StepLogRecord(t_ns=int(t_ms * 1e6), tokens=sampled if tokens is None else tokens,
                         sampled=sampled, wall_ns=int(wall_ms * 1e6),
                         forward_ns=int(wall_ms * 8e5), cpu_ns=int(wall_ms * 9e5),
                         running=sampled, ctx_sum=ctx * sampled, ctx_max=ctx,
                         since_prompt=since, same_batch=same)


def _timed(t_ns, wall_ns, sampled, gap_ns, gap_cpu_ns):
    """A decode step of `sampled` rows whose only fields of note are its times."""
    return StepLogRecord(t_ns=t_ns, tokens=sampled, sampled=sampled, wall_ns=wall_ns,
                         forward_ns=0, cpu_ns=0, running=sampled, ctx_sum=0, ctx_max=0,
                         same_batch=True, since_prompt=1, gap_ns=gap_ns, gap_cpu_ns=gap_cpu_ns)


def test_split_divides_decode_only_steps_by_the_offline_step_at_their_batch():
    steps_ms = {8: 20.0, 16: 30.0}
    recs = [_rec(8, 30.0, 1, same=False), _rec(16, 30.0, 20), _rec(12, 25.0, 3),
            _rec(8, 99.0, 1, tokens=300)]  # the last carried a prompt: left out
    steps = decode_steps(recs, steps_ms)
    assert [round(s.ratio, 3) for s in steps] == [1.5, 1.0, 1.0]
    by = split(steps, lambda s: since_bin(s.since_prompt))
    assert by["1"]["ratio_p50"] == 1.5 and by[">16"]["ratio_p50"] == 1.0
    assert by["2-4"]["steps"] == 1 and by["1"]["forward_share_p50"] == 0.8
    assert since_bin(4) == "2-4" and since_bin(5) == "5-16" and since_bin(17) == ">16"


def test_split_main_prints_one_json_line(tmp_path, capsys):
    log, peer = tmp_path / "steps.jsonl", tmp_path / "peer.json"
    log.write_text("".join(json.dumps(dataclasses.asdict(_rec(8, 30.0, k, t_ms=40 * k))) + "\n"
                           for k in (1, 2, 30)))
    peer.write_text(json.dumps({"decode_step_ms": {"8": 20.0}}))
    assert split_main([str(log), str(peer)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["all"]["all"] == {"steps": 3, "ratio_p50": 1.5, "batch_p50": 8,
                                 "ctx_p50": 300.0, "forward_share_p50": 0.8,
                                 "cpu_share_p50": 0.9}
    assert set(out["since_prompt"]) == {"1", "2-4", ">16"}
    assert out["engine_step_wall_p50_ms"] == 30.0 and out["engine_itl_p50_ms"] == 40.0


def test_between_steps_weights_periods_by_rows_and_skips_idle_spells():
    from pdserve.bench.step_log_split import between_steps

    ms = 1_000_000
    recs = [_timed(t_ns=0, wall_ns=10 * ms, sampled=4, gap_ns=0, gap_cpu_ns=0),
            _timed(t_ns=12 * ms, wall_ns=10 * ms, sampled=1, gap_ns=2 * ms, gap_cpu_ns=ms // 2),
            _timed(t_ns=25 * ms, wall_ns=20 * ms, sampled=1, gap_ns=3 * ms, gap_cpu_ns=ms // 2),
            _timed(t_ns=10_000 * ms, wall_ns=10 * ms, sampled=1, gap_ns=9955 * ms,
                   gap_cpu_ns=0)]
    got = between_steps(recs)
    # periods: 12 ms (4 rows), 13 ms (1 row); the third's is an idle spell: not a period
    assert got["engine_itl_p50_ms"] == 12.0
    assert got["engine_step_wall_p50_ms"] == 10.0  # walls 10 x4, 10, 20, 10
    assert got["gap_p50_ms"] == 2.5 and got["gap_cpu_p50_ms"] == 0.5
