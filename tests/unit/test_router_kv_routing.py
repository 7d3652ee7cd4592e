"""KV-aware routing decisions through the router's real pool (BackendPool: its prefix memory,
the engines' block keys, leases) with two fake instances: multi-turn chat stays on the
instance holding each conversation, the queue estimate counts only uncached tokens, and a
holder with real work queued still loses to an idle instance."""

import asyncio
import random

import pytest

from pdserve.common.rpc import engine_pb2 as pb
from pdserve.common.telemetry.metrics import RouterMetrics
from pdserve.services.router.dispatch.requests import block_keys
from pdserve.services.router.routing.backend import Routed
from pdserve.services.router.routing.backends import BackendPool
from pdserve.services.router.routing.candidate import RouteRequest
from pdserve.services.router.routing.policies import make_policy
from pdserve.services.router.routing.routing_config import RoutingConfig

BS = 16
A, B = "10.0.0.1:5000", "10.0.0.2:5000"


def _pool() -> BackendPool:
    pool = BackendPool((A, B), RouterMetrics(), 1.0, 1.0, 2,
                       policy=make_policy("kv_aware", RoutingConfig()))
    health = pb.HealthResponse(status=pb.HealthResponse.SERVING, model_fingerprint="fp",
                               block_size=BS, max_model_len=8192)
    for b in pool.backends:
        b.record_success(health, pb.LoadResponse())
    return pool


def _send(pool: BackendPool, prompt: list[int]):
    """Routes and dispatches one prompt as the router's dispatch does; returns the lease."""
    keys, bs = block_keys(pool, prompt, None)
    return pool.choose(RouteRequest(len(prompt), bs, 0, None), keys).dispatch(len(prompt))


def _run(body):
    async def main():
        pool = _pool()
        try:
            return body(pool)
        finally:
            await pool.close()
    return asyncio.run(main())


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 30000) for _ in range(n)]


def _held(pool: BackendPool, rng: random.Random, blocks: int):
    """(a history of `blocks` full blocks computed on one instance, that instance)."""
    history = _tokens(rng, blocks * BS)
    first = _send(pool, history)
    pool.finish(first, ok=True)
    return history, first.backend


def test_the_queue_estimate_counts_only_what_the_instance_has_not_cached():
    def body(pool):
        rng = random.Random(1)
        history = _tokens(rng, 50 * BS)
        pool.finish(_send(pool, history), ok=True)  # now cached where it went
        turn2 = history + _tokens(rng, 40)
        lease = _send(pool, turn2)
        holder = lease.backend
        assert holder.inflight_tokens == len(turn2) - 50 * BS  # 40, not 840
        lease.first_token()
        assert holder.inflight_tokens == 0
        pool.finish(lease, ok=True)
        cold = _send(pool, _tokens(rng, 300))  # nothing cached anywhere: all of it
        assert cold.backend.inflight_tokens == 300
    _run(body)


def test_the_engines_report_adds_only_what_is_not_ours():
    """The engine reports waiting requests with whole prompts; ours count uncached only."""
    def body(pool):
        a = pool.backend(A)
        leases = []
        for _ in range(2):  # two 2,500-token prompts, 100 tokens of each not cached there
            leases.append(a.dispatch(2500, uncached=100))
        a.record_success(a.health, pb.LoadResponse(num_waiting=2, num_waiting_tokens=5000))
        assert a.queue_tokens == 200
        # another router's 1,000-token prompt waits there too
        a.record_success(a.health, pb.LoadResponse(num_waiting=3, num_waiting_tokens=6000))
        assert a.queue_tokens == 1200
        for lease in leases:
            lease.first_token()
        assert (a.inflight_tokens, a.inflight_prompt_tokens) == (0, 0)
        assert a.queue_tokens == 1000  # ours are computed; the other router's still waits
        for lease in leases:
            pool.finish(lease, ok=True)
    _run(body)


def test_a_holders_pending_cache_hits_do_not_push_its_next_turns_away():
    def body(pool):
        rng = random.Random(2)
        convs = [_tokens(rng, 60 * BS) for _ in range(3)]
        pool.finish(_send(pool, convs[0]), ok=True)
        home = pool.memory.leading(block_keys(pool, convs[0], None)[0])
        (holder,) = home
        for c in convs[1:]:  # the same instance computed the others' first turns too
            pool.memory.record(block_keys(pool, c, None)[0], holder)
        # the next turns of conversations 1 and 2 are waiting for their first token there
        pending = [_send(pool, c + _tokens(rng, 30)) for c in convs[1:]]
        assert {lease.backend.address for lease in pending} == {holder}
        nxt = _send(pool, convs[0] + _tokens(rng, 30))
        assert nxt.backend.address == holder  # 30 new tokens there beat 990 elsewhere
    _run(body)


def test_a_holder_with_real_work_queued_loses_to_an_idle_instance():
    def body(pool):
        rng = random.Random(3)
        history, holder = _held(pool, rng, 20)
        queued = holder.dispatch(2000)  # an uncached prompt of 2000 tokens ahead there
        nxt = _send(pool, history + _tokens(rng, 30))
        assert nxt.backend is not holder  # 320 cached tokens do not pay for 2000 queued
        pool.finish(queued, ok=True)
    _run(body)


def test_chat_conversations_stay_on_their_holders_and_split_evenly():
    """Eight conversations with one shared system prompt, five turns each; a conversation's
    next turn is sent as soon as its own answer is back, while the others' are still waiting
    for their first token (as in a closed-loop chat benchmark)."""
    def body(pool):
        rng = random.Random(4)
        system = _tokens(rng, 256)
        convs = {c: system + _tokens(rng, 32) for c in range(8)}
        homes: dict[int, set] = {c: set() for c in convs}
        open_leases = {}
        for _turn in range(5):
            for c in convs:
                if c in open_leases:  # its answer came back: the next turn goes
                    pool.finish(open_leases.pop(c), ok=True)
                    convs[c] = convs[c] + _tokens(rng, 32 + 32)
                open_leases[c] = _send(pool, convs[c])
                homes[c].add(open_leases[c].backend.address)
        assert all(len(h) == 1 for h in homes.values()), homes
        per = [sum(1 for h in homes.values() if h == {a}) for a in (A, B)]
        assert per == [4, 4]
    _run(body)


def test_one_shared_system_prompt_does_not_draw_every_conversation_to_one_instance():
    """Light load: each first turn is computed before the next arrives, so only the first
    instance holds the system prompt; conversations keep running (long answers) there."""
    def body(pool):
        rng = random.Random(5)
        system = _tokens(rng, 512)
        running = []
        for _ in range(10):
            lease = _send(pool, system + _tokens(rng, 32))
            lease.first_token()  # computed; it goes on decoding
            running.append(lease)
        per = {a: sum(1 for lease in running if lease.backend.address == a) for a in (A, B)}
        assert max(per.values()) - min(per.values()) <= 5  # not 10 and 0
        assert min(per.values()) >= 3
    _run(body)


def test_each_routing_decision_carries_its_own_uncached_count():
    """Two requests routed to one instance before either call opens (as two requests in one
    turn of the loop can be) each count their own uncached tokens, not the other's."""
    def body(pool):
        rng = random.Random(6)
        history, holder = _held(pool, rng, 50)
        other = next(b for b in pool.backends if b is not holder)
        hit_prompt, cold_prompt = history + _tokens(rng, 40), _tokens(rng, 300)
        hit = pool.choose(RouteRequest(len(hit_prompt), BS, 0, None),
                          block_keys(pool, hit_prompt, None)[0])
        cold = pool.choose(RouteRequest(len(cold_prompt), BS, 0, None),
                           block_keys(pool, cold_prompt, None)[0], exclude=(other,))
        assert hit.backend is holder and cold.backend is holder
        assert (hit.uncached, cold.uncached) == (40, 300)
        leases = [hit.dispatch(len(hit_prompt)), cold.dispatch(len(cold_prompt))]
        assert holder.inflight_tokens == 340
        assert holder.inflight_prompt_tokens == len(hit_prompt) + len(cold_prompt)
        for lease in leases:
            pool.finish(lease, ok=True)
        assert (holder.inflight, holder.inflight_tokens) == (0, 0)
    _run(body)


def test_a_routing_decision_refuses_a_negative_count():
    def body(pool):
        with pytest.raises(ValueError, match="uncached"):
            Routed(pool.backends[0], -1)
    _run(body)


def test_a_report_older_than_our_first_token_does_not_push_a_conversation_away():
    """The holder's last load report was read while the conversation's previous turn still
    waited there; that turn has its answer since. Counting the report as it stands until the
    next one made the holder look 640 tokens busy, and the next turn went to the other
    instance to recompute the whole history."""
    def body(pool):
        rng = random.Random(7)
        history = _tokens(rng, 40 * BS)
        lease = _send(pool, history)
        holder = lease.backend
        holder.record_success(holder.health, pb.LoadResponse(
            num_waiting=1, num_waiting_tokens=len(history)))
        lease.first_token()
        pool.finish(lease, ok=True)
        assert (holder.active, holder.queue_tokens) == (0, 0)
        nxt = _send(pool, history + _tokens(rng, 40))
        assert nxt.backend is holder
        pool.finish(nxt, ok=True)
    _run(body)
