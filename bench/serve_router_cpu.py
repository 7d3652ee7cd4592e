"""The router's CPU per streamed token on the OpenAI HTTP path, apart from any engine.

Three processes: an instant fake instance (bench/router_fakes.py, `--tokens` per request), a
router over it, and this one, the client: `--rounds` rounds of `--streams` concurrent streamed
requests (/v1/completions, or /v1/chat/completions with `--chat`), token-id prompts,
`--tokens` tokens each. The router's CPU (user + system, from /proc) over each round, divided
by the tokens the client received, is what the router costs per token; the served stack
spends it beside the forward on the same cores. `--profile FILE` runs the router under
cProfile and writes its stats there at the end (read with `python -m pstats FILE`).

    python -m pdserve.bench.serve_router_cpu [--streams 64] [--tokens 128] [--rounds 3]

Prints each round, then one JSON line (cpu_ms_per_token: the median over rounds).
client_cpu_ms_per_token is the client's own CPU per token (this process): httpx by default,
`pdserve bench serve`'s streaming client with `--bench-client` (what a served benchmark's
client spends beside the forward).

`--workers N` runs the router as `pdserve serve router --workers N` instead (N router
processes on one port, services/router/workers.py; N = 1: the plain CLI router): the CPU is
then summed over its processes, and each round's tokens/s shows whether more than one core
was used.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import AsyncExitStack

CHILD = [sys.executable, "-m", "pdserve.bench.serve_router_cpu"]


async def _serve_fake(tokens: int, model: str) -> None:
    from pdserve.bench.router_fakes import FakeInstance

    fake = await FakeInstance.start(tokens=tokens, model=model)
    print(json.dumps({"address": fake.address}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await fake.stop()


async def _serve_router(address: str) -> None:
    from pdserve.services.router.api.tokenizer_loader import load_tokenizer
    from pdserve.services.router.config import RouterConfig
    from pdserve.services.router.server import start_router

    router = await start_router(RouterConfig(model="fake", backends=(address,), port=0,
                                             grpc_port=0), tokenizer=load_tokenizer("tiny"))
    print(json.dumps({"port": router.http_port, "pid": os.getpid()}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await router.stop()


def _router_main(address: str, profile: str) -> None:
    if not profile:
        asyncio.run(_serve_router(address))
        return
    import cProfile

    prof = cProfile.Profile()
    prof.enable()
    try:
        asyncio.run(_serve_router(address))
    finally:
        prof.disable()
        prof.dump_stats(profile)


def _cpu_s(pid: int) -> float:
    """CPU of pid and its live children (a --workers supervisor's workers)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return own + sum(_cpu_s(int(c)) for c in f.read().split())


def _start_cli_router(address: str, workers: int) -> tuple[subprocess.Popen, dict]:
    """`serve router --workers N` over the fake; returns once /health answers."""
    import httpx

    from pdserve.services.launcher import free_port

    port = free_port("127.0.0.1")
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.services.cli_serve", "serve",
                             "router", "--model", "tiny", "--backends", address, "--port",
                             str(port), "--grpc-port", "-1", "--workers", str(workers)],
                            stdin=subprocess.DEVNULL)
    for _ in range(1200):
        if proc.poll() is not None:
            raise RuntimeError(f"the router exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                time.sleep(2.0 * workers)  # the other workers finish their start
                return proc, {"port": port, "pid": proc.pid}
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.terminate()
    raise RuntimeError("the router did not answer /health")


async def _stream(http, chat: bool, tokens: int, i: int, model: str) -> int:
    """One streamed request; the tokens' worth of text events it received."""
    prompt = [100 + i, 200, 300, 400]
    if chat:
        url, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}
    else:
        url, body = "/v1/completions", {"prompt": prompt}
    body.update(model=model, max_tokens=tokens, stream=True, ignore_eos=True)
    events = 0
    async with http.stream("POST", url, json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                events += '"finish_reason":null' in line
    return events


async def _bench_stream(client, chat: bool, tokens: int, i: int) -> int:
    """One streamed request through `pdserve bench serve`'s client; the token arrivals it
    counted (every token: its finish chunk carries the last token's text)."""
    from pdserve.bench.record import StreamTrace
    from pdserve.bench.request import BenchRequest

    if chat:
        req, messages = BenchRequest("r", tokens, messages=(("user", "hi"),)), [
            {"role": "user", "content": "hi"}]
    else:
        req, messages = BenchRequest("r", tokens, prompt_ids=(100 + i, 200, 300, 400)), None
    trace = StreamTrace(sent_t=time.perf_counter())
    await client.send(req, messages, trace)
    if trace.error:
        raise RuntimeError(trace.error)
    return len(trace.arrivals)


async def _streamer(port: int, model: str, bench_client: bool, stack: AsyncExitStack):
    """stream(chat, tokens, i) -> events, through httpx or the bench's client."""
    base = f"http://127.0.0.1:{port}"
    if bench_client:
        from pdserve.bench.client_http import HttpClient
        from pdserve.bench.target import TargetConfig

        client = HttpClient(TargetConfig(base_url=base, model_name=model, timeout_s=120))
        await client.start()
        return lambda chat, tokens, i: _bench_stream(client, chat, tokens, i)
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    http = await stack.enter_async_context(
        httpx.AsyncClient(base_url=base, limits=limits, timeout=120))
    return lambda chat, tokens, i: _stream(http, chat, tokens, i, model)


async def _rounds(port: int, pid: int, args) -> list[dict]:
    out = []
    async with AsyncExitStack() as stack:
        model = "tiny" if args.workers else "fake"  # the CLI router serves --model tiny
        stream = await _streamer(port, model, args.bench_client, stack)
        await stream(args.chat, 4, 0)  # warm-up: connections, first-call imports
        for r in range(args.rounds):
            cpu, own, t = _cpu_s(pid), time.process_time(), time.perf_counter()
            events = await asyncio.gather(*(stream(args.chat, args.tokens, i)
                                            for i in range(args.streams)))
            wall, own = time.perf_counter() - t, time.process_time() - own
            cpu = _cpu_s(pid) - cpu
            tokens = args.streams * args.tokens
            out.append({"round": r, "tokens": tokens, "events": sum(events),
                        "router_cpu_s": cpu, "wall_s": wall,
                        "cpu_ms_per_token": cpu * 1e3 / tokens,
                        "client_cpu_ms_per_token": own * 1e3 / tokens})
            out[-1]["tokens_per_s"] = tokens / wall
            print(f"round {r}: {tokens} tokens ({sum(events)} text events) in {wall:.2f} s "
                  f"({tokens / wall:.0f} tokens/s), router CPU {cpu:.2f} s = "
                  f"{cpu * 1e3 / tokens:.3f} ms/token, client CPU "
                  f"{own * 1e3 / tokens:.3f} ms/token", flush=True)
    return out


def _start(cmd: list[str]) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line:
        proc.wait(30)
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}")
    return proc, json.loads(line)


def run(args) -> int:
    fake, info = _start(CHILD + ["--fake", str(args.tokens), "--fake-model",
                                 "tiny" if args.workers else "fake"])
    router = None
    try:
        if args.workers:
            router, rinfo = _start_cli_router(info["address"], args.workers)
        else:
            router, rinfo = _start(CHILD + ["--router", info["address"]]
                                   + (["--profile", args.profile] if args.profile else []))
        rounds = asyncio.run(_rounds(rinfo["port"], rinfo["pid"], args))
    finally:
        if router is not None and args.workers:
            router.terminate()
            router.wait(60)
        for p in (fake,) if args.workers else (router, fake):
            if p is not None:
                p.stdin.close()
                p.wait(60)
    line = {"bench": "serve_router_cpu", "endpoint": "chat" if args.chat else "completions",
            "streams": args.streams, "tokens": args.tokens, "workers": args.workers,
            "rounds": rounds,
            "cpu_ms_per_token": statistics.median(r["cpu_ms_per_token"] for r in rounds),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rounds),
            "client": "bench" if args.bench_client else "httpx",
            "client_cpu_ms_per_token": statistics.median(r["client_cpu_ms_per_token"]
                                                         for r in rounds)}
    print(json.dumps(line))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.serve_router_cpu")
    p.add_argument("--streams", type=int, default=64, help="concurrent streamed requests")
    p.add_argument("--tokens", type=int, default=128, help="tokens per request")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--chat", action="store_true", help="/v1/chat/completions")
    p.add_argument("--bench-client", action="store_true",
                   help="stream through `pdserve bench serve`'s client (bench/http_stream.py) "
                        "instead of httpx; client_cpu_ms_per_token is this process's CPU")
    p.add_argument("--profile", default="", help="cProfile the router into this file")
    p.add_argument("--workers", type=int, default=0,
                   help="0: the router in its own process as before; N >= 1: `pdserve serve "
                        "router --workers N`")
    p.add_argument("--fake", type=int, help=argparse.SUPPRESS)  # child: the fake instance
    p.add_argument("--fake-model", default="fake", help=argparse.SUPPRESS)
    p.add_argument("--router", help=argparse.SUPPRESS)  # child: the router
    args = p.parse_args(argv)
    if args.fake is not None:
        asyncio.run(_serve_fake(args.fake, args.fake_model))
        return 0
    if args.router:
        _router_main(args.router, args.profile)
        return 0
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
