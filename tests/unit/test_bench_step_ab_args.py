"""The batch-1 step A/B benches' shared flags (bench/packed_stack_ab.py, bench/kernel_ab.py):
bounded before any engine is built, torch's thread count set from them."""

from __future__ import annotations

import argparse

import pytest
import torch

from pdserve.bench.packed_stack_ab import parse_step_ab_args


@pytest.mark.parametrize("bad", [["--rounds", "0"], ["--rounds", "201"], ["--output-len", "1"],
                                 ["--input-len", "0"], ["--num-threads", "0"]])
def test_out_of_range_flags_raise(bad):
    with pytest.raises(ValueError):
        parse_step_ab_args(argparse.ArgumentParser(), bad, rounds=5)


def test_defaults_and_threads():
    before = torch.get_num_threads()
    try:
        args = parse_step_ab_args(argparse.ArgumentParser(), ["--num-threads", "1"], rounds=7)
        assert (args.rounds, args.input_len, args.output_len) == (7, 256, 128)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
