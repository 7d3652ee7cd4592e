"""`pdserve bench offline --tensor-parallel-size T --pipeline-parallel-size P`: the engine
split over T x P ranks (each with --num-threads threads) against the same engine unsplit with
T x P x --num-threads threads, same prompts and workload as the offline bench, in one run,
interleaved. The ratio (split tok/s / unsplit tok/s) says what the split costs in
communication, duplicated work and (pipeline) idle stages on a machine whose cores the two
configurations share alike; 1.0 means nothing.

Also measures, in the same sitting, the all-reduce per call at the decode shapes
(bench/allreduce_cpu.py; T > 1) for the shared-memory implementation the engine uses and for
gloo, and the pipeline hand-off (offline_pp_handoff.py; P > 1) through gloo send/recv, which
the engine uses, and through a shared-memory copy. Last line: one JSON object.
"""

from __future__ import annotations

import json
import statistics

import torch


def run_offline_tp(args) -> int:
    from pdserve.bench.allreduce_cpu import CALLS_PER_DECODE_STEP, cpu_name
    from pdserve.bench.allreduce_cpu import run as run_allreduce
    from pdserve.bench.offline import random_prompts, run_ours
    from pdserve.bench.offline import weights_modes
    from pdserve.bench.offline_engine import check_fits, served_engine_config
    from pdserve.common.config import EngineConfig, ParallelConfig
    from pdserve.common.engine.llm import LLM
    from pdserve.common.models.registry import load_model

    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    world = tp * pp
    n_prompts = 4 if args.batch1 and args.num_prompts == 64 else args.num_prompts
    weights = weights_modes(args.weights)[0]  # one mode here: the first of --weights
    loaded = load_model(args.model, weights=weights)
    prompts = random_prompts(n_prompts, args.input_len, loaded.config.vocab_size, args.seed)
    concurrency = 1 if args.batch1 else n_prompts

    def config(size: tuple[int, int], threads: int) -> EngineConfig:
        parallel = ParallelConfig(tensor_parallel_size=size[0], pipeline_parallel_size=size[1],
                                  all_reduce=args.tp_all_reduce)
        cfg = served_engine_config(args, weights, args.kv_cache_dtype, concurrency,
                                   args.input_len + args.output_len, threads, parallel)
        check_fits(cfg, args.input_len, args.output_len)
        return cfg

    single_threads = world * args.num_threads
    single = LLM(config((1, 1), single_threads), loaded=loaded)
    split = LLM(config((tp, pp), args.num_threads))  # workers load the checkpoint by name
    del loaded
    t_single, t_split = [], []
    try:
        # one untimed run each first: the first run pays one-time costs (oneDNN's kernel
        # generation for new shapes, first-touch of the KV caches, the workers' first steps)
        torch.set_num_threads(single_threads)
        run_ours(single, prompts, args.output_len, args.batch1)
        torch.set_num_threads(args.num_threads)
        run_ours(split, prompts, args.output_len, args.batch1)
        for _ in range(args.repeats):  # interleaved, so drift hits both alike
            torch.set_num_threads(single_threads)
            t_single.append(run_ours(single, prompts, args.output_len, args.batch1))
            torch.set_num_threads(args.num_threads)
            t_split.append(run_ours(split, prompts, args.output_len, args.batch1))
    finally:
        split.engine.close()
    n_out = n_prompts * args.output_len
    s1, sp = statistics.median(t_single), statistics.median(t_split)
    res = {"bench": "offline_tp" if pp == 1 else "offline_pp", "cpu": cpu_name(),
           "model": args.model, "tensor_parallel_size": tp, "pipeline_parallel_size": pp,
           "threads_per_rank": args.num_threads,
           "tp1_threads": single_threads, "all_reduce": args.tp_all_reduce,
           "num_prompts": n_prompts, "input_len": args.input_len,
           "output_len": args.output_len, "batch1": args.batch1, "repeats": args.repeats,
           "tp1_s": s1, "tp_s": sp, "tp1_output_tok_s": n_out / s1, "tp_output_tok_s": n_out / sp,
           "ratio_tp_over_tp1": s1 / sp, "runs_single_s": t_single, "runs_split_s": t_split}
    name = f"TP={tp}" + (f" x PP={pp}" if pp > 1 else "")
    print(f"cpu: {res['cpu']}")
    print(f"{'engine':<34}{'time s':>10}{'output tok/s':>14}")
    print(f"{'TP=1, ' + str(single_threads) + ' threads':<34}{s1:>10.2f}{n_out / s1:>14.1f}")
    print(f"{f'{name}, {args.num_threads} thread(s)/rank':<34}{sp:>10.2f}{n_out / sp:>14.1f}")
    print(f"ratio {name} / TP=1: {s1 / sp:.2f}")
    if tp > 1:
        ar = run_allreduce(tp, 1000)
        res["allreduce_per_call_us"] = {str(r): v for r, v in ar.items()}
        res["allreduce_per_decode_step_ms_batch1"] = {
            k: CALLS_PER_DECODE_STEP * ar[1][f"{k}_us"] / 1000 for k in ("shm", "gloo")}
        print("all-reduce per call, rows 1/64: shm "
              f"{ar[1]['shm_us']:.1f}/{ar[64]['shm_us']:.1f} us, gloo "
              f"{ar[1]['gloo_us']:.1f}/{ar[64]['gloo_us']:.1f} us")
    if pp > 1:
        from pdserve.bench.offline_pp_handoff import run as run_handoff
        hand = run_handoff(100)
        res["pp_handoff_one_way_us"] = hand
        print("pipeline hand-off one way, gloo / shm copy: " + ", ".join(
            f"{k} {v['gloo_us']:.0f}/{v['shm_us']:.0f} us" for k, v in hand.items()))
    print(json.dumps(res))
    return 0
