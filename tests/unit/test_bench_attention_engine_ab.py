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
