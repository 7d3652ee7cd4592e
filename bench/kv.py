"""`pdserve bench kv`: what the KV store buys, in one run on real processes.

1. TTFT of a 2,048-token prompt, cold (Prefill on the prefill instance: compute + save to the
   store; that is when a disaggregated router has the first token) versus a store hit at a
   decode instance that never saw the prompt (Decode with the stored block keys: load the
   blocks, compute the last partial block, sample). Target: the hit >= 10x faster.
2. The hand-off: from the Prefill answer to the first token of the first decode step on
   another instance (Decode RPC, KV load from the store, one step), p50/p99, for 512 and 2,048
   tokens; and prefill's own overhead: its answer time minus its forward time (the prefill
   instance's step profile, read before and after each call), which is mostly the wait for
   its saves. Target: under 10% of the forward at 2,048 tokens.
3. With `--layer-segments 1,2` every measure is taken once per setting, on a fresh stack each
   (blocks stored whole vs as layer segments, the first put while later layers compute).
Every prompt is fresh random token ids, so nothing comes from an instance's own prefix cache.
The last line printed is one JSON object.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path

from pdserve.bench.kv_stack import KVStackSpec, kv_bench_stack
from pdserve.bench.stats import median, summarize


def add_kv_subcommand(sub) -> None:
    p = sub.add_parser("kv", help="KV store: TTFT cold vs store hit, prefill->decode hand-off")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--repeats", type=int, default=3, help="prompts per length (medians)")
    p.add_argument("--ttft-len", type=int, default=2048)
    p.add_argument("--handoff-lens", default="512,2048")
    p.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    p.add_argument("--prefill-cpus", default="0")
    p.add_argument("--decode-cpus", default="1")
    p.add_argument("--kv-transport", choices=["auto", "ucx", "tcp"], default="auto")
    p.add_argument("--log-dir", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--layer-segments", default="1",
                   help="comma list: stored objects per block (--kv-layer-segments), a stack each")
    p.set_defaults(func=run_kv)


def run_kv(args) -> int:
    lens = sorted({int(x) for x in args.handoff_lens.split(",") if x} | {args.ttft_len})
    if args.repeats < 1 or min(lens) < 16:
        raise ValueError("repeats must be >= 1 and prompt lengths >= 16")
    segments = [int(x) for x in args.layer_segments.split(",") if x]
    if not segments:
        raise ValueError("--layer-segments needs at least one value")
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pdserve-bench-kv-"))
    print(f"bench kv: {args.model}, lengths {lens}, {args.repeats} repeats, layer segments "
          f"{segments}; logs in {log_dir}", flush=True)
    results = {}
    for n_seg in segments:
        spec = KVStackSpec(model=args.model, threads=args.threads,
                           prefill_cpus=args.prefill_cpus, decode_cpus=args.decode_cpus,
                           max_model_len=max(lens) + 64, num_blocks=max(lens) // 16 + 72,
                           transport=args.kv_transport, layer_segments=n_seg)
        with kv_bench_stack(spec, log_dir / f"segments-{n_seg}") as stack:
            results[n_seg] = _measure(stack, lens, args)
        results[n_seg]["layer_segments"] = n_seg
    result = results[segments[0]] if len(segments) == 1 else {
        "bench": "kv", "by_layer_segments": {str(k): v for k, v in results.items()}}
    print(json.dumps(result), flush=True)
    return 0


def _measure(stack, lens: list[int], args) -> dict:
    import grpc

    from pdserve.common.rpc import engine_pb2 as pb
    from pdserve.common.rpc import engine_pb2_grpc as pb_grpc

    chans = {n: grpc.insecure_channel(getattr(stack, n)) for n in ("prefill", "decode_a",
                                                                  "decode_b")}
    prefill = pb_grpc.PrefillServiceStub(chans["prefill"])
    dec_a, dec_b = (pb_grpc.DecodeServiceStub(chans[n]) for n in ("decode_a", "decode_b"))
    vocab = prefill.Health(pb.HealthRequest(), timeout=10).vocab_size
    rng = random.Random(args.seed)
    cold, hit, handoff, same = [], [], {n: [] for n in lens}, []
    forward, overhead, steps = ({n: [] for n in lens} for _ in range(3))
    try:
        for _ in range(args.repeats):
            for n in lens:
                ids = [rng.randrange(vocab) for _ in range(n)]
                p0 = _profile(prefill, pb)
                t0 = time.perf_counter()
                first = prefill.Prefill(pb.PrefillRequest(prompt_token_ids=ids,
                                                          params=_greedy(pb, 2)), timeout=600)
                t1 = time.perf_counter()
                spent = _phases_s(p0, _profile(prefill, pb))
                forward[n].append(spent["forward"])
                overhead[n].append(t1 - t0 - forward[n][-1])
                steps[n].append(spent)
                handoff[n].append(_first_token_s(dec_a, pb, ids, t1, first_token_id=(
                    first.first_token_id), block_keys=first.block_keys, params=_greedy(pb, 2)))
                if n == args.ttft_len:
                    cold.append(t1 - t0)
                    t3 = time.perf_counter()
                    hit.append(_first_token_s(dec_b, pb, ids, t3, block_keys=first.block_keys,
                                              params=_greedy(pb, 1), want=first.first_token_id,
                                              same=same))
                print(f"  {n} tokens: prefill {t1 - t0:.3f} s (forward "
                      f"{forward[n][-1]:.3f} s), hand-off {handoff[n][-1] * 1e3:.1f} ms",
                      flush=True)
        load_b = dec_b.GetLoad(pb.LoadRequest(), timeout=10)
    finally:
        for ch in chans.values():
            ch.close()
    return _report(args, cold, hit, handoff, same, load_b) | _prefill_report(forward, overhead,
                                                                            steps)


_PHASES = ("schedule", "forward", "sample", "update")


def _profile(prefill, pb):
    """The prefill instance's step profile (cumulative since start)."""
    return prefill.GetLoad(pb.LoadRequest(), timeout=10).profile


def _phases_s(before, after) -> dict:
    """Seconds the prefill engine's steps spent per phase between two profiles, and steps."""
    out = {p: (getattr(after, p + "_ns") - getattr(before, p + "_ns")) * 1e-9
           for p in _PHASES}
    out["steps"] = after.num_steps - before.num_steps
    return out


def _prefill_report(forward: dict, overhead: dict, steps: dict) -> dict:
    """Per length: prefill's forward median, its overhead (answer minus forward) p50/p99, the
    p50 as a share of the forward, and the medians of the other step phases inside it."""
    out = {}
    for n, f in forward.items():
        o, fwd = summarize(overhead[n]), median(f)
        out[str(n)] = {"forward_s": fwd, "overhead_p50_s": o.p50, "overhead_p99_s": o.p99,
                       "overhead_share_of_forward": o.p50 / fwd if fwd else None,
                       "steps": median([s["steps"] for s in steps[n]]),
                       **{f"{p}_s": median([s[p] for s in steps[n]])
                          for p in _PHASES if p != "forward"}}
    return {"prefill_overhead": out}


def _greedy(pb, max_tokens: int):
    return pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def _first_token_s(stub, pb, ids, t_start, want=None, same=None, **req) -> float:
    """Seconds from t_start until a Decode stream's first token arrives."""
    call = stub.Decode(pb.DecodeRequest(prompt_token_ids=ids, **req), timeout=600)
    try:
        for msg in call:
            if msg.token_ids:
                if same is not None:
                    same.append(msg.token_ids[0] == want)
                return time.perf_counter() - t_start
    finally:
        call.cancel()
    raise RuntimeError("the decode stream ended without a token")


def _report(args, cold, hit, handoff, same, load_b) -> dict:
    gbps = load_b.kv.bytes_loaded / load_b.kv.load_seconds / 1e9 if load_b.kv.load_seconds \
        else None
    ttft_cold, ttft_hit = median(cold), median(hit)
    return {
        "bench": "kv", "model": args.model, "prompt_len": args.ttft_len,
        "repeats": args.repeats, "threads_per_engine": args.threads,
        "ttft_cold_s": ttft_cold, "ttft_hit_s": ttft_hit,
        "ttft_speedup": ttft_cold / ttft_hit if ttft_hit else None,
        "hit_first_token_matches": all(same) and bool(same),
        "handoff_s": {str(n): {"p50": summarize(v).p50, "p99": summarize(v).p99}
                      for n, v in handoff.items()},
        "store_load_gb_per_s": gbps,
        "hit_kv_load_failures": load_b.num_kv_load_failures,
    }
