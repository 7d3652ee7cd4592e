"""The `--itl-target-ms` trade-off curve: ITL p50/p99 against throughput, served colocated.

    python -m pdserve.bench.serve_itl_sweep \
        --targets 0 150 250 400 [--model smollm2] [--rate 2] [--num-prompts 48]

For each target (0: the fixed budget) it starts `pdserve up --mode colocated` with that
`--itl-target-ms`, warms it with 4 requests, runs `pdserve bench serve` (random prompts of
--input-len -> --output-len tokens, EOS ignored, Poisson at --rate), stops the stack, and prints
a row; then one JSON line {"curve": [{target_ms, itl_p50_ms, itl_p99_ms, ttft_p50_s,
output_tok_s}, ...], "cpu": ...}.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pdserve.bench.offline import cpu_name


def _pdserve() -> list[str]:
    exe = Path(sys.executable).with_name("pdserve")
    return [str(exe)] if exe.exists() else [shutil.which("pdserve") or "pdserve"]


def _up(args, target: float, log: Path) -> subprocess.Popen:
    words = _pdserve() + ["up", "--mode", "colocated", "--model", args.model, "--weights",
                          args.weights, "--num-threads", str(args.num_threads), "--cpus",
                          args.cpus, "--no-prefix-caching", "--insecure", "--discovery",
                          "static", "--port", str(args.port), "--grpc-port",
                          str(args.port + 1), "--itl-target-ms", str(target)]
    return subprocess.Popen(words, stdout=log.open("w"), stderr=subprocess.STDOUT)


def _wait_ready(proc: subprocess.Popen, log: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(line.startswith("ready") for line in log.read_text().splitlines()):
            return
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    raise RuntimeError(f"pdserve up did not become ready; see {log}")


def _serve(args, out: Path, num_prompts: int, rate: str) -> dict:
    words = _pdserve() + ["bench", "serve", "--base-url", f"http://127.0.0.1:{args.port}",
                          "--workload", "random", "--num-prompts", str(num_prompts),
                          "--input-len", str(args.input_len), "--output-len",
                          str(args.output_len), "--rate", rate, "--seed", "0", "--no-progress",
                          "--out-dir", str(out)]
    lines = subprocess.run(words, check=True, capture_output=True, text=True).stdout
    return json.loads(lines.strip().splitlines()[-1])


def _point(target: float, res: dict) -> dict:
    """One curve point from `pdserve bench serve`'s JSON line (serve.headline)."""
    return {"target_ms": target, "itl_p50_ms": res["itl_p50_s"] * 1e3,
            "itl_p99_ms": res["itl_p99_s"] * 1e3, "ttft_p50_s": res["ttft_p50_s"],
            "output_tok_s": res["output_throughput"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--targets", type=float, nargs="+", default=[0, 150, 250, 400])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--weights", default="fp32", choices=["packed", "fp32"])
    ap.add_argument("--num-threads", type=int, default=2)
    ap.add_argument("--cpus", default="0,1")
    ap.add_argument("--rate", default="2")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--port", type=int, default=18531)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="pdserve-itl-sweep-"))
    curve = []
    for target in args.targets:
        log = work / f"up-{target:g}.log"
        proc = _up(args, target, log)
        try:
            _wait_ready(proc, log)
            _serve(args, work / "warm", 4, "inf")
            point = _point(target, _serve(args, work / f"t{target:g}", args.num_prompts,
                                          args.rate))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        curve.append(point)
        print(f"itl target {target:>5g} ms: ITL p50 {point['itl_p50_ms']:.0f} ms, p99 "
              f"{point['itl_p99_ms']:.0f} ms, TTFT p50 {point['ttft_p50_s']:.2f} s, "
              f"{point['output_tok_s']:.1f} output tok/s", flush=True)
    base = curve[0]["output_tok_s"]
    for p in curve:
        p["throughput_ratio_to_first"] = p["output_tok_s"] / base
    print(json.dumps({"curve": curve, "rate": args.rate, "model": args.model,
                      "cpu": cpu_name()}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
