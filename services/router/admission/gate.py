"""The way into the router for every request, in order: API key (401), the key's rate
limits (429), then admission (queue, budget, priority, TTFT SLO: 429). `identify()` checks the
key and settles who the request is (tenant, capped priority, rate limit bucket); `isolate()`
gives its job the tenant's cache salt; `enter()` returns the admission Ticket the request
holds until its first token.

Rate limits count per API key, or per client address when there are no keys: a client that
rotates its Authorization header does not escape its limit. `x-priority` is capped by the
key's max_priority (AdmissionConfig.max_priority for keyless clients); asking for more is not
an error, the request just gets the cap.
"""

from __future__ import annotations

import dataclasses

from pdserve.common.telemetry.metrics import RouterMetrics
from pdserve.services.router.admission.admission import AdmissionController, Ticket
from pdserve.services.router.admission.api_keys import KeyRing
from pdserve.services.router.admission.rate_limit import KeyedRateLimiter
from pdserve.services.router.admission.tenants import TenantSalts, load_secret
from pdserve.services.router.api.errors import APIError, too_many
from pdserve.services.router.api.request_meta import RequestMeta
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.dispatch.job import Job, prompt_tokens


class Gate:
    def __init__(self, cfg: RouterConfig, metrics: RouterMetrics):
        a = cfg.admission
        self._keys = KeyRing.load(cfg.api_key_file)
        self._salts = TenantSalts(load_secret(cfg.tenant_secret_file)) if self._keys else None
        self._max_priority = a.max_priority
        self._limiter = KeyedRateLimiter(a.rate_limit_rps, a.rate_limit_burst,
                                         a.rate_limit_tokens_per_s)
        self.admission = AdmissionController(a, metrics)
        self._metrics = metrics

    def identify(self, meta: RequestMeta) -> RequestMeta:
        """`meta` with its tenant, capped priority and rate limit bucket; 401 when keys are
        set and the request has none of them."""
        try:
            key = self._keys.check(meta.api_key)
        except APIError:
            self._metrics.admission_rejected.labels("unauthorized").inc()
            raise
        if key is None:
            return dataclasses.replace(meta, priority=min(meta.priority, self._max_priority),
                                       tenant=None, limit_key="addr:" + meta.client)
        return dataclasses.replace(meta, priority=min(meta.priority, key.max_priority),
                                   tenant=key.tenant, limit_key="key:" + key.key_id)

    def authorize(self, meta: RequestMeta) -> None:
        self.identify(meta)

    def isolate(self, job: Job, meta: RequestMeta) -> Job:
        """The job with its tenant's cache salt (as it is without API keys)."""
        return self._salts.isolate(job, meta.tenant) if self._salts is not None else job

    async def enter(self, meta: RequestMeta, job: Job) -> Ticket:
        meta = self.identify(meta)
        tokens = prompt_tokens(job)
        wait = self._limiter.check(meta.limit_key, tokens + _max_tokens(job))
        if wait is not None:
            self._metrics.admission_rejected.labels("rate_limit").inc()
            raise too_many("rate limit exceeded for this API key or client", "rate_limit",
                           min(wait, 3600.0))
        return await self.admission.admit(tokens, meta.priority, meta.ttft_slo_s)


def _max_tokens(job: Job) -> int:
    return sum(c.params.max_tokens or 0 for c in job.choices)
