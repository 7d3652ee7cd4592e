"""Which tokenizer a bench draws its prompts with, checked against what the server serves.

Random workloads draw token ids from the tokenizer's vocabulary; ids past the served model's
vocabulary are refused (HTTP 400) and the run measures nothing. So the default tokenizer is
the served model's own (the id `/v1/models` lists), and a tokenizer whose vocabulary is larger
than the served one (`vocab_size` in `/v1/models`) is refused before any request is sent.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from pdserve.bench.target import TargetConfig

log = logging.getLogger(__name__)

FALLBACK = "smollm2"


@dataclass(frozen=True)
class ServedModel:
    id: str
    vocab_size: Optional[int] = None  # None: the server does not say (a peer, say)


def served_model(target: TargetConfig, timeout_s: float = 10.0) -> Optional[ServedModel]:
    """The first model of an HTTP target's /v1/models; None for gRPC or when unreachable."""
    if target.api != "http":
        return None
    import httpx

    try:
        r = httpx.get(f"{target.base_url.rstrip('/')}/v1/models", timeout=timeout_s)
        r.raise_for_status()
        data = r.json()["data"]
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        log.warning("cannot read %s/v1/models: %s", target.base_url, exc)
        return None
    card = next((c for c in data if c.get("id") == target.model_name), data[0] if data else None)
    if card is None:
        return None
    vocab = card.get("vocab_size")
    return ServedModel(card["id"], int(vocab) if isinstance(vocab, int) and vocab > 0 else None)


def _vocab_size(name: str) -> Optional[int]:
    from pdserve.bench.text_gen import load_tokenizer

    try:
        return load_tokenizer(name).vocab_size
    except Exception as exc:  # an unknown name or path: the caller decides what follows
        log.debug("no tokenizer %r: %s", name, exc)
        return None


def resolve_tokenizer(name: str, target: TargetConfig) -> str:
    """`name`, or when '' the served model's (FALLBACK when it cannot be loaded here).
    ValueError when its vocabulary is larger than the served model's."""
    served = served_model(target)
    if not name:
        name = served.id if served is not None and _vocab_size(served.id) else FALLBACK
        print(f"bench: prompts drawn with the {name!r} tokenizer", flush=True)
    if served is not None and served.vocab_size is not None:
        mine = _vocab_size(name)
        if mine is None:
            raise ValueError(f"cannot load tokenizer {name!r}")
        if mine > served.vocab_size:
            raise ValueError(
                f"the workload's tokenizer {name!r} has {mine} token ids but the served model "
                f"{served.id!r} accepts {served.vocab_size}: every request would be refused; "
                f"pass --tokenizer with the served model's tokenizer")
    return name
