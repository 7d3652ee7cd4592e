"""`pdserve bench offline` times the engine an engine service runs with the same flags: both
EngineConfigs come from EngineServiceConfig, and only the KV cache's size (offline: sized to
the workload; served: planned from memory) may differ. If a default or a flag drifts on either
side (`pdserve serve decode`'s flags, bench offline's), these fail."""

import dataclasses

import pytest

from pdserve.bench.offline_engine import check_fits, served_engine_config
from pdserve.cli import build_parser
from pdserve.services.cli_serve import engine_service_config


def _both(flags: list[str], offline_only: tuple = ()):
    parser = build_parser()
    served = engine_service_config(parser.parse_args(["serve", "decode", *flags]))
    off_args = parser.parse_args(["bench", "offline", *flags, *offline_only])
    weights = "packed" if off_args.weights == "both" else off_args.weights
    offline = served_engine_config(off_args, weights, off_args.kv_cache_dtype, concurrency=8,
                                   tokens_per_request=off_args.input_len + off_args.output_len)
    return served.engine_config(), offline


def _without_kv_size(cfg):
    return dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, num_blocks=None))


@pytest.mark.parametrize("flags", [
    ["--num-threads", "2"],  # every other setting at its default on both sides
    ["--num-threads", "2", "--weights", "fp32", "--no-prefix-caching", "--max-num-seqs", "16",
     "--max-num-batched-tokens", "512", "--max-model-len", "1024", "--cpu-gemm", "torch",
     "--block-size", "32", "--kv-cache-dtype", "bfloat16"],
])
def test_offline_engine_is_the_served_engine(flags):
    served, offline = _both(flags)
    assert served.cache.num_blocks is None  # planned from memory when it serves
    assert offline.cache.num_blocks > 0
    assert _without_kv_size(offline) == served


def test_offline_kv_cache_holds_the_workload():
    _, offline = _both(["--block-size", "32"], ("--input-len", "100", "--output-len", "28"))
    # 8 requests of 128 tokens in 32-token blocks, and room for each one's partial block
    assert offline.cache.num_blocks >= 8 * 128 // 32 + 8


def test_offline_refuses_a_workload_longer_than_max_model_len():
    _, offline = _both(["--max-model-len", "256"])
    with pytest.raises(ValueError, match="max_model_len 256"):
        check_fits(offline, 200, 57)
    check_fits(offline, 200, 56)
