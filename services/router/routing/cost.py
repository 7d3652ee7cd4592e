"""The KV-aware cost of sending one request to one instance, in prompt-token units.

    cost = new_tokens + w.queue * queue_tokens + w.running * active + w.kv_usage * kv_usage
    new_tokens = prompt_len - block_size * (local + w.store_hit * max(0, store - local))

`local`: leading prompt blocks in the instance's own prefix cache (reported in its registry
heartbeat, or remembered by the router from where it sent the same blocks before): free to
reuse. `store`: leading blocks the KV store holds: any instance can load them, which saves
`w.store_hit` of their compute. `queue_tokens`: prompt tokens the instance still has to compute
before ours; `active`: requests running or waiting there (each slows every decode step);
`kv_usage`: how close it is to preempting. The cheapest instance wins; ties go to the one
with fewer active requests. Defaults are in routing_config.CostWeights.
"""

from __future__ import annotations

from pdserve.services.router.routing.candidate import Candidate, RouteRequest
from pdserve.services.router.routing.routing_config import CostWeights


def new_tokens(c: Candidate, req: RouteRequest, w: CostWeights) -> float:
    """Prompt tokens the instance would have to compute (store loads count as partly free)."""
    if not req.block_size:
        return float(req.prompt_len)
    local = c.local_blocks
    reused = local + w.store_hit * max(0, req.store_blocks - local)
    return max(0.0, req.prompt_len - req.block_size * reused)


def kv_cost(c: Candidate, req: RouteRequest, w: CostWeights) -> float:
    return (new_tokens(c, req, w) + w.queue * c.queue_tokens + w.running * c.active
            + w.kv_usage * c.kv_usage)
