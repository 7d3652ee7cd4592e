"""One request a workload asks the load generator to send.

A request is a completion (text or token ids) or a chat (messages). In a multi-turn chat,
`conversation` names the conversation and `messages` holds only this turn's new user message:
the runner prepends the history, including the server's real replies to earlier turns, so
each turn waits for the one before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class BenchRequest:
    tier: str
    max_tokens: int
    prompt: Optional[str] = None
    prompt_ids: Optional[tuple[int, ...]] = None
    messages: Optional[tuple[tuple[str, str], ...]] = None  # (role, content)
    prompt_len: int = 0  # the workload's token count for the prompt (0 = unknown)
    conversation: Optional[int] = None
    turn: int = 0

    def __post_init__(self):
        given = [x is not None for x in (self.prompt, self.prompt_ids, self.messages)]
        if sum(given) != 1:
            raise ValueError("a bench request needs exactly one of prompt, prompt_ids, "
                             "messages")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.tier:
            raise ValueError("tier must be a non-empty name")
        if self.conversation is not None and self.messages is None:
            raise ValueError("a conversation turn must be a chat (messages)")

    @property
    def is_chat(self) -> bool:
        return self.messages is not None
