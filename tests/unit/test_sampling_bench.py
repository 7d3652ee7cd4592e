"""`pdserve bench sampler` and `bench offline --temperature` run and report what they claim."""

import json
import subprocess
import sys

import torch

from pdserve.bench.sampler import CASES, old_sample
from pdserve.common.engine.request import Request
from pdserve.common.sampling_params import SamplingParams


def test_bench_sampler_prints_every_case_and_one_json_line(capsys):
    from pdserve.bench.sampler import main
    assert main(["--logits", "synthetic", "--rows", "4", "--vocab", "700", "--reps", "2",
                 "--num-threads", "1"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (res["rows"], res["vocab"]) == (4, 700) and set(res["cases"]) == set(CASES)
    for case in res["cases"].values():
        assert case["old_ms"] > 0 and case["ratio"] == case["old_ms"] / case["new_ms"]
        assert case["native_speedup"] == case["torch_ms"] / case["new_ms"]
    assert res["native"] in ("avx512", "avx2", "scalar")
    torch.set_num_threads(1)


def test_the_old_sampler_peer_is_a_sampler():
    """The peer the bench times still samples the filtered distribution (top-k=2 here)."""
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0]]).expand(200, 4)
    reqs = [Request("r", [1], SamplingParams(seed=i, top_k=2), 4) for i in range(200)]
    gens = [torch.Generator().manual_seed(i) for i in range(200)]
    got = set(old_sample(logits, reqs, gens).tolist())
    assert got == {1, 2}


def test_bench_offline_samples_at_a_temperature():
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "bench", "offline", "--model", "tiny",
         "--num-prompts", "2", "--input-len", "16", "--output-len", "4", "--num-threads", "1",
         "--temperature", "1.0", "--skip-hf"],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["temperature"] == 1.0 and res["pdserve_output_tok_s"] > 0


def test_transformers_peer_samples_at_the_temperature():
    from pdserve.bench.hf_peer import hf_generate, hf_model_from_loaded
    from pdserve.common.models.registry import load_model
    hf = hf_model_from_loaded(load_model("tiny"))
    prompts = [[5, 6, 7], [8, 9]]
    greedy = hf_generate(hf, prompts, 6)
    torch.manual_seed(0)
    sampled = [hf_generate(hf, prompts, 6, temperature=5.0) for _ in range(3)]
    assert all(s.shape == greedy.shape == (2, 6) for s in sampled)
    assert any(not torch.equal(s, greedy) for s in sampled)  # tiny's flat logits at T=5
