"""EngineCore: the single-threaded loop that owns the model, the KV cache and the scheduler.

Lifecycle: construct (loads weights, plans and allocates the KV cache) -> `add_request` /
`abort_request` at any time between steps -> `step()` repeatedly while
`has_unfinished_requests()`. Not thread-safe: services drive it from one thread.

Bad input (`add_request`) raises ValueError naming the field; nothing is queued then, and every
other request goes on.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

import torch

from pdserve.common.attention.backend import get_attention_backend
from pdserve.common.attention.cpu_native import load_cpu_kernels
from pdserve.common.config import EngineConfig
from pdserve.common.engine.kv_connector import KVConnector
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
from pdserve.common.models.cpu_gemm import pack_linears, resolve_cpu_gemm
from pdserve.common.models.llama import LlamaForCausalLM
from pdserve.common.models.registry import LoadedModel, load_model
from pdserve.common.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: Optional[LoadedModel] = None,
                 connector_factory: Optional[Callable[["EngineCore"], KVConnector]] = None):
        """`connector_factory(engine)` builds the KV connector once the model and its KV
        geometry are known (it may read engine.model_config, engine.fingerprint, ...)."""
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
        self.cpu_gemm = resolve_cpu_gemm(config.cpu_gemm, config.device)
        if self.cpu_gemm == "onednn":
            pack_linears(self.model)
        native = load_cpu_kernels() if config.device == "cpu" else None
        if native is not None:
            self.model.use_cpu_kernels(native)
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
        self.connector = connector_factory(self) if connector_factory else None
        if self.connector is not None:
            self.connector.register_kv_caches(kv_caches)
        sc = config.scheduler
        self.scheduler = Scheduler(self.kv, sc.max_num_seqs, sc.max_num_batched_tokens,
                                   sc.enable_chunked_prefill, self.connector)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.runner = ModelRunner(self.model, kv_caches, self.kv,
                                  Sampler(cfg.vocab_size, self.generator), config.device,
                                  self.connector)
        self.outputs = OutputProcessor(self.tokenizer, self.max_model_len)
        self._aborted: list[RequestOutput] = []
        self._awaiting_save: dict[str, RequestOutput] = {}  # finished, KV still being saved

    # -- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, first_token_id: Optional[int] = None,
                    kv_params: Optional[dict] = None) -> None:
        """`first_token_id`: the first output token, sampled elsewhere (a prefill instance)
        and already delivered; generation continues after it. `kv_params`: hints for the KV
        connector (e.g. "block_keys", the stored prompt blocks)."""
        self._validate(request_id, prompt_token_ids, params)
        if first_token_id is not None:
            self._validate(request_id, [first_token_id], params)
        max_tokens = min(params.max_tokens, self.max_model_len - len(prompt_token_ids))
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        req = Request(request_id, prompt_token_ids, params, max_tokens, generator=gen,
                      eos_token_ids=self.model_config.eos_token_ids or self.tokenizer.eos_token_ids)
        if first_token_id is not None:
            if max_tokens < 2:
                raise ValueError("max_tokens must be >= 2 when the first token is given")
            req.append_token(first_token_id)
        req.kv_params = dict(kv_params or {})
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
        return (self.scheduler.has_unfinished() or bool(self._aborted)
                or bool(self._awaiting_save))

    # -- the loop -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._aborted = self._aborted, []
        self.scheduler.poll_connector()
        for rid in self.scheduler.saved_ids:
            if rid in self._awaiting_save:
                outputs.append(self._awaiting_save.pop(rid))
        self.scheduler.saved_ids.clear()
        if outputs:  # answers whose KV just landed go out now, not after another forward
            return outputs
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            if self.scheduler.kv_waiting or self.scheduler.held or self.scheduler.lookup_pending:
                time.sleep(0.0005)  # only connector I/O is pending: don't spin
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
            outputs.extend(self._emit(req))
        return outputs

    def _emit(self, req: Request) -> list[RequestOutput]:
        finished = req.finish_reason is not None
        if finished:
            self.scheduler.finish(req.request_id, RequestStatus.FINISHED)
        out = self.outputs.make_output(req, finished)
        if finished and self.connector is not None:
            out.block_hashes = req.block_hashes[:req.num_prompt_tokens // self.kv.block_size]
            if (req.request_id in self.scheduler.held
                    and self.connector.finish_waits_for_save()):
                self._awaiting_save[req.request_id] = out
                return []
        return [out]

    def close(self) -> None:
        if self.connector is not None:
            self.connector.close()

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
            prefix_cache_hits=self.kv.prefix_hits, num_preemptions=s.num_preemptions,
            num_waiting_for_kv=len(s.kv_waiting), num_kv_load_failures=s.num_load_failures)
