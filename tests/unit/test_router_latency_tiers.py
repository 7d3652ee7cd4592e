"""The router's TTFT / ITL / e2e histograms carry the request's priority tier."""

import asyncio

from pdserve.common.sampling_params import SamplingParams
from pdserve.common.telemetry.metrics import RouterMetrics
from pdserve.services.router.dispatch.job import fan_out
from pdserve.services.router.dispatch.job_run import JobRun
from pdserve.tests.unit.fake_streams import CannedStream as _Stream
from pdserve.tests.unit.fake_streams import delta as _delta


def _count(metrics: RouterMetrics, name: str, priority: str) -> float:
    return metrics.registry.get_sample_value(f"{name}_count", {"priority": priority}) or 0.0


def test_each_request_counts_in_its_own_tier():
    metrics = RouterMetrics()

    async def one(priority: int) -> None:
        job = fan_out("r", [[1, 2, 3]], SamplingParams(max_tokens=3), 1, 8, None)

        async def open_stream(*_a, **_k):
            return _Stream([_delta([5]), _delta([6]), _delta([7], "length")])
        run = await JobRun.open(open_stream, job, metrics, priority=priority)
        async for _ in run.deltas():
            pass

    async def main():
        await one(5)
        await one(5)
        await one(-2)

    asyncio.run(asyncio.wait_for(main(), 10))
    ttft, itl, e2e = ("pdserve_time_to_first_token_seconds",
                      "pdserve_inter_token_latency_seconds", "pdserve_e2e_request_latency_seconds")
    assert _count(metrics, ttft, "5") == 2 and _count(metrics, ttft, "-2") == 1
    assert _count(metrics, e2e, "5") == 2 and _count(metrics, e2e, "-2") == 1
    assert _count(metrics, itl, "5") == 4 and _count(metrics, itl, "-2") == 2  # 2 gaps each
    assert _count(metrics, ttft, "0") == 0  # the default tier exists, empty
    assert 'pdserve_time_to_first_token_seconds_count{priority="0"} 0.0' in \
        metrics.render().decode()
