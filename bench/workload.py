"""Workload config -> the list of requests to send, repeatable from the seed."""

from __future__ import annotations

import numpy as np

from pdserve.bench.request import BenchRequest
from pdserve.bench.workload_config import WorkloadConfig


def build_requests(cfg: WorkloadConfig, tokenizer) -> list[BenchRequest]:
    from pdserve.bench import workload_synthetic as syn
    from pdserve.bench.text_gen import RandomText

    # A stream of its own, so the arrival times never shift the prompts (and vice versa).
    rng = np.random.default_rng([cfg.seed, 1])
    if cfg.kind == "jsonl":
        from pdserve.bench.workload_jsonl import jsonl_requests

        return jsonl_requests(cfg, rng, lambda s: len(tokenizer.encode(s)))
    if cfg.kind == "sharegpt":
        from pdserve.bench.sharegpt import sharegpt_requests

        return sharegpt_requests(cfg, tokenizer, rng)
    make = {"random": syn.random_requests, "prefix": syn.prefix_requests,
            "chat": syn.chat_requests}[cfg.kind]
    return make(cfg, RandomText(tokenizer), rng)
