"""What saving KV to a store costs a prefill instance with pipeline stages: one PP engine (one
thread per rank) prefilling the same prompts (max_tokens=1, a prefill instance's work) with
its producer KV connector (an in-process store) and with the connector switched off (as
warm-up does), in one run, interleaved. (One process can host one multi-process engine
only: torch.distributed's default group.)

With the connector every step's full blocks are copied out of every stage's cache (shared
memory) once the step came back from the last stage, and the I/O thread encodes and puts
them (docs/parallelism.md, "KV hand-off across layouts"). The end-of-step marker the last
stage sends for steps that sample nothing flows in both runs (the engine was built with a
connector). The ratio (time without / time with) is what saving costs; 1.0 means nothing.
Each repeat uses fresh prompts (no local prefix hit) and a fresh store, and the two runs
alternate which goes first. Last line: one JSON object.

    python -m pdserve.bench.offline_pp_kv [--model smollm2] [--pipeline-parallel-size 2]
        [--num-prompts 8] [--input-len 256] [--repeats 3] [--num-threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def _engine(args, store):
    from pdserve.common.config import CacheConfig, EngineConfig, ParallelConfig
    from pdserve.common.engine.engine_core import EngineCore
    from pdserve.connector.codec import BlockCodec
    from pdserve.connector.store_connector import ConnectorConfig, StoreKVConnector

    def factory(e):
        c = e.model_config
        codec = BlockCodec(e.fingerprint, c.num_layers, 16, c.num_kv_heads, c.head_dim)
        return StoreKVConnector(store, codec, ConnectorConfig(role="producer"))
    blocks = args.num_prompts * (-(-args.input_len // 16) + 1) + 16
    cfg = EngineConfig(model=args.model, num_threads=args.num_threads,
                       cache=CacheConfig(num_blocks=blocks, block_size=16),
                       parallel=ParallelConfig(pipeline_parallel_size=args.pp))
    return EngineCore(cfg, None, factory)  # every rank loads the checkpoint by name


def _prefill(core, prompts, connector) -> float:
    """Prefill `prompts` with `connector` (None: no saving) in place; seconds."""
    from pdserve.common.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    core.connector = core.scheduler.connector = connector
    core.pool.reset_prefix_cache()
    t = time.perf_counter()
    for i, p in enumerate(prompts):
        core.add_request(f"p{i}", p, params)
    while core.has_unfinished_requests():  # a producer's output waits for its saves
        core.step()
    return time.perf_counter() - t


def run(args) -> dict:
    from pdserve.bench.allreduce_cpu import cpu_name
    from pdserve.bench.offline import random_prompts
    from pdserve.common.models.registry import load_model
    from pdserve.connector.store import InMemoryBlockStore

    torch.set_num_threads(args.num_threads)
    vocab = load_model(args.model).config.vocab_size
    store = InMemoryBlockStore()
    core = _engine(args, store)
    connector = core.connector
    t_plain, t_save = [], []
    try:
        for _ in range(args.warmup + args.repeats):
            prompts = random_prompts(args.num_prompts, args.input_len, vocab,
                                     args.seed + len(t_plain))
            store.objects.clear()
            runs = [(t_plain, None), (t_save, connector)]
            for times, conn in runs[::-1] if len(t_plain) % 2 else runs:  # alternate first
                times.append(_prefill(core, prompts, conn))
        saved = connector.stats.blocks_saved
    finally:
        core.connector = connector
        core.close()
    t_plain, t_save = t_plain[args.warmup:], t_save[args.warmup:]
    a, b = statistics.median(t_plain), statistics.median(t_save)
    return {"bench": "offline_pp_kv", "cpu": cpu_name(), "model": args.model,
            "pipeline_parallel_size": args.pp, "threads_per_rank": args.num_threads,
            "num_prompts": args.num_prompts, "input_len": args.input_len,
            "repeats": args.repeats, "no_connector_s": a, "connector_s": b,
            "ratio_no_connector_over_connector": a / b, "blocks_saved_total": saved,
            "runs_no_connector_s": t_plain, "runs_connector_s": t_save}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--pipeline-parallel-size", dest="pp", type=int, default=2)
    ap.add_argument("--num-threads", type=int, default=1, help="per rank")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="untimed repeats first")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for name in ("num_threads", "num_prompts", "input_len", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.pp < 2:
        ap.error("--pipeline-parallel-size must be >= 2")
    res = run(args)
    print(f"cpu: {res['cpu']}")
    print(f"PP={args.pp} prefill of {args.num_prompts} x {args.input_len} tokens, "
          f"{args.num_threads} thread(s)/rank, median of {args.repeats}:")
    print(f"  no connector   {res['no_connector_s']:8.2f} s")
    print(f"  producer       {res['connector_s']:8.2f} s "
          f"({res['blocks_saved_total']} blocks saved in all)")
    print(f"ratio no connector / producer: {res['ratio_no_connector_over_connector']:.2f}")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
