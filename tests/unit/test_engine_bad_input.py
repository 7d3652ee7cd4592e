"""Bad input raises ValueError naming the field; the engine keeps serving everyone else, and
cancelling in any state gives every block back."""

import pytest
import torch

from pdserve.common.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.common.engine.engine_core import EngineCore
from pdserve.common.engine.outputs import FinishReason
from pdserve.common.models.registry import load_model
from pdserve.common.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def core():
    torch.set_num_threads(1)
    return EngineCore(EngineConfig(model="tiny", num_threads=1,
                                   cache=CacheConfig(num_blocks=64),
                                   scheduler=SchedulerConfig(max_model_len=256,
                                                             max_num_batched_tokens=64)))


def drain(core, outs=None):
    outs = {} if outs is None else outs
    while core.has_unfinished_requests():
        for o in core.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


@pytest.mark.parametrize("ids, match", [
    ([], "prompt must not be empty"),
    (list(range(1, 300)), "shorter than the model length"),
    ([1, 2, 99999], r"prompt token ids must be in \[0, 320\)"),
    ([-1, 2], r"prompt token ids must be in"),
])
def test_bad_prompts(core, ids, match):
    core.add_request("good", [1, 2, 3], SamplingParams(max_tokens=5, temperature=0))
    with pytest.raises(ValueError, match=match):
        core.add_request("bad", ids, SamplingParams())
    outs = drain(core)
    assert set(outs) == {"good"} and outs["good"][-1].finish_reason is not None
    assert core.num_free_blocks == core.num_total_blocks


@pytest.mark.parametrize("kw, field", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -3}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"), ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"), ({"min_p": 2.0}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"logprobs": 50}, "logprobs"),
])
def test_bad_sampling_params_name_the_field(kw, field):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        SamplingParams(**kw)


def test_unknown_model_path():
    with pytest.raises(ValueError, match="unknown model '/no/such/model.gguf'"):
        load_model("/no/such/model.gguf")


def test_duplicate_request_id(core):
    core.add_request("dup", [1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        core.add_request("dup", [1, 2], SamplingParams(max_tokens=2))
    drain(core)


def test_cancel_waiting_and_running_frees_everything(core):
    for i in range(4):
        core.add_request(f"c{i}", list(range(1, 100)), SamplingParams(max_tokens=50,
                                                                     ignore_eos=True))
    core.step()  # budget 64: c0 partly prefilled (running), others waiting
    assert core.stats().num_running >= 1 and core.stats().num_waiting >= 1
    core.abort_request("c0")  # running
    core.abort_request("c3")  # waiting
    core.abort_request("c3")  # idempotent
    core.abort_request("nope")  # unknown: ignored
    outs = {}
    for _ in range(3):
        for o in core.step():
            outs.setdefault(o.request_id, []).append(o)
    core.abort_request("c1")
    drain(core, outs)
    assert outs["c0"][-1].finish_reason == FinishReason.ABORT
    assert outs["c3"][-1].finish_reason == FinishReason.ABORT
    assert outs["c1"][-1].finish_reason == FinishReason.ABORT
    assert outs["c2"][-1].finish_reason == FinishReason.LENGTH
    assert core.num_free_blocks == core.num_total_blocks
    assert not core.kv.req_blocks


def test_finished_output_carries_the_timeline(core):
    core.add_request("t", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0))
    final = [o for outs in drain(core).values() for o in outs if o.finished][0]
    tl = final.timeline
    assert tl["waiting"] <= tl["running"] <= tl["first_token"] <= tl["finished"]


def test_token_budget_and_running_requests(core):
    """The two scheduler knobs the engine host drives through EngineClient: a budget below 1
    is refused; a set budget bounds the next step's tokens; the running
    requests are the step's batch."""
    with pytest.raises(ValueError, match="at least 1"):
        core.set_token_budget(0)
    core.set_token_budget(8)
    try:
        core.add_request("long", list(range(250, 290)), SamplingParams(max_tokens=2, temperature=0))
        assert core.running_requests() == []
        core.step()
        assert [r.request_id for r in core.running_requests()] == ["long"]
        assert core.profile.last_step_tokens == 8  # 8 of the 40 prompt tokens: one budget
    finally:
        core.set_token_budget(64)
    drain(core)
    assert core.running_requests() == [] and core.num_free_blocks == core.num_total_blocks
