"""A stream that ends without a finish reason is an error, never a short answer: a 200 from
the router always means a complete one (issue 14: an in-flight request once ended with HTTP
200, empty text and finish_reason "stop" when its engine went away)."""

import asyncio

import pytest

from pdserve.common.sampling_params import SamplingParams
from pdserve.common.telemetry.metrics import RouterMetrics
from pdserve.services.router.api.errors import APIError
from pdserve.services.router.dispatch.job import fan_out
from pdserve.services.router.dispatch.job_run import JobRun
from pdserve.tests.unit.fake_streams import CannedStream as _Stream
from pdserve.tests.unit.fake_streams import delta as _delta


@pytest.mark.parametrize("n", [1, 2])
def test_a_stream_without_its_last_delta_raises(n):
    async def main():
        job = fan_out("r", [[1, 2, 3]], SamplingParams(max_tokens=4), n, 8, None)
        streams = iter([_Stream([_delta([5])]),  # cut short: no finish reason
                        _Stream([_delta([5]), _delta([6], "length")])])

        async def open_stream(*_a, **_k):
            return next(streams)
        run = await JobRun.open(open_stream, job, RouterMetrics())
        seen = []
        with pytest.raises(APIError) as err:
            async for item in run.deltas():
                seen.append(item)
        assert err.value.status == 502 and "before the answer was complete" in err.value.message
        assert seen  # the tokens that did arrive were passed on first

    asyncio.run(asyncio.wait_for(main(), 10))


def test_finished_streams_pass():
    async def main():
        job = fan_out("r", [[1, 2, 3]], SamplingParams(max_tokens=4), 1, 8, None)

        async def open_stream(*_a, **_k):
            return _Stream([_delta([5]), _delta([], "stop")])
        run = await JobRun.open(open_stream, job, RouterMetrics())
        assert [d.finish_reason async for _, d in run.deltas()] == [None, "stop"]

    asyncio.run(asyncio.wait_for(main(), 10))
