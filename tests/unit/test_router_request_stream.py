"""RequestStream and AsyncEngine: the engine thread never waits on a reader."""

import asyncio
import threading

import pytest

from pdserve.common.engine.outputs import FinishReason, RequestOutput, TokenLogprob
from pdserve.common.sampling_params import SamplingParams
from pdserve.services.engine_host.async_engine import (AsyncEngine, EngineDeadError,
                                                       RequestFailedError)
from pdserve.services.engine_host.request_stream import RequestStream
from pdserve.tests.unit.fake_engine import FakeEngineCore


def out(tok, finished=False):
    return RequestOutput("r", [tok], chr(tok), finished,
                         FinishReason.LENGTH if finished else None,
                         logprobs=[TokenLogprob(tok, -1.0)], num_output_tokens=tok)


def test_full_stream_merges_instead_of_growing():
    async def main():
        aborted = []
        s = RequestStream("r", 2, aborted.append)
        s.accept()
        for tok in range(65, 75):
            s.put(out(tok, finished=tok == 74))
        assert s.pending == 2
        got = [o async for o in s]
        assert [t for o in got for t in o.new_token_ids] == list(range(65, 75))
        assert "".join(o.new_text for o in got) == "ABCDEFGHIJ"
        assert [lp.token_id for o in got for lp in o.logprobs] == list(range(65, 75))
        assert got[-1].finished and got[-1].num_output_tokens == 74
        s.close()
        assert aborted == []  # finished: nothing to abort
    asyncio.run(main())


@pytest.mark.parametrize("state", ["queued", "running", "rejected"])
def test_close_aborts_only_what_the_engine_may_still_run(state):
    async def main():
        aborted = []
        s = RequestStream("r", 4, aborted.append)
        if state == "running":
            s.accept()
            s.put(out(65))
        elif state == "rejected":
            s.fail(ValueError("bad"))
        s.close()
        s.close()
        return aborted
    assert asyncio.run(main()) == ([] if state == "rejected" else ["r"])


async def _with_engine(core, body):
    engine = AsyncEngine(core, max_pending_outputs=4)
    engine.start(asyncio.get_running_loop())
    try:
        return await body(engine)
    finally:
        await asyncio.get_running_loop().run_in_executor(None, engine.stop)


def test_a_reader_that_never_reads_does_not_stall_the_others():
    core = FakeEngineCore(num_blocks=256, step_s=0.001)

    async def body(engine):
        idle = await engine.submit("idle", [1], SamplingParams(max_tokens=300))
        busy = await engine.submit("busy", [1], SamplingParams(max_tokens=100))
        toks = [t async for o in busy for t in o.new_token_ids]
        assert len(toks) == 100
        assert idle.pending <= 4  # merged, not queued without bound
        await asyncio.sleep(0.5)  # idle's 300 tokens finish in the engine meanwhile
        assert engine.num_finished == 2 and engine.num_aborted == 0
        idle.close()
        assert [t async for o in idle for t in o.new_token_ids] == []  # closed: reads nothing
        return core.num_free_blocks
    assert asyncio.run(_with_engine(core, body)) == core.num_total_blocks


def test_refused_request_raises_and_close_aborts_a_running_one():
    core = FakeEngineCore(num_blocks=256, step_s=0.001)

    async def body(engine):
        with pytest.raises(ValueError, match="empty"):
            await engine.submit("bad", [], SamplingParams())
        s = await engine.submit("long", [1], SamplingParams(max_tokens=500))
        await s.__anext__()
        with pytest.raises(ValueError, match="already running"):
            await engine.submit("long", [1], SamplingParams())
        s.close()
        for _ in range(100):
            if engine.stats().num_running == 0:
                break
            await asyncio.sleep(0.01)
        assert engine.num_aborted == 1
        return core.num_free_blocks
    assert asyncio.run(_with_engine(core, body)) == core.num_total_blocks


def test_a_failing_step_fails_its_batch_and_the_engine_goes_on():
    core = FakeEngineCore(step_s=0.001)
    crashed = threading.Event()
    real_step = core.step

    def boom_once():
        if not crashed.is_set():
            crashed.set()
            raise IndexError("index 1000000000 is out of bounds")
        return real_step()

    async def body(engine):
        s = await engine.submit("r", [1], SamplingParams(max_tokens=50))
        core.step = boom_once
        with pytest.raises(RequestFailedError, match="IndexError"):
            async for _ in s:
                pass
        s.close()
        assert crashed.is_set() and engine.healthy and engine.num_step_failures == 1
        s2 = await engine.submit("r2", [1], SamplingParams(max_tokens=3))
        outs = [o async for o in s2]
        assert outs[-1].finished and sum(len(o.new_token_ids) for o in outs) == 3
        return core.num_free_blocks
    assert asyncio.run(_with_engine(core, body)) == core.num_total_blocks


def test_a_broken_core_ends_the_engine():
    """When even aborting the batch raises, the loop ends and every stream fails."""
    core = FakeEngineCore(step_s=0.001)

    def boom():
        raise RuntimeError("kernel exploded")

    def broken_abort(rid):
        raise RuntimeError("state corrupted")

    async def body(engine):
        s = await engine.submit("r", [1], SamplingParams(max_tokens=50))
        core.step, core.abort_request = boom, broken_abort
        with pytest.raises(EngineDeadError):
            async for _ in s:
                pass
        assert not engine.healthy
        with pytest.raises(EngineDeadError):
            await engine.submit("r2", [1], SamplingParams())
    asyncio.run(_with_engine(core, body))
