"""EngineCore: the single-threaded loop that owns the model, the KV cache and the scheduler.

Lifecycle: construct (loads weights, plans and allocates the KV cache) -> `add_request` /
`abort_request` at any time between steps -> `step()` repeatedly while
`has_unfinished_requests()`. Not thread-safe: services drive it from one thread.

Bad input (`add_request`) raises ValueError naming the field; nothing is queued then, and every
other request goes on.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from pdserve.common.attention.backend import get_attention_backend
from pdserve.common.config import EngineConfig
from pdserve.common.engine.model_runner import ModelRunner
from pdserve.common.engine.output_processor import OutputProcessor
from pdserve.common.engine.outputs import (EngineStats, FinishReason, RequestOutput,
                                           TokenLogprob)
from pdserve.common.engine.request import Request, RequestStatus
from pdserve.common.engine.sampler import Sampler
from pdserve.common.engine.scheduler import Scheduler
from pdserve.common.kv.block_pool import BlockPool
from pdserve.common.kv.kv_cache_manager import KVCacheManager
from pdserve.common.kv.memory import plan_kv_blocks
from pdserve.common.models.llama import LlamaForCausalLM
from pdserve.common.models.registry import LoadedModel, load_model
from pdserve.common.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: Optional[LoadedModel] = None):
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        loaded = loaded or load_model(config.model, tiny_seed=config.tiny_model_seed)
        self.tokenizer = loaded.tokenizer
        self.model_config = cfg = loaded.config
        self.fingerprint = loaded.fingerprint
        backend = get_attention_backend(config.attention_backend, config.device)
        self.model = LlamaForCausalLM(cfg, backend)
        self.model.load_weights(loaded.weights.items())
        self.model.to(config.device).eval()
        cc = config.cache
        plan = plan_kv_blocks(cfg.kv_bytes_per_token, cc.block_size,
                              budget_bytes=cc.kv_cache_bytes, fraction=cc.kv_cache_fraction,
                              num_blocks=cc.num_blocks, device=config.device)
        self.kv_plan = plan
        self.max_model_len = min(config.scheduler.max_model_len, cfg.max_position_embeddings,
                                 plan.num_tokens)
        kv_caches = [torch.zeros(2, plan.num_blocks, cc.block_size, cfg.num_kv_heads,
                                 cfg.head_dim, device=config.device)
                     for _ in range(cfg.num_layers)]
        self.pool = BlockPool(plan.num_blocks, cc.enable_prefix_caching)
        self.kv = KVCacheManager(self.pool, cc.block_size, self.fingerprint)
        sc = config.scheduler
        self.scheduler = Scheduler(self.kv, sc.max_num_seqs, sc.max_num_batched_tokens,
                                   sc.enable_chunked_prefill)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.runner = ModelRunner(self.model, kv_caches, self.kv,
                                  Sampler(cfg.vocab_size, self.generator), config.device)
        self.outputs = OutputProcessor(self.tokenizer, self.max_model_len)
        self._aborted: list[RequestOutput] = []

    # -- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        self._validate(request_id, prompt_token_ids, params)
        max_tokens = min(params.max_tokens, self.max_model_len - len(prompt_token_ids))
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        req = Request(request_id, prompt_token_ids, params, max_tokens, generator=gen,
                      eos_token_ids=self.model_config.eos_token_ids or self.tokenizer.eos_token_ids)
        self.scheduler.add_request(req)
        self.outputs.add(req)

    def _validate(self, request_id, ids, params) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        if not ids:
            raise ValueError("prompt must not be empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; it must be shorter than the model "
                             f"length {self.max_model_len}")
        vocab = self.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got "
                             f"{min(ids)}..{max(ids)}")
        if request_id in self.scheduler.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")

    def abort_request(self, request_id: str) -> None:
        """Cancel in any state; idempotent. The next step() reports it as ABORT."""
        req = self.scheduler.finish(request_id, RequestStatus.CANCELLED)
        if req is None:
            return
        req.finish_reason = FinishReason.ABORT
        self._aborted.append(self.outputs.make_output(req, finished=True))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted)

    # -- the loop -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._aborted = self._aborted, []
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return outputs
        result = self.runner.execute(sched.scheduled)
        for req, n in sched.scheduled:
            req.num_computed_tokens += n
        lps = result.output.logprobs
        for i, (req, tok) in enumerate(zip(result.sampled, result.output.token_ids)):
            req.append_token(tok)
            if lps is not None and lps[i] is not None:
                req.logprobs.append(TokenLogprob(tok, lps[i][0], tuple(lps[i][1])))
            self.outputs.check_stop(req, tok)
        for req, _ in sched.scheduled:
            self.kv.cache_blocks(req)
        for req in result.sampled:
            finished = req.finish_reason is not None
            if finished:
                self.scheduler.finish(req.request_id, RequestStatus.FINISHED)
            outputs.append(self.outputs.make_output(req, finished))
        return outputs

    # -- introspection --------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_running=len(s.running), num_waiting=len(s.waiting), kv_usage=self.pool.usage,
            num_waiting_tokens=s.num_waiting_tokens, num_free_blocks=self.pool.num_free_blocks,
            num_total_blocks=self.pool.num_blocks, prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits, num_preemptions=s.num_preemptions)
