"""The router's per-request decision path, timed in process with no network: admission
(gate), the prompt's block keys, the policy's pick over `n` instances (with their prefix
memory and cache summaries), then the lease and ticket closed as a finished request would.
"""

from __future__ import annotations

import asyncio
import time

from pdserve.common.rpc import engine_pb2 as pb
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.telemetry.metrics import RouterMetrics
from pdserve.services.router.routing.backends import BackendPool
from pdserve.services.router.routing.candidate import RouteRequest
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.admission.gate import Gate
from pdserve.services.router.dispatch.job import Choice, Job
from pdserve.services.router.routing.policies import make_policy
from pdserve.services.router.api.request_meta import RequestMeta
from pdserve.services.router.dispatch.requests import block_keys


def _pool(cfg: RouterConfig, metrics: RouterMetrics, n: int) -> BackendPool:
    addrs = tuple(f"10.0.0.{i}:5000" for i in range(n))
    pool = BackendPool(addrs, metrics, 1.0, 1.0, 2, policy=make_policy(
        cfg.routing.decode_policy, cfg.routing), fallback=cfg.fallback)
    health = pb.HealthResponse(status=pb.HealthResponse.SERVING, model_fingerprint="fp",
                               block_size=16, max_model_len=4096)
    for i, b in enumerate(pool.backends):
        b.record_success(health, pb.LoadResponse(num_running=i % 3, num_waiting_tokens=10 * i))
    return pool


async def _decisions(cfg: RouterConfig, n_instances: int, prompts: list) -> list[float]:
    metrics = RouterMetrics()
    pool, gate = _pool(cfg, metrics, n_instances), Gate(cfg, metrics)
    params = SamplingParams(max_tokens=16)
    meta = RequestMeta()
    took = []
    try:
        for i, prompt in enumerate(prompts):
            t0 = time.perf_counter()
            job = Job(str(i), (Choice(0, tuple(prompt), params),))
            ticket = await gate.enter(meta, job)
            keys, bs = block_keys(pool, prompt, None)
            lease = pool.choose(RouteRequest(len(prompt), bs, 0, None), keys).dispatch(
                len(prompt))
            ticket.first_token()
            pool.finish(lease, ok=True)
            ticket.release()
            took.append(time.perf_counter() - t0)
    finally:
        await pool.close()
    return took


def time_decisions(policy: str, n_instances: int, n: int, prompt_tokens: int) -> list[float]:
    """Seconds per decision; prompts share prefixes in groups (as chat traffic does)."""
    from pdserve.services.router.routing.routing_config import RoutingConfig

    cfg = RouterConfig(model="fake", routing=RoutingConfig(decode_policy=policy))
    prompts = [[(i % 32) + 1] * (prompt_tokens - 8) + [i % 251, i % 7, 3, 4, 5, 6, 7, 8]
               for i in range(n)]
    return asyncio.run(_decisions(cfg, n_instances, prompts))
