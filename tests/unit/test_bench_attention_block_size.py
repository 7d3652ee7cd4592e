"""bench/attention_block_size.py: its cases are paged at the asked block size, and its flags are
bounded."""

import pytest
from pdserve.bench.attention_block_size import parse_args
from pdserve.bench.attention_cpu import make_case


def test_make_case_lays_out_blocks_of_the_asked_size():
    caches, query, meta = make_case(3, 70, block=32)
    assert caches[0].shape[2] == 32
    assert meta.block_tables.shape == (3, 3)  # ceil(70 / 32) pages per request
    assert int(meta.block_tables.max()) < caches[0].shape[1]


def test_make_case_rejects_a_block_size_not_a_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        make_case(2, 16, block=24)


@pytest.mark.parametrize("argv", [["--block-sizes", "16,24"], ["--block-sizes", "512"],
                                  ["--kv-dtypes", "int8"], ["--rounds", "0"], ["--ctx", "0"]])
def test_parse_args_rejects_out_of_range_flags(argv):
    with pytest.raises(ValueError):
        parse_args(argv)


def test_parse_args_splits_the_lists():
    args = parse_args(["--block-sizes", "16,128", "--kv-dtypes", "float32"])
    assert args.block_sizes == [16, 128] and args.kv_dtypes == ["float32"]
