"""The decode step of one engine, driven offline and hosted, in one process (issue 19):

    python -m pdserve.bench.engine_host_step --batch 16 48 --num-threads 2 --cpus 0,1

served ITL p50 is slower than `bench/offline_step.py`'s decode step at the same batch. This
splits what the engine service adds to a step from what other processes (router, client) add:
one EngineCore, built as `pdserve up --mode colocated` builds it (EngineServiceConfig, the
process settings of services/engine_host/engine_server.py: the pin, torch's threads, the GIL
switch interval), timed per batch size B in rounds, each B random prompts of --input-len
tokens then --decode-steps decode-only steps:

- `offline`: a thread calls `core.step()` in a loop (what offline_step does);
- `hosted`: the service's AsyncEngine runs the steps on its engine thread and an asyncio loop
  in the main thread reads every request's stream (its hand-off, RequestStream and the loop's
  wake-ups; no gRPC, no router, no client);
- `offline+team`, `hosted+team`: the same while another thread that once ran a parallel torch
  op idles, as the served engine's main thread does after loading the model. libgomp then
  manages more threads than the process has cores and spins only ~100 iterations before a
  waiting worker sleeps (`gomp_throttled_spin_count_var`), so every parallel region of the
  forward pays a futex wake-up.

Every mode's steps run on a thread that exits after its round (the core is built on one too),
so no libgomp team outlives a round but IdleTeam's. The rounds alternate (offline, offline+team, hosted, hosted+team, offline, ...) so a neighbour's load falls on
every mode alike. A step counts when it computed B tokens with B requests running (decodes
only). Prints each mode's median per B and its ratio to offline, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import threading
import time

from pdserve.bench.offline import cpu_name

MODES = ("offline", "offline+team", "hosted", "hosted+team")


def _parse_cpus(text: str) -> tuple[int, ...]:
    return tuple(int(c) for c in text.split(",") if c.strip()) if text else ()


class StepTimer:
    """Wraps `core.step` (an instance attribute, so AsyncEngine's calls go through it): the
    wall time of every step that was decode-only at batch `batch`, into `times` (ms)."""

    def __init__(self, core):
        self.core, self._step = core, core.step
        self.batch, self.times = 0, []

    def __call__(self):
        t0 = time.perf_counter()
        out = self._step()
        dt = time.perf_counter() - t0
        core = self.core
        if core.profile.last_step_tokens == self.batch and len(core.scheduler.running) == self.batch:
            self.times.append(dt * 1e3)
        return out


class IdleTeam:
    """A thread that runs one parallel torch op (so libgomp gives it a team of its own, as
    the served engine's main thread has one from loading the model) and then idles until
    closed; its exit releases the team."""

    def __init__(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        import torch

        torch.ones(1 << 22).add_(1.0)  # above at::parallel_for's grain: a parallel region
        self._stop.wait()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def _requests(rng, vocab, b, input_len, decode_steps, temperature, tag):
    from pdserve.common.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=decode_steps + 2, temperature=temperature,
                            ignore_eos=True)
    return [(f"{tag}-{i}", [rng.randrange(vocab) for _ in range(input_len)], params)
            for i in range(b)]


def run_offline(core, reqs) -> None:
    for rid, prompt, params in reqs:
        core.add_request(rid, prompt, params)
    while core.has_unfinished_requests():
        core.step()


async def run_hosted(engine, reqs) -> None:
    async def one(rid, prompt, params):
        stream = await engine.submit(rid, prompt, params)
        try:
            async for out in stream:
                if out.finished:
                    return
        finally:
            stream.close()

    await asyncio.gather(*(one(*r) for r in reqs))


async def _hosted_round(core, reqs) -> None:
    """One round through a fresh AsyncEngine, stopped after it: its thread is the only one
    that may step the core while it runs (an idle engine thread steps any request it sees)."""
    from pdserve.services.engine_host.async_engine import AsyncEngine

    engine = AsyncEngine(core)
    engine.start(asyncio.get_running_loop())
    try:
        await engine.wait_warmed_up()
        await run_hosted(engine, reqs)
    finally:
        await asyncio.get_running_loop().run_in_executor(None, engine.stop)


async def measure(args, core, timer) -> dict:
    from pdserve.services.engine_host.build_thread import run_on_exiting_thread

    """No torch op runs on this (the main) thread: every mode's steps run on a thread that
    exits after its round, so the only libgomp teams are the round's and IdleTeam's."""
    run_on_exiting_thread(core.warm_up)
    rng, vocab = random.Random(0), core.model_config.vocab_size
    times = {m: {b: [] for b in args.batch} for m in MODES}
    for rnd in range(args.rounds):
        for b in args.batch:
            for mode in MODES:
                reqs = _requests(rng, vocab, b, args.input_len, args.decode_steps,
                                 args.temperature, f"{mode}-{b}-{rnd}")
                timer.batch, timer.times = b, []
                team = IdleTeam() if mode.endswith("+team") else contextlib.nullcontext()
                with team:
                    if mode.startswith("offline"):
                        run_on_exiting_thread(run_offline, core, reqs)
                    else:
                        await _hosted_round(core, reqs)
                times[mode][b] += timer.times
    return times


def main(argv=None) -> int:
    from pdserve.common.engine.cli import add_weights_arg

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    add_weights_arg(ap)
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 48])
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-threads", type=int, default=2)
    ap.add_argument("--cpus", default="", help="pin as `pdserve up --cpus` does, e.g. 0,1")
    ap.add_argument("--temperature", type=float, default=1.0)
    args = ap.parse_args(argv)
    from pdserve.services.engine_host.engine_server import apply_process_settings, build_core
    from pdserve.services.engine_host.engine_service_config import EngineServiceConfig

    blocks = max(args.batch) * (-(-(args.input_len + args.decode_steps + 2) // 16) + 1) + 64
    cfg = EngineServiceConfig(num_threads=args.num_threads, cpus=_parse_cpus(args.cpus),
                              model=args.model, weights=args.weights, dtype=args.dtype,
                              kv_cache_dtype=args.kv_cache_dtype, num_blocks=blocks,
                              enable_prefix_caching=False)
    from pdserve.services.engine_host.build_thread import run_on_exiting_thread

    apply_process_settings(cfg)  # here first: threads inherit the pin
    core = run_on_exiting_thread(build_core, cfg)
    timer = StepTimer(core)
    core.step = timer
    times = asyncio.run(measure(args, core, timer))
    med = {m: {b: round(statistics.median(v), 2) for b, v in per.items() if v}
           for m, per in times.items()}
    for b in args.batch:
        off = med["offline"].get(b)
        row = ", ".join(f"{m} {med[m].get(b)} ms" + (
            f" ({med[m][b] / off:.3f}x)" if off and m != "offline" and b in med[m] else "")
            for m in MODES)
        print(f"batch {b}: {row}  (steps: {[len(times[m][b]) for m in MODES]})", flush=True)
    print(json.dumps({"bench": "engine_host_step", "decode_step_ms": med, "modes": MODES,
                      "switch_interval_ms": cfg.gil_switch_interval_ms,
                      "cpus": args.cpus, "num_threads": args.num_threads,
                      "affinity": sorted(os.sched_getaffinity(0)),
                      "loadavg": open("/proc/loadavg").read().split()[:3],
                      "cpu": cpu_name()}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
