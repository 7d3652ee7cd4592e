"""`pdserve bench router`: routing decisions per second and the latency the router adds.

1. Decisions: the router's per-request path (admission, block keys, policy pick over
   `--instances` instances, lease and ticket closed) timed in process, no network.
2. Added latency: a child process runs instant fake instances and a router over them; this
   process sends `--requests` sequential one-token requests through the router's gRPC API
   and as many straight Decode calls to one fake instance (the baseline, in the same run);
   the router adds the difference of their percentiles.
The last line is one JSON object: decisions_per_s, added_p50_ms, added_p99_ms, ...
Targets: >= 2,000 decisions/s and <= 2 ms added at p99.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np

TARGET_DECISIONS_PER_S = 2000.0
TARGET_ADDED_P99_MS = 2.0


def add_router_bench_subcommand(sub) -> None:
    p = sub.add_parser("router", help="router decisions/s and added latency vs direct calls")
    p.add_argument("--instances", type=int, default=4, help="fake decode instances")
    p.add_argument("--requests", type=int, default=1000, help="timed calls per path")
    p.add_argument("--decisions", type=int, default=5000,
                   help="routing decisions timed for the policy's per-decision cost")
    p.add_argument("--prompt-tokens", type=int, default=256, help="tokens per prompt")
    p.add_argument("--policy", default="kv_aware", help="the routing policy measured")
    p.set_defaults(func=_run)


def _calls(stub_call, make_req, n: int) -> np.ndarray:
    took = np.empty(n)
    for i in range(n):
        t0 = time.perf_counter()
        for _ in stub_call(make_req(i), timeout=10):
            pass
        took[i] = time.perf_counter() - t0
    return took


def _latencies(addrs: dict, n: int, prompt_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(router, direct) seconds per call, interleaved in chunks so drift hits both alike."""
    import grpc

    from pdserve.common.rpc import engine_pb2 as pb
    from pdserve.common.rpc import engine_pb2_grpc as pb_grpc
    from pdserve.common.rpc import router_pb2, router_pb2_grpc

    params = pb.SamplingParams(max_tokens=1)

    def ids(i):
        return [(i % 32) + 1] * (prompt_tokens - 1) + [i % 251]
    with grpc.insecure_channel(addrs["router"]) as rc, grpc.insecure_channel(addrs["direct"]) as dc:
        routed = router_pb2_grpc.RouterStub(rc).Generate
        direct = pb_grpc.DecodeServiceStub(dc).Decode

        def via_router(i):
            return router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=ids(i)),
                                              params=params)

        def straight(i):
            return pb.DecodeRequest(request_id=str(i), prompt_token_ids=ids(i), params=params)
        _calls(routed, via_router, 200), _calls(direct, straight, 200)  # warm up
        r, d = [], []
        for chunk in range(0, n, 100):
            r.append(_calls(routed, via_router, min(100, n - chunk)))
            d.append(_calls(direct, straight, min(100, n - chunk)))
    return np.concatenate(r), np.concatenate(d)


def _serve(instances: int, policy: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pdserve.bench.router_serve",
                             str(instances), policy], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def _run(args) -> int:
    import torch

    from pdserve.bench.router_decisions import time_decisions

    torch.set_num_threads(1)
    dec = np.array(time_decisions(args.policy, args.instances, args.decisions,
                                  args.prompt_tokens))
    child = _serve(args.instances, args.policy)
    try:
        addrs = json.loads(child.stdout.readline())
        routed, direct = _latencies(addrs, args.requests, args.prompt_tokens)
    finally:
        child.stdin.close()
        child.wait(30)
    print(f"decision: p50 {np.median(dec) * 1e6:.0f} us, p99 "
          f"{np.percentile(dec, 99) * 1e6:.0f} us over {len(dec)}")
    out = _summary(args, dec, routed, direct)
    print(f"router call p50 {out['router_p50_ms']} ms p99 {out['router_p99_ms']} ms; direct "
          f"p50 {out['direct_p50_ms']} ms p99 {out['direct_p99_ms']} ms")
    print(json.dumps(out))
    return 0


def _summary(args, dec, routed, direct) -> dict:
    def ms(a, q):
        return round(float(np.percentile(a, q)) * 1e3, 3)
    out = {"bench": "router", "policy": args.policy, "instances": args.instances,
           "prompt_tokens": args.prompt_tokens, "requests": len(routed),
           "decisions_per_s": round(len(dec) / float(dec.sum()), 1),
           "decision_p99_us": round(float(np.percentile(dec, 99)) * 1e6, 1),
           "router_p50_ms": ms(routed, 50), "router_p99_ms": ms(routed, 99),
           "direct_p50_ms": ms(direct, 50), "direct_p99_ms": ms(direct, 99)}
    out["added_p50_ms"] = round(out["router_p50_ms"] - out["direct_p50_ms"], 3)
    out["added_p99_ms"] = round(out["router_p99_ms"] - out["direct_p99_ms"], 3)
    out["meets_targets"] = (out["decisions_per_s"] >= TARGET_DECISIONS_PER_S
                            and out["added_p99_ms"] <= TARGET_ADDED_P99_MS)
    return out
