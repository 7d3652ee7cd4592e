"""The pipeline hand-off between two CPU ranks on one host: gloo send/recv (what the engine
uses, common/distributed/pipeline.py) vs a shared-memory copy (copy into a /dev/shm slot,
publish a counter, the peer spins on it and copies out), at SmolLM2's shapes: hidden states
[rows, 576] and logits [rows, 49152], fp32.

Two fresh interpreters with one torch thread each play ping-pong (rank 0 sends, rank 1 sends
the same size back); a one-way figure is half the median round trip over --reps. Used by
`pdserve bench offline --pipeline-parallel-size 2` (offline_tp.py), which prints it beside
the throughput; run alone: `python -m pdserve.bench.offline_pp_handoff [--reps 200]`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

# (what, rows, columns): a decode micro-batch's and a 2048-token prefill chunk's hidden states,
# and the logits of 8 and 32 sampled rows
SHAPES = (("hidden", 8, 576), ("hidden", 2048, 576), ("logits", 8, 49152),
          ("logits", 32, 49152))


def _slot() -> int:
    return max(r * c for _, r, c in SHAPES)


def _shm_pingpong(rank: int, bufs, t: torch.Tensor, seq: int) -> None:
    """One round trip through the shared slots: rank 0 writes slot 0 and waits for slot 1."""
    ctrl, n = bufs.ctrl.numpy(), t.numel()
    mine, peer = rank, 1 - rank
    if rank == 1:
        _wait(ctrl, peer, seq)
        t.view(-1).copy_(bufs.data[0, peer, :n])
    bufs.data[0, mine, :n].copy_(t.view(-1))
    ctrl[mine, 0] = seq  # x86 total store order: the data is visible before the counter
    if rank == 0:
        _wait(ctrl, peer, seq)
        t.view(-1).copy_(bufs.data[0, peer, :n])


def _wait(ctrl, peer: int, seq: int) -> None:
    spins = 0
    while ctrl[peer, 0] < seq:
        spins += 1
        if spins > 200:
            os.sched_yield()


def _gloo_pingpong(rank: int, t: torch.Tensor) -> None:
    import torch.distributed as dist
    if rank == 0:
        dist.send(t, 1)
        dist.recv(t, 1)
    else:
        dist.recv(t, 0)
        dist.send(t, 0)


def _rank(rank: int, port: int, shm_path: str, reps: int, out_path: str) -> None:
    from pdserve.common.distributed.shm_comm import attach_buffers
    from pdserve.common.distributed.torch_comm import init_group, make_store

    torch.set_num_threads(1)
    gloo = init_group(make_store(port, 2, rank == 0), rank, 2, "cpu")
    bufs = attach_buffers(shm_path, 2, _slot())
    out, seq = {}, 0
    for what, rows, cols in SHAPES:
        t = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
        times = {"gloo": [], "shm": []}
        for i in range(reps + 5):  # alternating, the first 5 of each are warm-up
            for name in ("gloo", "shm"):
                t0 = time.perf_counter()
                if name == "gloo":
                    _gloo_pingpong(rank, t)
                else:
                    seq += 1
                    _shm_pingpong(rank, bufs, t, seq)
                if i >= 5:
                    times[name].append(time.perf_counter() - t0)
        out[f"{what}_{rows}x{cols}"] = {f"{k}_us": statistics.median(v) * 1e6 / 2
                                        for k, v in times.items()}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(out, f)
    gloo.close()


def run(reps: int) -> dict[str, dict[str, float]]:
    """{"hidden_8x576": {"gloo_us": one-way median, "shm_us": ...}, ...}."""
    from pdserve.bench.rank_procs import run_ranks

    def argv(r: int, port: int, shm: str, out: str) -> list[str]:
        spec = {"port": port, "shm": shm, "reps": reps, "out": out, "rank": r}
        return [sys.executable, "-m", "pdserve.bench.offline_pp_handoff", "--rank-spec",
                json.dumps(spec)]

    return run_ranks(2, _slot(), argv, "a hand-off")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--rank-spec", default="", help=argparse.SUPPRESS)  # internal: one rank
    args = p.parse_args(argv)
    if args.rank_spec:
        spec = json.loads(args.rank_spec)
        _rank(spec["rank"], spec["port"], spec["shm"], spec["reps"], spec["out"])
        return 0
    res = run(args.reps)
    print(f"{'tensor':<22}{'gloo us':>10}{'shm us':>10}{'gloo/shm':>10}")
    for name, r in res.items():
        print(f"{name:<22}{r['gloo_us']:>10.1f}{r['shm_us']:>10.1f}"
              f"{r['gloo_us'] / r['shm_us']:>10.2f}")
    print(json.dumps({"bench": "pp_handoff", "reps": args.reps, "one_way_us": res}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
