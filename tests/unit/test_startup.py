"""Start-up as the design draws it: profiling forward -> KV plan from what is left -> warm-up ->
SERVING; the first request after that pays no buffer allocation and leaves warm-up no trace."""

import asyncio
import threading

import pytest

from pdserve.common.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.common.engine.engine_core import EngineCore
from pdserve.common.engine.startup import profile_batch
from pdserve.common.rpc import engine_pb2 as pb
from pdserve.common.sampling_params import SamplingParams
from pdserve.services.engine_host.async_engine import AsyncEngine
from pdserve.services.engine_host.health import InstanceInfo, health_response

MIB = 2**20


def _core(**cache) -> EngineCore:
    return EngineCore(EngineConfig(model="tiny", num_threads=1, cache=CacheConfig(**cache),
                                   scheduler=SchedulerConfig(max_num_seqs=8,
                                                             max_num_batched_tokens=256,
                                                             max_model_len=128)))


@pytest.mark.parametrize("tokens,seqs,model_len", [(256, 8, 128), (2048, 64, 2048),
                                                    (100, 200, 64), (1000, 2, 100)])
def test_profile_batch_is_the_largest_step(tokens, seqs, model_len):
    out = profile_batch(tokens, seqs, model_len, 16)
    assert out.num_tokens == tokens
    assert all(c.sample and c.start == 0 for c in out.chunks)
    assert all(c.num_tokens < model_len for c in out.chunks)
    assert len(out.chunks) == max(min(seqs, tokens), -(-tokens // (model_len - 1)))
    blocks = [b for c in out.chunks for b in c.block_ids]
    assert blocks == list(range(len(blocks)))  # distinct blocks, each chunk's own


def test_memory_budget_leaves_the_profiled_peak_out_of_the_kv():
    core = _core(memory_budget_bytes=64 * MIB)
    try:
        assert core.peak is not None and core.peak.num_tokens == 256
        assert core.peak.activation_bytes >= 0
        left = 64 * MIB - core.weights_footprint.resident_bytes - core.peak.activation_bytes
        assert core.kv_plan.num_blocks == left // core.kv_plan.bytes_per_block
    finally:
        core.close()


def test_explicit_block_count_needs_no_profile():
    core = _core(num_blocks=64)
    try:
        assert core.peak is None and core.kv_plan.num_blocks == 64
    finally:
        core.close()


def test_warm_up_leaves_no_trace_and_sizes_the_buffers():
    core = _core(num_blocks=64)
    try:
        seeds = core._seeds.getstate()
        assert core.warm_up() > 0 and core.warmed_up
        assert core.warm_up() == 0  # idempotent
        runner = core.executor.runner
        allocs = runner.num_buffer_allocs
        assert allocs >= 1
        s = core.stats()
        assert (s.num_free_blocks, s.prefix_cache_queries, s.num_running) == (64, 0, 0)
        assert core.profile.num_steps == 0 and not core.pool.cached
        assert core._seeds.getstate() == seeds  # warm-up draws no request seed
        core.add_request("r", list(range(1, 120)), SamplingParams(max_tokens=2, temperature=1.0))
        while core.has_unfinished_requests():
            core.step()
        assert runner.num_buffer_allocs == allocs  # the longest step fit the warm-up's buffers
    finally:
        core.close()


class _GatedCore(EngineCore):
    """Its warm-up waits for the test: Health is read while it runs."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.gate, self.started = threading.Event(), threading.Event()

    def warm_up(self) -> int:
        self.started.set()
        self.gate.wait(30)
        return super().warm_up()


def test_health_is_not_serving_until_warm_up_is_done():
    core = _GatedCore(EngineConfig(model="tiny", num_threads=1, cache=CacheConfig(num_blocks=64),
                                   scheduler=SchedulerConfig(max_num_seqs=8,
                                                             max_num_batched_tokens=256,
                                                             max_model_len=128)))
    info = InstanceInfo(model="tiny", role="unified", max_model_len=core.max_model_len,
                        vocab_size=core.tokenizer.vocab_size)

    at_hook = []  # Health as the after-warm-up hook sees it (the services freeze their heap there)

    async def main():
        engine = AsyncEngine(core, after_warm_up=lambda: at_hook.append(
            (core.warmed_up, health_response(engine, info).status)))
        engine.start(asyncio.get_running_loop())
        try:
            assert await asyncio.to_thread(core.started.wait, 10)
            assert health_response(engine, info).status == pb.HealthResponse.NOT_SERVING
            assert not core.warmed_up
            core.gate.set()
            assert await engine.wait_warmed_up()
            assert health_response(engine, info).status == pb.HealthResponse.SERVING
            # once, after the warm-up ran and before Health said SERVING
            assert at_hook == [(True, pb.HealthResponse.NOT_SERVING)]
            allocs = core.executor.runner.num_buffer_allocs
            stream = await engine.submit("first", list(range(1, 100)),
                                         SamplingParams(max_tokens=3, temperature=0.0))
            tokens = [t async for out in stream for t in out.new_token_ids]
            stream.close()
            assert len(tokens) == 3
            assert core.executor.runner.num_buffer_allocs == allocs  # no allocation paid
            assert engine.num_finished == 1  # warm-up requests are not counted as served
            assert core.profile.num_sampled == 3
        finally:
            core.gate.set()
            engine.stop()
            core.close()

    asyncio.run(main())

