"""Pipeline parallel on the CPU: greedy tokens with P stages (and T x P ranks) equal P=1 and
transformers (with and without GQA, tied embeddings read by the last stage, layers that split
unevenly, chunked prefill, prefix hits and preemption in the run); two batches are in flight
at once and hold disjoint requests; more stages than layers, and a KV connector with CUDA
ranks, are refused before any process starts; a worker killed mid-run ends the engine with an
error and leaves no process behind, also when the dead rank is one rank 0 has no link to."""

import dataclasses

import pytest

from pdserve.common.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from pdserve.common.engine.engine_core import EngineCore
from pdserve.common.engine.llm import LLM
from pdserve.common.models.registry import load_model
from pdserve.common.sampling_params import SamplingParams

from tests.unit.test_tensor_parallel import (GREEDY, PROMPTS, _children,
                                             assert_service_dies_with, build_hf_model,
                                             hf_greedy, kill_while_stepping, run_engine)

transformers = pytest.importorskip("transformers")

# PROMPTS: the long prompt is chunked (16-token budget); the last shares the second's blocks
# hidden, heads, kv heads, tied embeddings, (tensor, pipeline) layouts; 3 layers: P=2 splits
# them 2 + 1, P=3 one each
MODELS = {"gqa": (64, 8, 4, False, ((1, 2), (2, 2))),
          "mha-tied": (64, 4, 4, True, ((1, 2), (1, 3)))}


def hf_model(name, tmp_path):
    hidden, heads, kv_heads, tied, _ = MODELS[name]
    return build_hf_model(tmp_path, hidden, heads, kv_heads, 320, tied, layers=3)


def engine_config(tp, pp, num_blocks=64, budget=16, block_size=16, all_reduce="auto"):
    return EngineConfig(model="tiny", num_threads=1,
                        cache=CacheConfig(num_blocks=num_blocks, block_size=block_size),
                        scheduler=SchedulerConfig(max_num_batched_tokens=budget,
                                                  max_model_len=256),
                        parallel=ParallelConfig(tensor_parallel_size=tp,
                                                pipeline_parallel_size=pp,
                                                all_reduce=all_reduce))


def generate(loaded, tp, pp, num_blocks=64, block_size=16, all_reduce="auto"):
    """Tokens of PROMPTS, then of the last prompt again (a prefix hit on its full blocks:
    with P > 1 the first run's prompts are in flight together, before any block is cached)."""
    return run_engine(engine_config(tp, pp, num_blocks, block_size=block_size,
                                    all_reduce=all_reduce), loaded, PROMPTS, PROMPTS[-1:])


@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_pp_equals_pp1_and_transformers(name, tmp_path):
    hf, loaded = hf_model(name, tmp_path)
    ref = hf_greedy(hf, PROMPTS + PROMPTS[-1:])
    single, _ = generate(loaded, 1, 1)
    assert single == ref
    for tp, pp in MODELS[name][4]:
        got, stats = generate(loaded, tp, pp)
        assert got == ref, (name, tp, pp)
        assert stats.prefix_cache_hits >= 32  # the repeated prompt reused its 2 full blocks


def test_tp2_pp2_summing_over_per_stage_gloo_subgroups_equals_pp1(tmp_path):
    """`all_reduce="gloo"`: each stage's TP ranks all-reduce in their own gloo subgroup (the
    default path sums through per-stage shared memory instead)."""
    _, loaded = hf_model("gqa", tmp_path)
    single, _ = generate(loaded, 1, 1)
    got, _ = generate(loaded, 2, 2, all_reduce="gloo")
    assert got == single


def test_greedy_pp2_with_preemption(tmp_path):
    _, loaded = hf_model("gqa", tmp_path)
    pp1, s1 = generate(loaded, 1, 1, num_blocks=20, block_size=4)
    pp2, s2 = generate(loaded, 1, 2, num_blocks=20, block_size=4)
    assert s1.num_preemptions > 0 and s2.num_preemptions > 0
    assert pp2 == pp1


def test_two_batches_in_flight_hold_disjoint_requests_and_an_abort_in_flight_is_safe():
    loaded = load_model("tiny")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = {f"r{i}": [5 + i, 9, 11 + i] for i in range(4)}
    ref = {}
    llm = LLM(engine_config(1, 1), loaded=loaded)
    for rid, out in zip(prompts, llm.generate(list(prompts.values()), params)):
        ref[rid] = out.token_ids
    llm.engine.close()
    core = EngineCore(engine_config(1, 2), loaded)
    ex = core.executor
    flying = []  # the request ids of each batch submitted and not yet collected
    overlaps = []  # flying at each submit, after it
    submit, collect = ex.submit, ex.collect

    def tracked_submit(out):
        submit(out)
        flying.append({c.request_id for c in out.chunks})
        overlaps.append(list(flying))

    def tracked_collect():
        flying.pop(0)
        return collect()

    ex.submit, ex.collect = tracked_submit, tracked_collect
    try:
        for rid, prompt in prompts.items():
            core.add_request(rid, prompt, params)
        core.add_request("gone", [7, 7, 7], params)
        got = {rid: [] for rid in prompts}
        aborted, steps = False, 0
        while core.has_unfinished_requests() and steps < 200:
            for out in core.step():
                if out.request_id in got:
                    got[out.request_id].extend(out.new_token_ids)
            steps += 1
            if not aborted and any("gone" in b for b in flying):
                core.abort_request("gone")  # its batch is still down the pipeline
                aborted = True
        assert aborted and max(len(f) for f in overlaps) == 2
        for f in overlaps:
            if len(f) == 2:
                assert not f[0] & f[1]
        assert got == ref
        assert core.get_request("gone") is None
    finally:
        core.close()


def test_more_stages_than_layers_and_a_connector_on_cuda_are_refused_before_processes_start():
    """(A KV connector with stages on the CPU works: tests/unit/test_kv_layouts.py.)"""
    loaded = load_model("tiny")  # 2 layers
    before = _children()
    with pytest.raises(ValueError, match="larger than the model's 2 decoder layers"):
        EngineCore(engine_config(1, 3), loaded)
    with pytest.raises(NotImplementedError, match="KV connector .* needs CPU ranks"):
        EngineCore(dataclasses.replace(engine_config(1, 2), device="cuda"), loaded,
                   connector_factory=lambda engine: None)
    assert _children() == before


@pytest.mark.parametrize("tp, victim", [(1, 1), (2, 3)])
def test_a_killed_worker_ends_the_engine_with_an_error_and_no_leftovers(tp, victim):
    """(2, 3): rank 3 is the last stage's second tensor rank, which rank 0 never talks to:
    its stage peer waits for it in the shared-memory barrier."""
    core = EngineCore(engine_config(tp, 2, num_blocks=64, budget=64), load_model("tiny"))
    procs = core.executor.workers.procs
    pids = {p.pid for p in procs}
    for i in range(3):
        core.add_request(f"r{i}", list(range(1 + i, 40)),
                         SamplingParams(max_tokens=200, ignore_eos=True))
    core.step()
    kill_while_stepping(core, procs[victim - 1])
    assert not pids & _children()


def test_a_dead_stage_makes_the_service_engine_unhealthy():
    core = EngineCore(engine_config(1, 2, num_blocks=64, budget=64), load_model("tiny"))
    (proc,) = core.executor.workers.procs
    assert_service_dies_with(core, proc)
