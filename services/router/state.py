"""What the router's HTTP and gRPC front ends share."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Optional

from pdserve.common.sampling_params import SamplingParams
from pdserve.common.telemetry.metrics import RouterMetrics
from pdserve.services.router.routing.backends import BackendPool
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.dispatch.colocated import ColocatedDispatch, Dispatch
from pdserve.services.router.dispatch.decode_open import DecodeTarget
from pdserve.services.router.api.errors import model_not_found
from pdserve.services.router.dispatch.job import Job
from pdserve.services.router.dispatch.job_run import JobRun
from pdserve.services.router.api.openai_format import TokenText
from pdserve.services.router.api.request_meta import RequestMeta
from pdserve.services.router.dispatch.requests import EngineRequest


@dataclass(frozen=True)
class RouterState:
    config: RouterConfig
    tokenizer: object  # pdserve.common.tokenizer.Tokenizer (or a test stand-in)
    pool: BackendPool  # the instances that decode (unified ones when colocated)
    metrics: RouterMetrics
    dispatch: Optional[Dispatch] = None  # None: colocated (unified instances of `pool`)
    gate: object = None  # a gate.Gate: API keys, rate limits, admission (None: open)

    def __post_init__(self):
        if self.dispatch is None:
            object.__setattr__(self, "dispatch", ColocatedDispatch(self.decode_target))

    @functools.cached_property
    def decode_target(self) -> DecodeTarget:
        return DecodeTarget(self.pool, self.config.fallback, self.metrics)

    async def start_run(self, job: Job, meta: RequestMeta,
                        arrival: Optional[float] = None) -> JobRun:
        """Admits the job (APIError 401 / 429 when refused) and opens its streams."""
        arrival = time.monotonic() if arrival is None else arrival
        ticket = await self.gate.enter(meta, job) if self.gate is not None else None
        opener = functools.partial(self.open_stream, affinity=meta.affinity)
        return await JobRun.open(opener, job, self.metrics, arrival, ticket, meta.priority)

    async def open_stream(self, request_id: str, prompt: list[int], params: SamplingParams,
                          cache_salt: Optional[str], affinity: Optional[str] = None):
        """One engine request's stream of Deltas: straight to a unified instance, or
        prefill + decode when disaggregated."""
        return await self.dispatch.open(
            EngineRequest(request_id, prompt, params, cache_salt, affinity))

    @property
    def vocab_size(self) -> Optional[int]:
        """The smallest vocabulary the healthy instances report (token ids must be below
        it); the tokenizer's while none has answered."""
        sizes = [b.health.vocab_size for b in self.pool.healthy
                 if b.health is not None and b.health.vocab_size]
        return min(sizes) if sizes else self.tokenizer.vocab_size

    @property
    def text_of(self) -> TokenText:
        return TokenText(self.tokenizer)

    def check_model(self, model) -> None:
        """Empty means the served model; anything else must name it."""
        if model and model not in (self.config.model_name, self.config.model):
            raise model_not_found(model)
