"""The served path's step breakdown: where an engine's decode step time went over a window.

    python -m pdserve.bench.serve_profile --engine HOST:PORT [--tls-dir DIR] --duration 60 \
        [--delay S] [--router-pid PID]
    python -m pdserve.bench.serve_profile --engine HOST:PORT --decode-window 600 ...

reads the engine's cumulative StepProfile (GetLoad) before and after the window (run a load,
e.g. `pdserve bench serve`, against the stack meanwhile), and prints per-step milliseconds of
each phase (common/engine/step_profile.py), the CPU time per step of the engine thread, of the
service's event loop thread and of the whole engine process (what competes with torch's
threads for the cores), and, with --router-pid (a router on this host), the router's CPU time
per generated token; then one JSON line. --decode-window finds the window itself: a run's
decode-only steps to its end (bench/decode_window.py). `delta_breakdown` is the pure arithmetic, shared with
tests.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

from pdserve.common.engine.step_profile import PHASES


CPU_FIELDS = ("step_cpu", "loop_cpu", "process_cpu")  # StepProfile's *_cpu_ns (engine.proto)


@dataclass(frozen=True)
class Breakdown:
    num_steps: int
    num_sampled: int
    num_messages: int
    ms_per_step: dict  # phase -> milliseconds per step (engine thread phases + loop phases)
    cpu_ms_per_step: dict  # CPU_FIELDS -> CPU milliseconds per step (0: an older engine)

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
    cpu = {c: (after.get(f"{c}_ns", 0) - before.get(f"{c}_ns", 0)) / steps / 1e6
           for c in CPU_FIELDS}
    return Breakdown(steps, after["num_sampled"] - before["num_sampled"],
                     after["num_messages"] - before["num_messages"], ms, cpu)


def process_cpu_s(pid: int) -> float:
    """A local process's CPU time (user + system), from /proc."""
    import os

    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _snapshot(addr: str, tls_dir: str, role: str) -> dict:
    from pdserve.common.rpc import engine_pb2_grpc as pb_grpc

    with _channel(addr, tls_dir, role) as ch:
        return _read_profile(pb_grpc.DecodeServiceStub(ch))


def snapshot_fn(addr: str, tls_dir: str, role: str):
    """A StepProfile reader over one channel kept open (for frequent polls); the channel
    lives as long as the returned function."""
    from pdserve.common.rpc import engine_pb2_grpc as pb_grpc

    stub = pb_grpc.DecodeServiceStub(_channel(addr, tls_dir, role))
    return lambda: _read_profile(stub)


def _channel(addr: str, tls_dir: str, role: str):
    from pdserve.services.common.tls import TlsConfig, open_channel

    tls = TlsConfig.from_dir(tls_dir, "client") if tls_dir else TlsConfig()
    return open_channel(addr, tls, role, aio=False)


def _read_profile(stub) -> dict:
    from pdserve.common.engine.step_profile import StepProfile
    from pdserve.common.rpc import engine_pb2 as pb

    prof = stub.GetLoad(pb.LoadRequest(), timeout=5).profile
    keys = [k for k in StepProfile().snapshot() if k != "last_step_tokens"]
    keys += [f"{c}_ns" for c in CPU_FIELDS]
    return {k: int(getattr(prof, k)) for k in keys}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", required=True, help="the engine's gRPC host:port")
    ap.add_argument("--tls-dir", default="", help="client certificates (pdserve up's)")
    ap.add_argument("--engine-role", default="decode", choices=["decode", "prefill"],
                    help="whose certificate name to check under TLS")
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--delay", type=float, default=0.0,
                    help="seconds to wait before the window opens (e.g. past the prefill)")
    ap.add_argument("--after-first-step", type=float, default=0.0, metavar="MAX_S",
                    help="> 0: before --delay, wait (up to MAX_S seconds) until the engine "
                         "runs a step, i.e. the load began (a client's start takes a while)")
    ap.add_argument("--router-pid", type=int, default=0,
                    help="a local router's process id: also its CPU per generated token")
    ap.add_argument("--decode-window", type=float, default=0.0, metavar="MAX_S",
                    help="> 0: instead of --after-first-step/--delay/--duration, poll the "
                         "engine (up to MAX_S seconds, until a run ended) and measure from "
                         "its first decode-only steps to its last step (bench/decode_window.py)")
    args = ap.parse_args(argv)
    if args.decode_window > 0:
        first, last = _decode_window(args)
    else:
        first, last = _fixed_window(args)
    b = delta_breakdown(first.counters, last.counters)
    wall = last.t - first.t
    period = wall * 1e3 / b.num_steps  # one step to the next, the engine's ITL floor
    extra = {"window_s": round(wall, 3), "period_ms": round(period, 3),
             "outside_step_ms": round(period - b.step_ms, 3),
             "mean_batch": round(b.num_sampled / b.num_steps, 2),
             "process_cores": round(b.cpu_ms_per_step["process_cpu"] * b.num_steps / 1e3
                                    / wall, 3)}
    if args.router_pid:
        router_s = last.router_cpu_s - first.router_cpu_s
        extra["router_cpu_ms_per_token"] = round(router_s * 1e3 / max(1, b.num_sampled), 4)
    _print(b, extra)
    return 0


def _reader(args):
    """A Sample of the engine's counters (and the router's CPU) now, over one channel."""
    from pdserve.bench.decode_window import Sample

    snap = snapshot_fn(args.engine, args.tls_dir, args.engine_role)
    return lambda: Sample(time.monotonic(), snap(),
                          process_cpu_s(args.router_pid) if args.router_pid else 0.0)


def _fixed_window(args):
    if args.after_first_step > 0:
        wait_for_a_step(args, time.monotonic() + args.after_first_step)
    time.sleep(args.delay)
    read = _reader(args)
    first = read()
    time.sleep(args.duration)
    return first, read()


def _decode_window(args):
    from pdserve.bench.decode_window import decode_window, poll

    return decode_window(poll(_reader(args), args.decode_window, poll_s=0.5))


def wait_for_a_step(args, deadline: float, poll_s: float = 0.5) -> None:
    """Returns once the engine's step count moved (or at `deadline`: the window then opens
    anyway, and an idle window says so)."""
    first = _snapshot(args.engine, args.tls_dir, args.engine_role)["num_steps"]
    while time.monotonic() < deadline:
        time.sleep(poll_s)
        if _snapshot(args.engine, args.tls_dir, args.engine_role)["num_steps"] != first:
            return


def _print(b: Breakdown, extra: dict) -> None:
    print(f"{b.num_steps} steps, {b.num_sampled} tokens sampled, {b.num_messages} messages")
    for p in PHASES:
        print(f"  {p:<9} {b.ms_per_step[p]:8.3f} ms/step")
    print(f"  engine thread {b.step_ms:.3f} ms/step; messages/token "
          f"{b.num_messages / max(1, b.num_sampled):.2f}")
    print(f"  a step every {extra['period_ms']:.3f} ms: {extra['outside_step_ms']:.3f} ms of it "
          f"outside the step (command drain, stats, idle); mean batch {extra['mean_batch']}")
    cpu = b.cpu_ms_per_step
    print(f"  CPU ms/step: engine thread {cpu['step_cpu']:.3f}, event loop "
          f"{cpu['loop_cpu']:.3f}, whole process {cpu['process_cpu']:.3f} "
          f"({extra['process_cores']:.2f} cores)")
    if "router_cpu_ms_per_token" in extra:
        print(f"  router CPU {extra['router_cpu_ms_per_token']:.3f} ms per generated token")
    print(json.dumps({"bench": "serve_profile", "steps": b.num_steps,
                      "sampled": b.num_sampled, "messages": b.num_messages,
                      "engine_step_ms": round(b.step_ms, 3),
                      **{f"{p}_ms": round(v, 3) for p, v in b.ms_per_step.items()},
                      **{f"{c}_ms": round(v, 3) for c, v in cpu.items()}, **extra}))


if __name__ == "__main__":
    raise SystemExit(main())
