"""Offline Python interface: `LLM(...).generate(prompts, params)` and `.chat(messages, params)`."""

from __future__ import annotations

import itertools
from typing import Optional, Sequence, Union

from pdserve.common.config import EngineConfig
from pdserve.common.engine.engine_core import EngineCore
from pdserve.common.engine.outputs import CompletionOutput
from pdserve.common.sampling_params import SamplingParams

Prompt = Union[str, Sequence[int]]
Messages = list[dict]


class LLM:
    def __init__(self, config: Optional[EngineConfig] = None, loaded=None, **kwargs):
        """`LLM(EngineConfig(...))` or `LLM(model="smollm2", ...)` (EngineConfig fields);
        `loaded` reuses an already loaded `LoadedModel` (several engines, one load)."""
        self.engine = EngineCore(config or EngineConfig(**kwargs), loaded)
        self.engine.warm_up()  # the first generate() pays no kernel load or allocation
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 params: Union[SamplingParams, Sequence[SamplingParams], None] = None
                 ) -> list[CompletionOutput]:
        """Prompts are strings (tokenized without special tokens) or lists of token ids.
        Results come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        return self._run(ids, params)

    def chat(self, messages: Union[Messages, Sequence[Messages]],
             params: Union[SamplingParams, Sequence[SamplingParams], None] = None
             ) -> list[CompletionOutput]:
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        return self._run([self.tokenizer.encode_chat(c) for c in convs], params)

    def _run(self, prompts: list[list[int]], params) -> list[CompletionOutput]:
        params = params or SamplingParams()
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} sampling params for {len(prompts)} prompts")
        results: dict[str, CompletionOutput] = {}
        order = []
        for ids, p in zip(prompts, plist):
            rid = f"llm-{next(self._ids)}"
            self.engine.add_request(rid, ids, p)
            order.append(rid)
            results[rid] = CompletionOutput(rid, list(ids), [], "", None,
                                            [] if p.logprobs is not None else None)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                res = results[out.request_id]
                res.token_ids.extend(out.new_token_ids)
                res.text += out.new_text
                if out.logprobs:
                    res.logprobs.extend(out.logprobs)
                if out.finished:
                    res.finish_reason = out.finish_reason
                    res.num_cached_tokens = out.num_cached_tokens
        return [results[r] for r in order]
