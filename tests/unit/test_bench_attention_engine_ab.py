"""bench/attention_engine_ab.py's flags: bounded before any kernel is built or engine loaded."""

from __future__ import annotations

import pytest

from pdserve.bench.attention_engine_ab import parse_args


@pytest.mark.parametrize("bad", [["--batch", "0"], ["--batch", "1025"], ["--steps", "3"],
                                 ["--input-len", "0"], ["--num-threads", "0"]])
def test_out_of_range_flags_raise(bad):
    with pytest.raises(ValueError):
        parse_args(["--a", "/nonexistent", *bad])


def test_defaults():
    args = parse_args(["--a", "/tmp/base"])
    assert (args.batch, args.input_len, args.steps, args.num_threads, args.b) == (64, 300, 60, 2,
                                                                                   None)


def test_a_is_required():
    with pytest.raises(SystemExit):
        parse_args([])


def test_the_module_paths_attention_is_timed():
    """With fp32 weights each layer attends through the backend's fused_forward, not the packed
    path's fused_step: both variants' steps time it (the bench timed fused_step alone and
    refused every fp32 run)."""
    from pdserve.bench.attention_engine_ab import _engine, run
    from pdserve.common.attention.cpu_native import load_cpu_kernels

    native = load_cpu_kernels()
    assert native is not None
    args = parse_args(["--a", "/unused", "--model", "tiny", "--weights", "fp32", "--batch", "4",
                       "--input-len", "24", "--steps", "8", "--num-threads", "1",
                       "--no-prefix-caching"])
    runs = run(args, _engine(args), {"a": native, "b": native})
    for r in runs.values():
        assert len(r["step_s"]) >= 3
        assert all(0 < a < s for a, s in zip(r["attention_s"], r["step_s"]))
