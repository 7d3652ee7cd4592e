"""The way into the router for every request, in order: API key (401), the key's rate
limits (429), then admission (queue, budget, priority, TTFT SLO: 429). `enter()` returns the
admission Ticket the request holds until its first token."""

from __future__ import annotations

from pdserve.common.telemetry.metrics import RouterMetrics
from pdserve.services.router.admission.admission import AdmissionController, Ticket
from pdserve.services.router.admission.api_keys import check_key, load_api_keys
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.api.errors import APIError, too_many
from pdserve.services.router.dispatch.job import Job, prompt_tokens
from pdserve.services.router.admission.rate_limit import KeyedRateLimiter
from pdserve.services.router.api.request_meta import RequestMeta


class Gate:
    def __init__(self, cfg: RouterConfig, metrics: RouterMetrics):
        a = cfg.admission
        self._keys = load_api_keys(cfg.api_key_file)
        self._limiter = KeyedRateLimiter(a.rate_limit_rps, a.rate_limit_burst,
                                         a.rate_limit_tokens_per_s)
        self.admission = AdmissionController(a, metrics)
        self._metrics = metrics

    def authorize(self, meta: RequestMeta) -> None:
        try:
            check_key(self._keys, meta.api_key)
        except APIError:
            self._metrics.admission_rejected.labels("unauthorized").inc()
            raise

    async def enter(self, meta: RequestMeta, job: Job) -> Ticket:
        self.authorize(meta)
        tokens = prompt_tokens(job)
        wait = self._limiter.check(meta.api_key, tokens + _max_tokens(job))
        if wait is not None:
            self._metrics.admission_rejected.labels("rate_limit").inc()
            raise too_many("rate limit exceeded for this API key", "rate_limit",
                           min(wait, 3600.0))
        return await self.admission.admit(tokens, meta.priority, meta.ttft_slo_s)


def _max_tokens(job: Job) -> int:
    return sum(c.params.max_tokens or 0 for c in job.choices)
