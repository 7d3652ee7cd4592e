"""`pdserve bench sampler`'s flags, apart from the bench (which imports torch when it runs, so
`pdserve --help` stays light)."""

from __future__ import annotations

import argparse


def add_sampler_subcommand(sub) -> None:
    p = sub.add_parser("sampler", help="per-step sampling time, new sampler vs the old one")
    sampler_args(p)
    p.set_defaults(func=_run)


def sampler_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", type=int, default=64, help="requests sampled per step")
    p.add_argument("--num-threads", type=int, default=2, help="torch threads")
    p.add_argument("--reps", type=int, default=15, help="timed repetitions per case")
    p.add_argument("--logits", choices=["smollm2", "synthetic"], default="smollm2",
                   help="SmolLM2's own logits on random prompts, or random normal rows")
    p.add_argument("--vocab", type=int, default=49152, help="synthetic logits only")
    p.add_argument("--scale", type=float, default=4.0, help="synthetic logits' std")


def _run(args) -> int:
    from pdserve.bench.sampler import run

    return run(args)
