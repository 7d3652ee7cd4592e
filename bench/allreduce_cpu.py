"""CPU all-reduce between tensor-parallel ranks on one host: gloo vs the shared-memory
all-reduce (common/distributed/shm_comm.py), at SmolLM2's decode shapes (hidden 576, rows
1..64; a decode step does 2 per layer plus one for the embedding: 61 calls for 30 layers).

Every rank is its own process with one torch thread, as in the engine; both implementations
run in the same processes, alternating, and each figure is the median over --reps calls (after
a warm-up). Prints a table, the ratio gloo/shm and one JSON line. Run it alone, nothing
else on the machine: the ranks spin while they wait for each other.

    .venv/bin/python -m pdserve.bench.allreduce_cpu [--world 2] [--reps 2000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

HIDDEN = 576
ROWS = (1, 4, 16, 64)
CALLS_PER_DECODE_STEP = 61  # SmolLM2: 30 layers x (o_proj + down_proj) + the embedding


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        info = f.read()
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines()
                 if ln.startswith("model name")), "unknown")
    return name + (" (avx512f)" if " avx512f" in info else "")


def _time_calls(fn, t: torch.Tensor, reps: int) -> float:
    """Median microseconds per call."""
    for _ in range(20):
        fn(t)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(t)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _rank(rank: int, world: int, port: int, shm_path: str, reps: int, out_path: str) -> None:
    from pdserve.common.distributed.shm_comm import ShmCommunicator, attach_buffers
    from pdserve.common.distributed.torch_comm import init_group, make_store

    torch.set_num_threads(1)
    gloo = init_group(make_store(port, world, rank == 0), rank, world, "cpu")
    shm_bufs = attach_buffers(shm_path, world, max(ROWS) * HIDDEN)
    shm = ShmCommunicator(rank, world, shm_bufs.ctrl, shm_bufs.data, lambda: True, gloo)
    out = {}
    for rows in ROWS:
        t = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows))
        expect = t * world  # every rank sends the same values here: the sum is t * world
        for name, comm in (("gloo", gloo), ("shm", shm)):
            x = t.clone()
            comm.all_reduce(x)
            if not torch.allclose(x, expect):
                raise RuntimeError(f"{name} all-reduce gave a wrong sum")
        out[rows] = {"gloo_us": _time_calls(gloo.all_reduce, t.clone(), reps),
                     "shm_us": _time_calls(shm.all_reduce, t.clone(), reps)}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(out, f)
    gloo.close()


def run(world: int, reps: int) -> dict[int, dict[str, float]]:
    """{rows: {"gloo_us": median, "shm_us": median}}; each rank a fresh interpreter."""
    from pdserve.bench.rank_procs import run_ranks

    def argv(r: int, port: int, shm: str, out: str) -> list[str]:
        return [sys.executable, "-m", "pdserve.bench.allreduce_cpu", "--rank", str(r),
                "--world", str(world), "--port", str(port), "--shm", shm, "--reps", str(reps),
                "--out", out]

    got = run_ranks(world, max(ROWS) * HIDDEN, argv, "an all-reduce")
    return {int(k): v for k, v in got.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--reps", type=int, default=2000)
    p.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)  # internal: a rank
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--shm", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank >= 0:
        _rank(args.rank, args.world, args.port, args.shm, args.reps, args.out)
        return 0
    res = run(args.world, args.reps)
    print(f"cpu: {cpu_name()}; ranks: {args.world}, 1 thread each; hidden {HIDDEN}, fp32")
    print(f"{'rows':>5}{'gloo us':>10}{'shm us':>10}{'gloo/shm':>10}")
    for rows in ROWS:
        r = res[rows]
        print(f"{rows:>5}{r['gloo_us']:>10.1f}{r['shm_us']:>10.1f}"
              f"{r['gloo_us'] / r['shm_us']:>10.1f}")
    step = {k: CALLS_PER_DECODE_STEP * res[1][k] / 1000 for k in ("gloo_us", "shm_us")}
    print(f"per decode step at batch 1 ({CALLS_PER_DECODE_STEP} calls): gloo "
          f"{step['gloo_us']:.2f} ms, shm {step['shm_us']:.2f} ms")
    print(json.dumps({"bench": "allreduce_cpu", "cpu": cpu_name(), "world": args.world,
                      "hidden": HIDDEN, "reps": args.reps,
                      "per_call_us": {str(r): res[r] for r in ROWS},
                      "ratio_gloo_over_shm": {str(r): res[r]["gloo_us"] / res[r]["shm_us"]
                                              for r in ROWS},
                      "per_decode_step_ms_batch1": {"gloo": step["gloo_us"],
                                                    "shm": step["shm_us"]}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
