"""Synthetic workloads: random lengths, shared prefixes, multi-turn chat."""

from __future__ import annotations

import numpy as np

from pdserve.bench.request import BenchRequest
from pdserve.bench.text_gen import RandomText
from pdserve.bench.workload_config import WorkloadConfig


def _completion(gen: RandomText, cfg: WorkloadConfig, ids: tuple[int, ...],
                max_tokens: int) -> BenchRequest:
    # auto -> ids: exact lengths, and every OpenAI-compatible completions API takes them.
    if cfg.prompt_format == "text":
        return BenchRequest(cfg.tier_name, max_tokens, prompt=gen.text(ids), prompt_len=len(ids))
    return BenchRequest(cfg.tier_name, max_tokens, prompt_ids=ids, prompt_len=len(ids))


def random_requests(cfg: WorkloadConfig, gen: RandomText,
                    rng: np.random.Generator) -> list[BenchRequest]:
    n = cfg.num_prompts
    ins, outs = cfg.input_len.sample(rng, n), cfg.output_len.sample(rng, n)
    return [_completion(gen, cfg, gen.ids(rng, i), o) for i, o in zip(ins, outs)]


def prefix_requests(cfg: WorkloadConfig, gen: RandomText,
                    rng: np.random.Generator) -> list[BenchRequest]:
    """Request j uses prefix j % N, so the prefixes interleave and each must stay cached."""
    prefixes = [gen.ids(rng, k) for k in cfg.prefix_len.sample(rng, cfg.num_prefixes)]
    n = cfg.num_prompts
    ins, outs = cfg.input_len.sample(rng, n), cfg.output_len.sample(rng, n)
    return [_completion(gen, cfg, prefixes[j % len(prefixes)] + gen.ids(rng, ins[j]), outs[j])
            for j in range(n)]


def chat_requests(cfg: WorkloadConfig, gen: RandomText,
                  rng: np.random.Generator) -> list[BenchRequest]:
    """Turn t of every conversation before turn t+1 of any, so conversations overlap; within
    a turn the conversations come in a seeded random order, as independent users do (in a
    fixed order, round-robin over an even number of instances would send every conversation
    to the same instance every turn, by accident). With `system_len`, each conversation's
    first turn opens with one of `num_prefixes` system prompts. The orders and the system
    prompts are drawn after the turns, so the turns' texts do not depend on them."""
    convs = -(-cfg.num_prompts // cfg.turns)
    ins = cfg.input_len.sample(rng, convs * cfg.turns)
    outs = cfg.output_len.sample(rng, convs * cfg.turns)
    texts = [gen.text(gen.ids(rng, n)) for n in ins]  # turn-major: index t * convs + c
    systems = [gen.text(gen.ids(rng, cfg.system_len)) for _ in range(cfg.num_prefixes)] \
        if cfg.system_len else []
    orders = [rng.permutation(convs) for _ in range(cfg.turns)]
    reqs = []
    for t in range(cfg.turns):
        for c in (int(x) for x in orders[t]):
            k = t * convs + c
            opening = (("system", systems[c % len(systems)]),) if systems and t == 0 else ()
            reqs.append(BenchRequest(cfg.tier_name, outs[k],
                                     messages=opening + (("user", texts[k]),),
                                     prompt_len=ins[k] + (cfg.system_len if opening else 0),
                                     conversation=c, turn=t))
    return reqs[:cfg.num_prompts]
