"""Prompts from a JSONL file, one request a line.

Each line holds one of "prompt" (text), "prompt_ids" (token ids) or "messages" (a chat, a list
of {"role", "content"}), and optionally "max_tokens" (else drawn from the output length
distribution) and "tier" (else the workload's tier). Blank lines are skipped. The file is
cycled when it has fewer lines than num_prompts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from pdserve.bench.request import BenchRequest
from pdserve.bench.workload_config import WorkloadConfig


def parse_line(obj: dict, tier: str, max_tokens: int,
               count: Optional[Callable[[str], int]] = None) -> BenchRequest:
    tier = str(obj.get("tier") or tier)
    max_tokens = int(obj.get("max_tokens") or max_tokens)
    if "messages" in obj:
        msgs = tuple((str(m["role"]), str(m["content"])) for m in obj["messages"])
        n = sum(count(c) for _, c in msgs) if count else 0
        return BenchRequest(tier, max_tokens, messages=msgs, prompt_len=n)
    if "prompt_ids" in obj:
        ids = tuple(int(i) for i in obj["prompt_ids"])
        return BenchRequest(tier, max_tokens, prompt_ids=ids, prompt_len=len(ids))
    if "prompt" in obj:
        text = str(obj["prompt"])
        return BenchRequest(tier, max_tokens, prompt=text, prompt_len=count(text) if count else 0)
    raise ValueError(f"jsonl line needs prompt, prompt_ids or messages: {sorted(obj)}")


def jsonl_requests(cfg: WorkloadConfig, rng: np.random.Generator,
                   count: Optional[Callable[[str], int]] = None) -> list[BenchRequest]:
    lines = [ln for ln in Path(cfg.path).read_text().splitlines() if ln.strip()]
    if not lines:
        raise ValueError(f"{cfg.path}: no prompts")
    outs = cfg.output_len.sample(rng, cfg.num_prompts)
    reqs = []
    for j in range(cfg.num_prompts):
        num = j % len(lines)
        try:
            reqs.append(parse_line(json.loads(lines[num]), cfg.tier_name, outs[j], count))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{cfg.path} line {num + 1}: {exc}") from None
    return reqs
