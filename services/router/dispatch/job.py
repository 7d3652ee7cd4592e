"""A request as the router runs it: one engine request per choice (prompt x n)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from pdserve.common.random_stream import derive_seed
from pdserve.common.sampling_params import SamplingParams
from pdserve.services.router.api.errors import bad_request


@dataclass(frozen=True)
class Choice:
    index: int
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams


@dataclass(frozen=True)
class Job:
    request_id: str
    choices: tuple[Choice, ...]
    cache_salt: Optional[str] = None
    n: int = 1  # choices per prompt: choice i answers prompt i // n

    def __post_init__(self):
        if not self.choices:
            raise ValueError("a job needs at least one choice")
        if self.n < 1 or len(self.choices) % self.n:
            raise ValueError(f"n must divide the number of choices, got n={self.n}")
        if [c.index for c in self.choices] != list(range(len(self.choices))):
            raise ValueError("choice indices must be 0..len-1 in order")


def fan_out(request_id: str, prompts: list[list[int]], params: SamplingParams, n: int,
            max_n: int, cache_salt: Optional[str]) -> Job:
    """n choices per prompt, indexed prompt-major as OpenAI does; choice j of a seeded request
    samples with derive_seed(seed, j) (j = 0 keeps the seed)."""
    if not 1 <= n <= max_n:
        raise bad_request(f"n must be in [1, {max_n}], got {n}", param="n")
    if len(prompts) * n > max_n:
        raise bad_request(f"prompts x n must be at most {max_n}, got {len(prompts) * n}",
                          param="n")
    choices = []
    for prompt in prompts:
        for j in range(n):
            p = params if params.seed is None or j == 0 else \
                dataclasses.replace(params, seed=derive_seed(params.seed, j))
            choices.append(Choice(len(choices), tuple(prompt), p))
    return Job(request_id, tuple(choices), cache_salt, n)


def prompt_tokens(job: Job) -> int:
    """Usage counts each prompt once, however many choices it has."""
    return sum(len(c.prompt_token_ids) for c in job.choices[::job.n])
