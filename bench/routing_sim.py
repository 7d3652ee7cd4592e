"""Multi-turn chat through the router's real pool and policies, on simulated engines: where
KV-aware routing pays and whether its decisions are right, in a second instead of an hour.

Each simulated instance runs steps as the engine does: a step takes waiting prompts' uncached
tokens up to a token budget (chunked prefill) plus one token per running request, and lasts
`step_s + prefill_s * prefill tokens + decode_s * running`. Its prefix cache holds every full
block it computed or generated (nothing is evicted), matched at the leading blocks when the
request is scheduled. The router side is the real `BackendPool` (prefix memory, leases,
queue estimate) with the real policy; the instances report their load to it every
`report_s`, as the health checks do. Conversations are closed loops: turn t+1 is sent after
turn t's answer (and not before its Poisson arrival), with the answer's tokens in its
history, as `pdserve bench routing --workload chat` does.

Reported per policy: TTFT p50 (all turns, later turns), the prefix-cache hit share against
the ideal one (every later turn finds its whole history; each system prompt computed once),
and `moves`: later turns sent to another instance than the conversation's previous turn.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from statistics import median
from typing import Optional

from pdserve.common.rpc import engine_pb2 as pb
from pdserve.common.telemetry.metrics import RouterMetrics
from pdserve.services.router.dispatch.requests import block_keys
from pdserve.services.router.routing.backends import BackendPool
from pdserve.services.router.routing.candidate import RouteRequest
from pdserve.services.router.routing.policies import make_policy
from pdserve.services.router.routing.routing_config import RoutingConfig


@dataclass(frozen=True)
class SimConfig:
    conversations: int = 8
    turns: int = 6
    system_len: int = 256
    num_prefixes: int = 4
    question: tuple[int, int] = (64, 192)  # uniform, inclusive
    answer: tuple[int, int] = (16, 48)
    rate: float = 2.0  # Poisson arrivals, requests/s
    instances: int = 2
    block_size: int = 16
    budget: int = 2048  # tokens per step
    step_s: float = 0.03  # a step's fixed cost
    prefill_s: float = 0.0014  # per prompt token computed
    decode_s: float = 0.004  # per running request
    report_s: float = 1.0

    def __post_init__(self):
        if min(self.conversations, self.turns, self.instances, self.block_size,
               self.budget, self.num_prefixes) < 1:
            raise ValueError("conversations, turns, instances, block_size, budget and "
                             "num_prefixes must be >= 1")
        for lo, hi in (self.question, self.answer):
            if not 1 <= lo <= hi:
                raise ValueError(f"a length range needs 1 <= low <= high, got {(lo, hi)}")
        if self.rate <= 0 or self.report_s <= 0 or min(self.step_s, self.prefill_s,
                                                        self.decode_s) < 0:
            raise ValueError("rate and report_s must be > 0 and the step costs >= 0")


@dataclass
class _Req:
    conv: int
    turn: int
    prompt: list[int]
    answer: list[int]
    arrival: float
    lease: object = None
    todo: int = 0  # prompt tokens still to compute
    hit: int = 0
    left: int = 0  # output tokens still to generate
    ttft: Optional[float] = None


@dataclass
class _Instance:
    index: int
    cached: set = field(default_factory=set)
    waiting: list = field(default_factory=list)
    running: list = field(default_factory=list)
    busy_until: Optional[float] = None  # the running step's end
    step: list = field(default_factory=list)  # (req, prompt tokens) in the running step


class _Sim:
    def __init__(self, cfg: SimConfig, policy: str, seed: int):
        self.cfg, self.rng = cfg, random.Random(seed)
        addrs = tuple(f"10.0.0.{i + 1}:5000" for i in range(cfg.instances))
        self.pool = BackendPool(addrs, RouterMetrics(), 1.0, 1.0, 2,
                                policy=make_policy(policy, RoutingConfig()))
        self.health = pb.HealthResponse(status=pb.HealthResponse.SERVING,
                                        model_fingerprint="sim", block_size=cfg.block_size,
                                        max_model_len=1 << 20)
        self.inst = {b.address: _Instance(i) for i, b in enumerate(self.pool.backends)}
        self.report()
        systems = [self.ids(cfg.system_len) for _ in range(cfg.num_prefixes)]
        self.history = {c: systems[c % cfg.num_prefixes] for c in range(cfg.conversations)}
        self.arrivals = self.poisson(cfg.conversations * cfg.turns)
        self.where: dict[int, str] = {}
        self.done: list[_Req] = []
        self.moves = 0

    def ids(self, n: int) -> list[int]:
        return [self.rng.randrange(100, 50000) for _ in range(n)]

    def poisson(self, n: int) -> list[float]:
        t, out = 0.0, []
        for _ in range(n):
            t += self.rng.expovariate(self.cfg.rate)
            out.append(t)
        return out

    def report(self) -> None:
        for b in self.pool.backends:
            i = self.inst[b.address]
            b.record_success(self.health, pb.LoadResponse(
                num_running=len(i.running), num_waiting=len(i.waiting),
                num_waiting_tokens=sum(len(r.prompt) for r in i.waiting)))

    def send(self, req: _Req, now: float) -> None:
        keys, bs = block_keys(self.pool, req.prompt, None)
        routed = self.pool.choose(RouteRequest(len(req.prompt), bs, 0, None), keys)
        req.lease = routed.dispatch(len(req.prompt))
        address = routed.backend.address
        if req.turn and self.where.get(req.conv) != address:
            self.moves += 1
        self.where[req.conv] = address
        inst = self.inst[address]
        inst.waiting.append(req)
        req.todo = -1  # matched when scheduled
        if inst.busy_until is None:
            self.start_step(inst, now)

    def start_step(self, inst: _Instance, now: float) -> None:
        budget, step = self.cfg.budget - len(inst.running), []
        for req in inst.waiting:
            if budget <= 0:
                break
            if req.todo < 0:  # scheduled now: its prefix match
                req.hit = self.match(inst, req.prompt)
                req.todo = len(req.prompt) - req.hit
            n = min(budget, req.todo)
            step.append((req, n))
            budget -= n
        if not step and not inst.running:
            inst.busy_until = None
            return
        c = self.cfg
        tokens = sum(n for _, n in step)
        inst.step = step
        inst.busy_until = now + c.step_s + c.prefill_s * tokens + c.decode_s * len(inst.running)

    def chain(self, tokens: list[int]) -> list[int]:
        """One key per full block, each hashing the block and every block before it."""
        bs, h, out = self.cfg.block_size, 0, []
        for n in range(bs, len(tokens) + 1, bs):
            h = hash((h, tuple(tokens[n - bs:n])))
            out.append(h)
        return out

    def match(self, inst: _Instance, prompt: list[int]) -> int:
        n = 0
        for key in self.chain(prompt):
            if key not in inst.cached:
                break
            n += 1
        return min(n * self.cfg.block_size, len(prompt) - 1)  # the last token is computed

    def end_step(self, inst: _Instance, now: float) -> None:
        for req in list(inst.running):
            req.left -= 1
            if req.left <= 0:
                inst.running.remove(req)
                self.finish(inst, req, now)
        for req, n in inst.step:
            req.todo -= n
            if req.todo == 0:
                inst.waiting.remove(req)
                req.ttft = now - req.arrival
                req.lease.first_token()
                self.cache(inst, req.prompt)
                req.left = len(req.answer) - 1
                if req.left:
                    inst.running.append(req)
                else:
                    self.finish(inst, req, now)
        self.start_step(inst, now)

    def cache(self, inst: _Instance, tokens: list[int]) -> None:
        inst.cached.update(self.chain(tokens))

    def finish(self, inst: _Instance, req: _Req, now: float) -> None:
        self.cache(inst, req.prompt + req.answer)
        self.pool.finish(req.lease, ok=True)
        self.history[req.conv] = req.prompt + req.answer
        self.done.append(req)
        if req.turn + 1 < self.cfg.turns:
            self.pending.append(self.turn(req.conv, req.turn + 1, now))

    def turn(self, conv: int, t: int, now: float) -> _Req:
        c = self.cfg
        prompt = self.history[conv] + self.ids(self.rng.randint(*c.question))
        answer = self.ids(self.rng.randint(*c.answer))
        return _Req(conv, t, prompt, answer, max(now, self.arrivals.pop(0)))

    def run(self) -> dict:
        self.pending = [self.turn(c, 0, 0.0) for c in range(self.cfg.conversations)]
        now, next_report = 0.0, self.cfg.report_s
        while self.pending or any(i.busy_until is not None for i in self.inst.values()):
            steps = [(i.busy_until, i.index, i) for i in self.inst.values()
                     if i.busy_until is not None]
            arrival = min(self.pending, key=lambda r: r.arrival) if self.pending else None
            t_step = min(steps)[0] if steps else float("inf")
            t_arr = arrival.arrival if arrival else float("inf")
            now = min(t_step, t_arr, next_report)
            if now == next_report:
                self.report()
                next_report += self.cfg.report_s
            elif t_arr <= t_step:
                self.pending.remove(arrival)
                self.send(arrival, now)
            else:
                self.end_step(min(steps)[2], now)
        return self.summary()

    def summary(self) -> dict:
        reqs = self.done
        queries = sum(len(r.prompt) for r in reqs)
        hits = sum(r.hit for r in reqs)
        later = [r.ttft for r in reqs if r.turn]
        return {"ttft_p50_s": median(r.ttft for r in reqs),
                "ttft_later_turns_p50_s": median(later) if later else None,
                "prefix_hit_share": hits / queries, "ideal_hit_share": self.ideal(reqs),
                "moves": self.moves, "later_turns": len(later),
                "duration_s": max(r.arrival + r.ttft for r in reqs)}

    def ideal(self, reqs: list[_Req]) -> float:
        """Every later turn finds its history; each system prompt is computed once."""
        bs, seen, hits = self.cfg.block_size, set(), 0
        prev = {}
        for r in sorted(reqs, key=lambda r: (r.turn, r.arrival)):
            if r.turn:
                hits += len(prev[r.conv]) // bs * bs
            else:
                p = r.conv % self.cfg.num_prefixes
                hits += self.cfg.system_len // bs * bs if p in seen else 0
                seen.add(p)
            prev[r.conv] = r.prompt + r.answer
        return hits / sum(len(r.prompt) for r in reqs)


def simulate(cfg: SimConfig, policy: str, seed: int) -> dict:
    """One run of `cfg` under `policy` (a --decode-policy name)."""
    async def main():
        sim = _Sim(cfg, policy, seed)
        try:
            return sim.run()
        finally:
            await sim.pool.close()
    return asyncio.run(main())


def compare(cfg: SimConfig, policies: tuple[str, ...], seeds: tuple[int, ...]) -> dict:
    """Every policy on every seed; medians over seeds and each policy's over the first's."""
    runs = [{"policy": p, "seed": s, **simulate(cfg, p, s)} for s in seeds for p in policies]
    per = {p: {k: median(r[k] for r in runs if r["policy"] == p)
               for k in ("ttft_p50_s", "prefix_hit_share", "ideal_hit_share", "moves")}
           for p in policies}
    base = per[policies[0]]["ttft_p50_s"]
    return {"bench": "routing-sim", "medians": per,
            f"ttft_p50_ratio_vs_{policies[0]}": {p: per[p]["ttft_p50_s"] / base
                                                 for p in policies[1:]}, "runs": runs}


def _range(spec: str) -> tuple[int, int]:
    lo, _, hi = spec.partition(":")
    return int(lo), int(hi or lo)


def add_routing_sim_subcommand(sub) -> None:
    d = SimConfig()
    p = sub.add_parser("routing-sim", help="router policies on simulated engines: multi-turn "
                                           "chat through the real pool, in seconds")
    p.add_argument("--policies", default="round_robin,kv_aware",
                   help="comma-separated --decode-policy values; ratios are over the first")
    p.add_argument("--seeds", default="1,2,3", help="comma-separated seeds")
    p.add_argument("--conversations", type=int, default=d.conversations,
                   help=f"conversations (default {d.conversations})")
    p.add_argument("--turns", type=int, default=d.turns, help=f"turns each (default {d.turns})")
    p.add_argument("--system-len", type=int, default=d.system_len,
                   help=f"system prompt tokens (default {d.system_len})")
    p.add_argument("--num-prefixes", type=int, default=d.num_prefixes,
                   help=f"distinct system prompts (default {d.num_prefixes})")
    p.add_argument("--question", type=_range, default=d.question,
                   help="question tokens, LOW:HIGH uniform (default %d:%d)" % d.question)
    p.add_argument("--answer", type=_range, default=d.answer,
                   help="answer tokens, LOW:HIGH uniform (default %d:%d)" % d.answer)
    p.add_argument("--rate", type=float, default=d.rate,
                   help=f"requests/s, Poisson (default {d.rate})")
    p.add_argument("--instances", type=int, default=d.instances,
                   help=f"simulated engines (default {d.instances})")
    p.set_defaults(func=_main)


def _main(args) -> int:
    import json

    cfg = SimConfig(conversations=args.conversations, turns=args.turns,
                    system_len=args.system_len, num_prefixes=args.num_prefixes,
                    question=args.question, answer=args.answer, rate=args.rate,
                    instances=args.instances)
    policies = tuple(p for p in args.policies.split(",") if p)
    seeds = tuple(int(s) for s in args.seeds.split(",") if s)
    print(json.dumps(compare(cfg, policies, seeds), separators=(",", ":")))
    return 0
