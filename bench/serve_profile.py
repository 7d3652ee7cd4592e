"""The served path's step breakdown: where an engine's decode step time went over a window.

    python -m pdserve.bench.serve_profile --engine HOST:PORT [--tls-dir DIR] --duration 60

reads the engine's cumulative StepProfile (GetLoad) before and after the window (run a load,
e.g. `pdserve bench serve`, against the stack meanwhile), and prints per-step milliseconds of
each phase (common/engine/step_profile.py), then one JSON line. `delta_breakdown` is the pure
arithmetic, shared with tests.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

from pdserve.common.engine.step_profile import PHASES


@dataclass(frozen=True)
class Breakdown:
    num_steps: int
    num_sampled: int
    num_messages: int
    ms_per_step: dict  # phase -> milliseconds per step (engine thread phases + loop phases)

    @property
    def step_ms(self) -> float:
        """The engine thread's own time per step (what bounds ITL)."""
        return sum(self.ms_per_step[p] for p in ("schedule", "forward", "sample", "update",
                                                 "publish"))


def delta_breakdown(before: dict, after: dict) -> Breakdown:
    """`before`/`after`: StepProfile counters ({field: int}); phases per step of the window."""
    steps = after["num_steps"] - before["num_steps"]
    if steps <= 0:
        raise ValueError("no engine step ran in the window: was a load running?")
    ms = {p: (after[f"{p}_ns"] - before[f"{p}_ns"]) / steps / 1e6 for p in PHASES}
    return Breakdown(steps, after["num_sampled"] - before["num_sampled"],
                     after["num_messages"] - before["num_messages"], ms)


def _snapshot(addr: str, tls_dir: str, role: str) -> dict:
    from google.protobuf.json_format import MessageToDict

    from pdserve.common.rpc import engine_pb2 as pb
    from pdserve.common.rpc import engine_pb2_grpc as pb_grpc
    from pdserve.common.engine.step_profile import StepProfile
    from pdserve.services.common.tls import TlsConfig, open_channel

    tls = TlsConfig.from_dir(tls_dir, "client") if tls_dir else TlsConfig()
    with open_channel(addr, tls, role, aio=False) as ch:
        load = pb_grpc.DecodeServiceStub(ch).GetLoad(pb.LoadRequest(), timeout=5)
    got = MessageToDict(load.profile, preserving_proto_field_name=True)
    keys = [k for k in StepProfile().snapshot() if k != "last_step_tokens"]
    return {k: int(got.get(k, 0)) for k in keys}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", required=True, help="the engine's gRPC host:port")
    ap.add_argument("--tls-dir", default="", help="client certificates (pdserve up's)")
    ap.add_argument("--engine-role", default="decode", choices=["decode", "prefill"],
                    help="whose certificate name to check under TLS")
    ap.add_argument("--duration", type=float, default=60.0)
    args = ap.parse_args(argv)
    before = _snapshot(args.engine, args.tls_dir, args.engine_role)
    time.sleep(args.duration)
    b = delta_breakdown(before, _snapshot(args.engine, args.tls_dir, args.engine_role))
    print(f"{b.num_steps} steps, {b.num_sampled} tokens sampled, {b.num_messages} messages")
    for p in PHASES:
        print(f"  {p:<9} {b.ms_per_step[p]:8.3f} ms/step")
    print(f"  engine thread {b.step_ms:.3f} ms/step; messages/token "
          f"{b.num_messages / max(1, b.num_sampled):.2f}")
    print(json.dumps({"bench": "serve_profile", "steps": b.num_steps,
                      "sampled": b.num_sampled, "messages": b.num_messages,
                      "engine_step_ms": round(b.step_ms, 3),
                      **{f"{p}_ms": round(v, 3) for p, v in b.ms_per_step.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
