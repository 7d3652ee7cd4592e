"""How compare pins the two stacks, and its config checks."""

import pytest

from pdserve.bench.arrivals import ArrivalConfig
from pdserve.bench.compare import CompareConfig, default_stack_args
from pdserve.bench.serve import ServeConfig
from pdserve.bench.sweep import SweepConfig
from pdserve.bench.target import TargetConfig
from pdserve.bench.workload_config import WorkloadConfig


def test_colocated_gets_every_core_with_a_thread_each():
    assert default_stack_args("colocated", (0, 1)) == ("--cpus", "0,1", "--num-threads", "2")


def test_disagg_splits_the_cores_between_prefill_and_decode():
    assert default_stack_args("disagg", (0, 1, 2, 3)) == (
        "--prefill-cpus", "0,1", "--prefill-threads", "2",
        "--decode-cpus", "2,3", "--decode-threads", "2")
    one = default_stack_args("disagg", (5,))  # one core: both on it, one thread each
    assert one == ("--prefill-cpus", "5", "--prefill-threads", "1",
                   "--decode-cpus", "5", "--decode-threads", "1")


def sweep():
    serve = ServeConfig(TargetConfig(), WorkloadConfig(), ArrivalConfig("poisson"))
    return SweepConfig(serve, rates=(1.0, 2.0))


def test_given_args_replace_the_defaults_and_common_args_follow():
    cfg = CompareConfig(sweep(), model="tiny", colocated_args=("--cpus", "1"),
                        common_args=("--max-model-len", "512"))
    assert cfg.spec("colocated").extra_args == ("--cpus", "1", "--max-model-len", "512")
    assert cfg.spec("disagg").extra_args[:2] == ("--prefill-cpus", "0")


def test_config_checks():
    with pytest.raises(ValueError):
        CompareConfig(sweep(), cores=())
    with pytest.raises(ValueError):
        CompareConfig(sweep(), modes=("pipelined",))
    with pytest.raises(ValueError):  # a sweep needs rates, not fixed concurrency
        SweepConfig(ServeConfig(TargetConfig(), WorkloadConfig(),
                                ArrivalConfig("concurrency", concurrency=2)), rates=(1.0,))


def test_every_sweep_run_gets_its_own_prompts():
    from pdserve.bench.sweep import _requests

    cfg = sweep()
    prompts = [[(r.prompt, r.prompt_ids) for r in _requests(cfg, run)] for run in (-1, 0, 1)]
    assert prompts[1] == [(r.prompt, r.prompt_ids) for r in _requests(cfg, 0)]  # repeatable
    assert prompts[0] != prompts[1] != prompts[2]  # no prefix-cache hits across runs
