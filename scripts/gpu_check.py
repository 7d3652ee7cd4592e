"""GPU check for the Triton attention kernels; run through scripts/gpu_check.sh (make gpu-check).

1. the kernel tests on CUDA (compiled, TRITON_INTERPRET unset);
2. greedy generation: CPU + torch backend vs CUDA + triton backend (and CUDA + torch, which
   tells a kernel bug from fp32 noise if the first two differ); SmolLM2 when installed, else the
   tiny model;
3. paged decode attention vs torch SDPA on dense, pre-gathered K/V (the ratio), and against the
   H200's 4.8 TB/s HBM bandwidth.

Every step records a row; one table is printed at the end whatever failed. Exit status 1 if
any row is FAIL.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PEAK_BANDWIDTH = 4.8e12  # H200 HBM3e, bytes/s (datasheet)
PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Once upon a time, in a small village by the sea, there lived an old fisherman who",
           "List three colours of the rainbow:"]


@dataclass
class Row:
    check: str
    status: str  # PASS | FAIL | SKIP | INFO
    detail: str


def kernel_tests(timeout_s: float) -> Row:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "cuda",
           "tests/unit/test_triton_kernels.py"]
    if importlib.util.find_spec("xdist"):  # compiling ~80 kernel variants: spread over cores
        cmd += ["-n", "8"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return Row("kernel tests (cuda)", "FAIL", f"timed out after {timeout_s:.0f} s")
    lines = [ln for ln in proc.stdout.splitlines() if re.search(r"passed|failed|error", ln)]
    summary = lines[-1].strip("= ") if lines else proc.stderr.strip()[-200:]
    if proc.returncode != 0:
        print(proc.stdout[-6000:], proc.stderr[-2000:], sep="\n")
    return Row("kernel tests (cuda)", "PASS" if proc.returncode == 0 else "FAIL", summary)


def greedy(model: str, device: str, backend: str, max_tokens: int) -> list[list[int]]:
    from pdserve.common.config import CacheConfig, EngineConfig
    from pdserve.common.engine.llm import LLM
    from pdserve.common.sampling_params import SamplingParams

    llm = LLM(EngineConfig(model=model, device=device, attention_backend=backend,
                           cache=CacheConfig(num_blocks=256, block_size=16)))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.token_ids for o in llm.generate(PROMPTS, params)]


def pick_model(requested: str | None) -> str:
    if requested:
        return requested
    from pdserve.common.models.registry import resolve_model
    try:
        resolve_model("smollm2")
        return "smollm2"
    except (ValueError, ImportError):
        return "tiny"


def compare(a: list[list[int]], b: list[list[int]]) -> tuple[int, str]:
    """(prompts identical, where the others first differ)."""
    same, where = 0, []
    for i, (x, y) in enumerate(zip(a, b)):
        if x == y:
            same += 1
        else:
            first = next(j for j, (u, v) in enumerate(zip(x, y)) if u != v)
            where.append(f"p{i}@{first}")
    return same, ",".join(where)


def greedy_check(model: str, max_tokens: int) -> list[Row]:
    cpu = greedy(model, "cpu", "torch", max_tokens)
    gpu_triton = greedy(model, "cuda", "triton", max_tokens)
    gpu_torch = greedy(model, "cuda", "torch", max_tokens)
    n = len(PROMPTS)
    same, where = compare(cpu, gpu_triton)
    rows = [Row(f"greedy {model}: cpu/torch vs cuda/triton",
                "PASS" if same == n else "FAIL",
                f"{same}/{n} prompts identical over {max_tokens} tokens"
                + (f"; first differ at {where}" if where else ""))]
    same_t, where_t = compare(gpu_torch, gpu_triton)
    rows.append(Row(f"greedy {model}: cuda/torch vs cuda/triton",
                    "PASS" if same_t == n else "FAIL",
                    f"{same_t}/{n} identical" + (f"; differ at {where_t}" if where_t else "")))
    return rows


def make_paged(batch: int, seq_len: int, dtype, heads=32, kv_heads=8, head_dim=128,
               block_size=16):
    """Random paged cache with scattered pages, plus the same K/V gathered dense."""
    import torch
    nb = -(-seq_len // block_size)
    cache = torch.randn(2, batch * nb, block_size, kv_heads, head_dim, device="cuda", dtype=dtype)
    tables = torch.randperm(batch * nb, device="cuda").view(batch, nb).int()  # [B, nb]
    dense = cache[:, tables.long()].flatten(2, 3)[:, :, :seq_len]  # [2, B, L, kvh, d]
    k, v = (dense[i].transpose(1, 2).contiguous() for i in (0, 1))  # [B, kvh, L, d]
    q = torch.randn(batch, heads, head_dim, device="cuda", dtype=dtype)
    seq_lens = torch.full((batch,), seq_len, device="cuda", dtype=torch.int32)
    return q, cache, tables, seq_lens, k, v


def bench_decode(batch: int, seq_len: int, dtype) -> Row:
    import torch
    import torch.nn.functional as F
    from triton.testing import do_bench

    from pdserve.common.attention.triton_backend import choose_num_splits
    from pdserve.common.attention.triton_kernels import decode_attention

    q, cache, tables, seq_lens, k, v = make_paged(batch, seq_len, dtype)
    heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    scale = head_dim ** -0.5
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = choose_num_splits(batch, kv_heads, seq_len, sms)
    out = torch.empty_like(q)

    def paged(n=splits, block_n=32):
        return decode_attention(q, cache, tables, seq_lens, scale, num_splits=n, out=out,
                                block_n=block_n)

    # dense baseline: one decode token per request, the GQA group as SDPA's query length
    qg = q.view(batch, kv_heads, heads // kv_heads, head_dim)  # [B, kvh, G, d]

    def dense():
        return F.scaled_dot_product_attention(qg, k, v, scale=scale)

    err = (paged().float() - dense().reshape(batch, heads, head_dim).float()).abs().max().item()
    t_paged = do_bench(paged, rep=50, return_mode="median") * 1e-3
    t_one = do_bench(lambda: paged(1), rep=50, return_mode="median") * 1e-3
    t_bn64 = do_bench(lambda: paged(block_n=64), rep=50, return_mode="median") * 1e-3
    t_dense = do_bench(dense, rep=50, return_mode="median") * 1e-3
    nbytes = (k.numel() + v.numel() + 2 * q.numel()) * k.element_size()
    gbs = nbytes / t_paged
    name = f"decode B={batch} L={seq_len} {str(dtype)[6:]}"
    detail = (f"triton {t_paged * 1e6:.0f}us (splits={splits}; 1 split {t_one * 1e6:.0f}us; "
              f"block_n 64 {t_bn64 * 1e6:.0f}us) | "
              f"sdpa dense {t_dense * 1e6:.0f}us | sdpa/triton {t_dense / t_paged:.2f}x | "
              f"{gbs / 1e9:.0f} GB/s = {100 * gbs / PEAK_BANDWIDTH:.0f}% of 4.8 TB/s | "
              f"max err {err:.1e}")
    del q, cache, k, v
    torch.cuda.empty_cache()
    return Row(name, "FAIL" if err > 5e-2 else "INFO", detail)


def bench_rows() -> list[Row]:
    import torch
    configs = [(1, 131072, torch.bfloat16), (8, 32768, torch.bfloat16),
               (64, 4096, torch.bfloat16), (256, 1024, torch.bfloat16),
               (64, 4096, torch.float32)]
    return [bench_decode(b, n, dt) for b, n, dt in configs]


def guarded(name: str, fn, deadline: float) -> list[Row]:
    """Run one step; an exception or an exhausted budget becomes a row, not an abort."""
    if time.monotonic() > deadline:
        return [Row(name, "SKIP", "out of time budget")]
    try:
        out = fn()
        return out if isinstance(out, list) else [out]
    except Exception as e:  # noqa: BLE001 - report every failure in the table
        traceback.print_exc()
        return [Row(name, "FAIL", f"{type(e).__name__}: {str(e)[:150]}")]


def print_table(rows: list[Row]) -> None:
    w = max(len(r.check) for r in rows + [Row("check", "", "")])
    print("\n" + "=" * 30 + " gpu-check summary " + "=" * 30)
    print(f"{'check':<{w}}  status  detail")
    for r in rows:
        print(f"{r.check:<{w}}  {r.status:<6}  {r.detail}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model",
                    help="greedy-check model (default: smollm2 if installed, else tiny)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--budget-s", type=float, default=440, help="stop starting steps after this")
    args = ap.parse_args()
    import torch
    if not torch.cuda.is_available():
        print("gpu-check: FAIL: torch sees no CUDA device")
        return 1
    start = time.monotonic()
    deadline = start + args.budget_s
    rows = [Row("device", "INFO", f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
                f"triton {__import__('triton').__version__}")]
    rows += guarded("kernel tests (cuda)", lambda: kernel_tests(max(deadline - time.monotonic()
                                                                     - 150, 60)), deadline)
    model = pick_model(args.model)
    rows += guarded(f"greedy {model}", lambda: greedy_check(model, args.max_tokens), deadline)
    rows += guarded("decode benchmark", bench_rows, deadline)
    rows.append(Row("total time", "INFO", f"{time.monotonic() - start:.0f} s"))
    print_table(rows)
    return 1 if any(r.status == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
