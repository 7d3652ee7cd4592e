"""What an idle OpenMP worker costs: torch ops separated by non-parallel gaps, the process's CPU
time per libgomp spin setting (the peer of services/engine_host/omp_env.py):

    python -m pdserve.bench.omp_spin --gap-ms 3 --iters 200

Each setting runs in a fresh process (libgomp reads its environment once, when torch loads it):
`--iters` matmuls of 512 x 512 on 2 threads, each followed by a `--gap-ms` sleep, standing in
for the engine thread's time outside torch (waiting for the GIL, sampling, idling). Prints the
CPU seconds each setting burned and how much of it was beyond the work itself (the passive
setting's), then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from pdserve.bench.offline import cpu_name

SPIN_COUNT = 10_000  # the candidate (docs/served-performance.md)
SETTINGS = (("libgomp default (300000)", {}),
            (f"GOMP_SPINCOUNT={SPIN_COUNT} (candidate)", {"GOMP_SPINCOUNT": str(SPIN_COUNT)}),
            ("OMP_WAIT_POLICY=passive", {"OMP_WAIT_POLICY": "passive"}))

_CHILD = """
import sys, time, torch
torch.set_num_threads(2)
a = torch.randn(512, 512)
iters, gap = int(sys.argv[1]), float(sys.argv[2]) * 1e-3
a @ a
c0, t0 = time.process_time(), time.perf_counter()
for _ in range(iters):
    a @ a
    time.sleep(gap)
print(time.process_time() - c0, time.perf_counter() - t0)
"""


def run(env: dict, iters: int, gap_ms: float) -> tuple[float, float]:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", _CHILD, str(iters), str(gap_ms)],
                         env=dict(clean, **env), capture_output=True, text=True, check=True)
    cpu, wall = (float(x) for x in out.stdout.split())
    return cpu, wall


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--gap-ms", type=float, default=3.0)
    args = p.parse_args(argv)
    if not 1 <= args.iters <= 100_000 or not 0 <= args.gap_ms <= 1000:
        p.error("--iters in [1, 100000], --gap-ms in [0, 1000]")
    print(f"cpu: {cpu_name()}")
    res = {name: run(env, args.iters, args.gap_ms) for name, env in SETTINGS}
    floor = res[SETTINGS[-1][0]][0]
    for name, (cpu, wall) in res.items():
        print(f"{name:40s} cpu {cpu:6.2f} s  wall {wall:6.2f} s  beyond the work "
              f"{(cpu - floor) / args.iters * 1e3:6.2f} ms per gap")
    print(json.dumps({"bench": "omp_spin", "cpu": cpu_name(),
                      "iters": args.iters, "gap_ms": args.gap_ms,
                      "cpu_s": {n: r[0] for n, r in res.items()},
                      "wall_s": {n: r[1] for n, r in res.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
