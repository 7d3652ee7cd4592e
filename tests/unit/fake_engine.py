"""A stand-in for EngineCore implementing the same EngineClient protocol, for service tests
that need no model.

Byte-level tokenizer (token id == byte value, EOS = 0); each step emits one token per running
request: the previous token + 1 (mod 256, skipping EOS unless `eos_after` says so). Blocks are
taken when a request is added and returned on finish/abort, so tests can check the pool.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

from pdserve.common.engine.step_profile import StepProfile
from pdserve.common.engine.outputs import (EngineStats, FinishReason, RequestOutput,
                                           TokenLogprob)


class FakeTokenizer:
    eos_token_ids = (0,)
    vocab_size = 256
    chat_template = None  # renders no tools

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_releasing_gil(self, text: str) -> list[int]:
        return self.encode(text)

    def decode(self, ids, skip_special_tokens=True) -> str:
        return bytes(i for i in ids if i).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt=True) -> str:
        body = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return body + ("<assistant>" if add_generation_prompt else "")

    def encode_chat(self, messages, add_generation_prompt=True) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt))


class FakeEngineCore:  # implements pdserve.common.engine.protocol.EngineClient
    fingerprint = ""

    def __init__(self, num_blocks=64, block_size=4, max_model_len=512, step_s=0.002,
                 eos_after=None):
        self.tokenizer = FakeTokenizer()
        self.max_model_len = max_model_len
        self.num_total_blocks = num_blocks
        self.num_free_blocks = num_blocks
        self._block_size = block_size
        self._step_s = step_s
        self._eos_after = eos_after  # emit EOS as the n-th token
        self._reqs: dict[str, dict] = {}
        self._aborted: list[str] = []
        self.profile = StepProfile()
        self.num_warmups = 0  # warm_up() calls (the service warms up before SERVING)

    def warm_up(self):
        self.num_warmups += 1
        return 0

    def add_request(self, request_id, prompt_token_ids, params, first_token_id=None,
                    kv_transfer=None, resumed_token_ids=()):
        if first_token_id is not None or kv_transfer is not None or resumed_token_ids:
            raise ValueError("the fake engine does not continue prefilled requests")
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt too long for max_model_len={self.max_model_len}")
        if any(not 0 <= t < 256 for t in prompt_token_ids):
            raise ValueError("token id out of vocabulary")
        need = -(-(len(prompt_token_ids) + params.max_tokens) // self._block_size)
        if need > self.num_free_blocks:
            raise ValueError("out of blocks")  # the real engine queues; enough for tests
        self.num_free_blocks -= need
        self._reqs[request_id] = dict(ids=list(prompt_token_ids), params=params, out=[],
                                      blocks=need)

    def running_requests(self):
        """Every request runs in every step."""
        return [SimpleNamespace(request_id=r) for r in self._reqs]

    def set_token_budget(self, num_tokens):
        if num_tokens < 1:
            raise ValueError("a step's token budget must be at least 1")

    def abort_request(self, request_id):
        req = self._reqs.pop(request_id, None)
        if req is not None:
            self.num_free_blocks += req["blocks"]
            self._aborted.append(request_id)

    def has_unfinished_requests(self):
        return bool(self._reqs) or bool(self._aborted)

    def step(self):
        time.sleep(self._step_s)
        outs = [RequestOutput(rid, [], "", True, FinishReason.ABORT) for rid in self._aborted]
        self._aborted = []
        for rid, req in list(self._reqs.items()):
            outs.append(self._advance(rid, req))
        return outs

    def _advance(self, rid, req):
        p = req["params"]
        n = len(req["out"]) + 1
        last = (req["out"] or req["ids"])[-1]
        tok = 0 if self._eos_after == n else (last % 255) + 1
        req["out"].append(tok)
        reason = None
        if tok == 0 and not p.ignore_eos:
            reason = FinishReason.STOP
        elif n >= p.max_tokens:
            reason = FinishReason.LENGTH
        lps = None
        if p.logprobs is not None:
            lps = [TokenLogprob(tok, -0.5, tuple((tok, -0.5) for _ in range(p.logprobs)))]
        if reason is not None:
            self._reqs.pop(rid)
            self.num_free_blocks += req["blocks"]
        return RequestOutput(rid, [tok], self.tokenizer.decode([tok]), reason is not None,
                             reason, logprobs=lps, num_prompt_tokens=len(req["ids"]),
                             num_output_tokens=n)

    def stats(self):
        used = self.num_total_blocks - self.num_free_blocks
        return EngineStats(num_running=len(self._reqs), num_waiting=0,
                           kv_usage=used / self.num_total_blocks, num_waiting_tokens=0,
                           num_free_blocks=self.num_free_blocks,
                           num_total_blocks=self.num_total_blocks, prefix_cache_queries=0,
                           prefix_cache_hits=0, num_preemptions=0)

    def kv_transfer_stats(self):
        return None

    def cached_block_hashes(self, limit):
        return ()

    def get_request(self, request_id):
        return None  # no request internals: timelines get accept/finish stamps only

    def close(self):
        pass
