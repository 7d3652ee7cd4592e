"""EngineCore: the single-threaded loop that owns the scheduler, the KV cache and the model's
executor (rank 0 of the model, plus tensor- and pipeline-parallel workers when T x P > 1).

Lifecycle: construct (starts the workers, loads weights, plans and allocates the KV cache) ->
`add_request` / `abort_request` at any time between steps -> `step()` repeatedly while
`has_unfinished_requests()` -> `close()` (stops the workers and the KV connector). Not
thread-safe: services drive it from one thread. Implements `EngineClient` (protocol.py).

A step: the scheduler decides (`schedule`), the executor runs the forward on every rank, rank 0
samples, and the scheduler books the result (`update_from_output`); the engine only turns the
requests it returns into outputs. A step that raises (a dead worker) leaves the engine broken:
close it. With pipeline stages (P > 1) a `step()` starts the next batch before it books the
oldest one in flight (up to P in flight; the scheduler's batch queue), so the stages overlap;
a step that only started a batch returns no output.

Bad input (`add_request`) raises ValueError naming the field; nothing is queued then, and every
other request goes on.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from typing import Callable, Optional, Sequence

import torch

from pdserve.common.config import EngineConfig
from pdserve.common.distributed.executor import Executor, MultiProcExecutor, UniProcExecutor
from pdserve.common.distributed.layout import (SINGLE, RankPlace, TensorParallel,
                                              check_pp_split, check_tp_split, kv_head_range,
                                              pipeline_stage, vocab_shard)
from pdserve.common.distributed.rank_kv import RankKVFactory
from pdserve.common.distributed.kv_share import (by_tensor_rank, check_shareable_kv,
                                                map_all_kv)
from pdserve.common.engine.kv_connector import KVConnector
from pdserve.common.engine.kv_transfer import NO_KV_TRANSFER, KVTransferParams
from pdserve.common.engine.model_runner import ModelRunner
from pdserve.common.engine.output_processor import OutputProcessor
from pdserve.common.engine.rank_kv_link import RankKVLink
from pdserve.common.engine.outputs import EngineStats, FinishReason, RequestOutput
from pdserve.common.host_heap import apply_host_heap
from pdserve.common.engine.rank_model import allocate_kv_caches, build_rank_model, rank_device
from pdserve.common.kv.dtype import engine_kv_dtype, kv_bytes_per_token
from pdserve.common.engine.request import Request, RequestStatus
from pdserve.common.engine.sampler import Sampler
from pdserve.common.engine.scheduler import Scheduler
from pdserve.common.engine.scheduler_output import SchedulerOutput
from pdserve.common.kv.block_pool import BlockPool
from pdserve.common.kv.kv_cache_manager import KVCacheManager
from pdserve.common.kv.memory import available_memory_bytes, plan_kv_blocks
from pdserve.common.models.cpu_gemm import resolve_cpu_gemm
from pdserve.common.models.dtype import resolve_dtype
from pdserve.common.models.llama import tp_keeps_packed
from pdserve.common.models.quant.footprint import loaded_weights_footprint, weights_footprint
from pdserve.common.models.registry import LoadedModel, load_model
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.engine.step_profile import StepProfile
from pdserve.common.engine.startup import (PeakProfile, profile_batch, profile_peak_bytes,
                                           warmup_requests)

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: Optional[LoadedModel] = None,
                 connector_factory: Optional[Callable[["EngineCore"], KVConnector]] = None,
                 rank_kv: Optional[Callable[["EngineCore"], RankKVFactory]] = None):
        """`connector_factory(engine)` builds the KV connector once the model and its KV
        geometry are known (it may read engine.model_config, engine.fingerprint, ...).
        `loaded`: an already loaded model (tensor-parallel workers get its weights too).
        `rank_kv(engine)`: every rank moves its own heads' KV (`self.rank_kv`,
        rank_kv_link.py; a connector's per_rank mode uses it); the factory the workers get,
        built once the model's KV geometry is known (model_config, fingerprint, kv_dtype) and
        before they spawn, so apart from the connector, which is built after them."""
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        tp_size = config.parallel.tensor_parallel_size
        world = config.parallel.world_size
        given = loaded is not None
        loaded = loaded or load_model(config.model, tiny_seed=config.tiny_model_seed,
                                      weights=config.weights)
        # after loading (its temporaries went back to the kernel), before the profiling
        # forward (whose peak then stays resident, as the KV plan assumes)
        if config.device == "cpu":
            apply_host_heap(config.host_heap)
        self.tokenizer = loaded.tokenizer
        self.model_config = cfg = loaded.config
        self.fingerprint = loaded.fingerprint
        check_tp_split(cfg, tp_size)
        check_pp_split(cfg.num_layers, config.parallel.pipeline_parallel_size)
        if rank_kv is not None and config.parallel.pipeline_parallel_size > 1:
            # a rank's head objects would hold only its stage's layers (rank_kv_factory.py)
            raise NotImplementedError("per-rank KV transfers with pipeline stages")
        cc = config.cache
        # ranks on one host share its memory (the budget covers all of them); GPUs have their own
        self.kv_dtype = engine_kv_dtype(config)
        # rank 0 reads every rank's KV only for a connector without per-rank transfers
        share_kv = connector_factory is not None and rank_kv is None
        # (per-rank transfers too: neither GPU ranks nor other cache dtypes are tested there)
        if connector_factory is not None and world > 1:  # before any process starts
            check_shareable_kv(config.device, self.kv_dtype)
        per_token = kv_bytes_per_token(cfg.kv_bytes_per_token, self.kv_dtype)
        if config.device != "cpu":  # the busiest rank holds the most KV heads and layers
            stage0 = pipeline_stage(cfg.num_layers, 0, config.parallel.pipeline_parallel_size)
            per_token = per_token * kv_head_range(cfg.num_kv_heads, 0, tp_size)[1] \
                * stage0.num_layers // (cfg.num_kv_heads * cfg.num_layers)
        # the plan's weights: counted on the model where this process builds it (what it
        # holds: packed parts, oneDNN copies, half dtypes), else estimated from the checkpoint
        model, self.peak = None, None
        if world == 1:
            model = build_rank_model(config, cfg, loaded.weights, SINGLE,
                                     rank_device(config.device, 0, 1))
            self.weights_footprint = weights_footprint(model)
            if cc.num_blocks is None and cc.kv_cache_bytes is None:  # planned from memory
                self.peak = self._profile_peak(model)
        else:
            self.weights_footprint = loaded_weights_footprint(
                loaded.weights, lambda name, w: tp_keeps_packed(cfg, name, w, tp_size))
        plan = plan_kv_blocks(per_token, cc.block_size,
                              budget_bytes=self._kv_budget(cc), fraction=cc.kv_cache_fraction,
                              num_blocks=cc.num_blocks, device=config.device,
                              memory_budget_bytes=self._less_peak(cc.memory_budget_bytes),
                              weights=self.weights_footprint)
        self.kv_plan = plan
        self.max_model_len = min(config.scheduler.max_model_len, cfg.max_position_embeddings,
                                 plan.num_tokens)
        self.cpu_gemm = resolve_cpu_gemm(config.cpu_gemm, config.device)
        factory = rank_kv(self) if rank_kv is not None else None
        self.executor = self._start_executor(loaded, plan.num_blocks, given, model,
                                             share_kv, factory)
        self.model = self.executor.runner.model  # rank 0's shard (the whole model at T=1)
        self.rank_kv = self._link_rank_kv(factory) if factory is not None else None
        self.pool = BlockPool(plan.num_blocks, cc.enable_prefix_caching)
        self.kv = KVCacheManager(self.pool, cc.block_size, self.fingerprint)
        self.connector = connector_factory(self) if connector_factory else None
        if self.connector is not None:
            self.connector.register_kv_shards(self.executor.kv_shards)
        self.outputs = OutputProcessor(self.tokenizer, self.max_model_len)
        sc = config.scheduler
        self.scheduler = Scheduler(self.kv, sc.max_num_seqs, sc.max_num_batched_tokens,
                                   sc.enable_chunked_prefill, self.connector,
                                   self.outputs.check_stop, self.executor.depth)
        # submitted, not yet booked: each with the KV connector's staged save of it
        self._pipeline: deque[tuple[SchedulerOutput, object]] = deque()
        self._seeds = random.Random(config.seed)  # seeds for requests that bring none
        self.sampler = Sampler(cfg.vocab_size, self.tokenizer)
        self._aborted: list[RequestOutput] = []
        self.profile = StepProfile()  # where step time goes (served-path profile)
        self.warmed_up = False  # warm_up() ran: kernels loaded, buffers sized
        self.num_warmup_steps = 0

    def _profile_peak(self, model) -> PeakProfile:
        """The profiling forward at the largest batch the scheduler may form, into a scratch
        KV cache freed afterwards (startup.py)."""
        cfg, cc, sc = self.model_config, self.config.cache, self.config.scheduler
        batch = profile_batch(sc.max_num_batched_tokens, sc.max_num_seqs,
                              min(sc.max_model_len, cfg.max_position_embeddings), cc.block_size)
        blocks = sum(len(c.block_ids) for c in batch.chunks)
        device = rank_device(self.config.device, 0, 1)
        scratch = allocate_kv_caches(cfg, (0, 1), blocks, cc.block_size, device)
        runner = ModelRunner(model, scratch, cc.block_size, device)
        peak = profile_peak_bytes(runner.execute, batch, self.config.device)
        del runner, scratch
        logger.info("%s", peak.describe())
        return peak

    def _less_peak(self, budget: Optional[int]) -> Optional[int]:
        """A memory budget less the profiled non-KV activation peak (weights are subtracted by
        the planner)."""
        if budget is None or self.peak is None:
            return budget
        return budget - self.peak.activation_bytes

    def _kv_budget(self, cc) -> Optional[int]:
        """The explicit KV byte budget; or, planning from a fraction of free memory after a
        profiling forward, that fraction less the forward's peak."""
        if cc.kv_cache_bytes is not None or cc.memory_budget_bytes is not None \
                or cc.num_blocks is not None or self.peak is None:
            return cc.kv_cache_bytes
        free = available_memory_bytes(self.config.device)
        return int(free * cc.kv_cache_fraction) - self.peak.activation_bytes

    def warm_up(self) -> int:
        """Run a few real steps (startup.warmup_requests: prefill, decode, greedy and random
        rows) so the first client request pays no kernel load or buffer allocation, then forget
        them (prefix cache, counters, step profile). Idempotent; returns the steps run. Call
        before taking requests (no other request may be queued)."""
        if self.warmed_up:
            return 0
        if self.has_unfinished_requests():
            raise RuntimeError("warm_up runs before any request is taken")
        cfg, bs = self.model_config, self.config.cache.block_size
        connector, self.connector = self.connector, None  # nothing reaches a KV store
        self.scheduler.connector = None
        self.executor.runner.reserve(self.config.scheduler.max_num_batched_tokens)
        steps = 0
        try:
            for rid, prompt, params in warmup_requests(cfg.vocab_size, bs, self.max_model_len):
                self.add_request(rid, prompt, params)
            while self.has_unfinished_requests():
                self.step()
                steps += 1
        finally:
            self.connector = self.scheduler.connector = connector
        self.pool.reset_prefix_cache()
        self.pool.num_evictions = 0
        self.kv.prefix_queries = self.kv.prefix_hits = 0
        self.profile.reset()
        self.warmed_up, self.num_warmup_steps = True, steps
        logger.info("warmed up in %d steps", steps)
        return steps

    def _link_rank_kv(self, factory: RankKVFactory) -> RankKVLink:
        """Rank 0's own RankKV over its caches (its heads), reporting to the link."""
        par = self.config.parallel
        link = RankKVLink(self.executor, par.world_size)
        try:
            link.attach(factory.build(self.executor.runner.kv_caches,
                                      RankPlace(0, par.tensor_parallel_size,
                                                par.pipeline_parallel_size), link.on_report))
        except BaseException:
            self.executor.close()
            raise
        return link

    def _start_executor(self, loaded: LoadedModel, num_blocks: int, given: bool,
                        model=None, share_kv: bool = False,
                        rank_kv: Optional[RankKVFactory] = None) -> Executor:
        """`model`: rank 0's model, already built (T=1, before the KV plan); `share_kv`: a KV
        connector will read every rank's heads (kv_share.py)."""
        config, cfg = self.config, self.model_config
        tp_size = config.parallel.tensor_parallel_size
        pp_size = config.parallel.pipeline_parallel_size
        device = rank_device(config.device, 0, config.parallel.world_size)
        if tp_size * pp_size == 1:
            caches = allocate_kv_caches(cfg, (0, 1), num_blocks, config.cache.block_size, device,
                                        self.kv_dtype)
            return UniProcExecutor(ModelRunner(model, caches, config.cache.block_size, device))
        from pdserve.common.distributed.executor import WorkerGroup

        sc = config.scheduler
        slot = max(sc.max_num_batched_tokens * cfg.hidden_size,
                   sc.max_num_seqs * vocab_shard(cfg.vocab_size, tp_size))
        workers = WorkerGroup(config, num_blocks, slot,
                              (cfg, loaded.weights) if given else None,
                              cfg if share_kv else None, rank_kv)
        stage = pipeline_stage(cfg.num_layers, 0, pp_size)
        try:
            model = build_rank_model(config, cfg, loaded.weights,
                                     TensorParallel(0, tp_size,
                                                    workers.comm if tp_size > 1 else None),
                                     device, stage)
            shards = None
            if share_kv:  # every rank's caches, mapped here for the connector
                per_rank = map_all_kv(workers.kv_paths, cfg, tp_size, pp_size, num_blocks,
                                      config.cache.block_size)
                caches, shards = per_rank[0], by_tensor_rank(per_rank, tp_size)
            else:
                caches = allocate_kv_caches(cfg, (0, tp_size), num_blocks,
                                            config.cache.block_size, device, self.kv_dtype,
                                            stage)
            workers.wait_ready()
        except BaseException:
            workers.close()
            raise
        runner = ModelRunner(model, caches, config.cache.block_size, device)
        if pp_size > 1:
            from pdserve.common.distributed.pipeline import StageLink
            from pdserve.common.distributed.pipeline_executor import PipelineExecutor
            link = StageLink(RankPlace(0, tp_size, pp_size), cfg.hidden_size,
                             resolve_dtype(config.dtype, device), cfg.vocab_size, device,
                             mark_every_step=share_kv)
            from pdserve.common.distributed.pipeline_head import maybe_rank0_head
            head = maybe_rank0_head(config, cfg, loaded.weights, device)
            return PipelineExecutor(runner, workers, link, pp_size, shards, head)
        return MultiProcExecutor(runner, workers, shards)

    # -- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, first_token_id: Optional[int] = None,
                    kv_transfer: Optional[KVTransferParams] = None,
                    resumed_token_ids=()) -> None:
        """`first_token_id`: the first output token, sampled elsewhere (a prefill instance)
        and already delivered; generation continues after it. `resumed_token_ids`: the same
        for several tokens (a request migrated from a failed instance); they count as output
        (max_tokens, the sampler's position). `kv_transfer`: where the prompt's KV was stored
        (a consumer's connector loads it)."""
        self._validate(request_id, prompt_token_ids, params)
        self.sampler.check(params)  # a structured_output that does not compile
        delivered = list(resumed_token_ids)
        if first_token_id is not None:
            if delivered:
                raise ValueError("first_token_id and resumed_token_ids exclude each other")
            delivered = [first_token_id]
        if delivered:
            self._validate(request_id, delivered, params)
        if len(prompt_token_ids) + len(delivered) >= self.max_model_len:
            raise ValueError("prompt and resumed tokens reach the model length")
        if kv_transfer is not None and not isinstance(kv_transfer, KVTransferParams):
            raise ValueError("kv_transfer must be a KVTransferParams")
        max_tokens = min(params.max_tokens, self.max_model_len - len(prompt_token_ids))
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        req = Request(request_id, prompt_token_ids, params, max_tokens, seed=seed,
                      eos_token_ids=self.model_config.eos_token_ids or self.tokenizer.eos_token_ids)
        if delivered:
            if max_tokens <= len(delivered):
                raise ValueError("max_tokens must exceed the tokens already delivered")
            for token in delivered:
                req.append_token(token)
        req.kv_transfer = kv_transfer or NO_KV_TRANSFER
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
        return self.scheduler.has_unfinished() or bool(self._aborted) or bool(self._pipeline)

    # -- the loop -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.executor.depth > 1:
            return self._step_pipelined()
        t0 = time.perf_counter_ns()
        outputs, self._aborted = self._aborted, []
        sched = self.scheduler.schedule()
        sampled = None
        t1 = t2 = time.perf_counter_ns()
        reqs = ()
        if sched.chunks:
            logits = self._execute(sched)
            t2 = time.perf_counter_ns()
            reqs = self.scheduler.sampled_requests(sched)
            if reqs:
                sampled = self.sampler(logits, reqs)
        else:
            self.executor.check_health()
        t3 = time.perf_counter_ns()
        emit = self.scheduler.update_from_output(sched, sampled)
        if not sched.chunks and not emit and self.scheduler.has_unfinished():
            time.sleep(0.0005)  # only connector I/O is pending: don't spin
        outputs.extend(self._output(req) for req in emit)
        if sched.chunks:
            self.profile.add_step(sched.num_tokens, len(reqs), t0, t1, t2, t3,
                                  time.perf_counter_ns())
        return outputs

    def _step_pipelined(self) -> list[RequestOutput]:
        """Start a new batch while fewer than P are in flight; book the oldest one when the
        pipeline is full or nothing new could start (vLLM's batch queue). In the step profile
        `schedule` includes starting the batch (the first stage's layers run here) and
        `forward` is the wait for the oldest batch's logits."""
        t0 = time.perf_counter_ns()
        outputs, self._aborted = self._aborted, []
        started = False
        if len(self._pipeline) < self.executor.depth:
            sched = self.scheduler.schedule()  # skips the requests in flight
            if sched.chunks:
                save = None if self.connector is None else \
                    self.connector.stage_step(self.scheduler.connector_batch(sched))
                self.executor.submit(sched)
                self._pipeline.append((sched, save))
                started = True
            else:
                self.executor.check_health()
                emit = self.scheduler.update_from_output(sched, None)
                outputs.extend(self._output(req) for req in emit)
        if not self._pipeline or (started and len(self._pipeline) < self.executor.depth):
            return outputs
        t1 = time.perf_counter_ns()
        done, save = self._pipeline.popleft()
        logits = self.executor.collect()  # every stage wrote done's K/V (kv_share.py)
        if self.connector is not None:
            self.connector.save_step(save)
        t2 = time.perf_counter_ns()
        reqs = self.scheduler.sampled_requests(done)
        sampled = self.sampler(logits, reqs) if reqs else None
        t3 = time.perf_counter_ns()
        emit = self.scheduler.update_from_output(done, sampled)
        outputs.extend(self._output(req) for req in emit)
        self.profile.add_step(done.num_tokens, len(reqs), t0, t1, t2, t3,
                              time.perf_counter_ns())
        return outputs

    def _execute(self, sched) -> torch.Tensor:
        if self.connector is None:
            return self.executor.execute_model(sched)
        self.connector.begin_step(self.scheduler.connector_batch(sched))
        logits = self.executor.execute_model(sched, self.connector.save_layer)
        self.connector.end_step()
        return logits

    def _output(self, req: Request) -> RequestOutput:
        finished = req.finish_reason is not None
        out = self.outputs.make_output(req, finished)
        if finished and self.connector is not None:
            out.block_hashes = req.block_hashes[:req.num_prompt_tokens // self.kv.block_size]
        return out

    def close(self) -> None:
        """Stop the KV connector and the tensor-parallel workers; idempotent."""
        if self.connector is not None:
            self.connector.close()
        if self.rank_kv is not None:
            self.rank_kv.close()
        self.executor.close()

    # -- introspection (EngineClient) -----------------------------------------------------
    def kv_transfer_stats(self):
        return self.connector.transfer_stats() if self.connector is not None else None

    def cached_block_hashes(self, limit: int) -> tuple:
        cached = self.pool.cached
        if not limit or not cached:
            return ()
        return tuple(list(cached)[-limit:])

    def get_request(self, request_id: str) -> Optional[Request]:
        return self.scheduler.requests.get(request_id)

    def running_requests(self) -> Sequence[Request]:
        return self.scheduler.running

    def set_token_budget(self, num_tokens: int) -> None:
        if num_tokens < 1:
            raise ValueError(f"a step's token budget must be at least 1, got {num_tokens}")
        self.scheduler.token_budget = num_tokens

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
