"""The fused native sampling kernel (cpu_kernels/sampling.cpp) against the torch path
(sample_ops), which stays the reference: the same weights up to exp's rounding, the same zeros,
and the same token for the same uniform unless the uniform falls within rounding of a boundary
of the cumulative distribution. The narrower builds (PDSERVE_CPU_ISA=avx2|scalar) run these
tests too, in a subprocess each, so the build under test is the one loaded."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.common.attention import cpu_native
from pdserve.common.engine import sample_native, sample_ops
from pdserve.common.engine.request import Request
from pdserve.common.engine.sampler import Sampler
from pdserve.common.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
TEMPS = torch.tensor([0.25, 0.5, 0.8, 1.0, 1.0, 1.7, 4.0])
MIN_PS = torch.tensor([0.0, 0.0, 0.0, 0.01, 0.1, 0.5])
REL = 1e-6  # exp's error (native 2 ulp + torch 1 ulp) bounds each cumulative mass by this


@pytest.fixture(scope="module")
def native():
    torch.set_num_threads(2)
    module = cpu_native.load_cpu_kernels()
    assert module is not None, "the native kernels did not build"
    return module


def batch(n, v, seed):
    """logits [n, V] of mixed spread with some -inf, inv_temp and min_p [n, 1], u [n]."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.5, 2.0, 4.0, 8.0])[torch.randint(0, 4, (n, 1), generator=gen)]
    logits = torch.randn(n, v, generator=gen) * scale
    logits[torch.rand(n, v, generator=gen) < 0.1] = float("-inf")
    logits[0] = float("-inf")  # nothing allowed: both paths give token 0
    logits[1] = float("-inf")
    logits[1, v // 2] = 3.0  # one token allowed
    inv_temp = (1 / TEMPS[torch.randint(0, len(TEMPS), (n,), generator=gen)]).unsqueeze(1)
    min_p = MIN_PS[torch.randint(0, len(MIN_PS), (n,), generator=gen)].unsqueeze(1)
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    u[2], u[3] = 0.0, 1 - 2.0 ** -53  # the ends of [0, 1)
    return logits, inv_temp, min_p, u


def reference_weights(logits, inv_temp, min_p):
    return sample_ops.min_p_(sample_ops.weights(logits, inv_temp), min_p)


@pytest.mark.parametrize("n, v", [(64, 49152), (300, 1000), (300, 37), (200, 300)])
def test_same_token_as_the_torch_path(native, n, v):
    logits, inv_temp, min_p, u = batch(n, v, seed=v)
    got = native.sample_rows(logits, inv_temp, min_p, u, sample_ops.EXP_FLOOR,
                             sample_ops.FLUSH_BELOW)
    w = reference_weights(logits, inv_temp, min_p)
    want = sample_ops.sample_rows(w, u)
    assert got[0] == want[0] == 0 and got[1] == want[1] == v // 2
    # every native token's interval of the reference CDF holds the target, up to rounding (row
    # 0's reference weights are NaN: -inf - -inf)
    got, w, u = got[1:], w[1:], u[1:]
    cum = w.cumsum(dim=-1, dtype=torch.float64)  # [n, V]
    total = cum[:, -1]
    target = u * total
    hi = cum.gather(1, got.unsqueeze(1)).squeeze(1)
    lo = hi - w.gather(1, got.unsqueeze(1)).squeeze(1).double()
    slack = REL * total
    assert ((lo - slack <= target) & (target <= hi + slack)).all()
    assert (w.gather(1, got.unsqueeze(1)) > 0).all()  # never a zero weight
    assert (got != want[1:]).sum() <= n // 100  # a tie at a boundary is rare, not the rule


TOP_PS = torch.tensor([0.05, 0.3, 0.8, 0.9, 0.95, 0.99, 0.999], dtype=torch.float64)


@pytest.mark.parametrize("n, v", [(64, 49152), (300, 1000), (300, 37)])
def test_top_p_same_token_as_the_torch_path(native, n, v):
    """The fused top-p kernel draws what sample_ops.sample_top_p draws: a token inside the
    reference's top-p and min-p set, in whose interval of that set's CDF the target lies (up
    to rounding), and mostly the very same token."""
    logits, inv_temp, min_p, u = batch(n, v, seed=v + 1)
    gen = torch.Generator().manual_seed(v)
    top_p = TOP_PS[torch.randint(0, len(TOP_PS), (n,), generator=gen)]
    got = native.sample_top_p_rows(logits, inv_temp, top_p, min_p, u, sample_ops.EXP_FLOOR,
                                   sample_ops.FLUSH_BELOW)
    w = sample_ops.weights(logits, inv_temp)
    want = sample_ops.sample_top_p(w, top_p, min_p, u)
    assert got[0] == want[0] == 0 and got[1] == want[1] == v // 2
    got, w, u, top_p, min_p = got[1:], w[1:], u[1:], top_p[1:], min_p[1:]
    kept = w.masked_fill(w < torch.maximum(sample_ops.top_p_floor(w, top_p), min_p), 0.0)
    assert (kept.gather(1, got.unsqueeze(1)) > 0).all()  # inside the set, never a zero weight
    cum = kept.cumsum(dim=-1, dtype=torch.float64)
    total = cum[:, -1]
    target = u * total
    hi = cum.gather(1, got.unsqueeze(1)).squeeze(1)
    lo = hi - kept.gather(1, got.unsqueeze(1)).squeeze(1).double()
    slack = REL * w.sum(dim=-1, dtype=torch.float64)
    assert ((lo - slack <= target) & (target <= hi + slack)).all()
    assert (got != want[1:]).sum() <= n // 100


def test_top_p_keeps_the_heaviest_prefix_and_its_ties(native):
    """Weights 1, .5, .5, .25, 0, .125, .125 (total 2.5): top-p 0.5 keeps the first three (the
    tie whole), 0.85 four, 0.3 one; a grid of uniforms lands on each kept token in proportion
    to its weight, on both paths."""
    w = torch.tensor([1.0, 0.5, 0.5, 0.25, 0.0, 0.125, 0.125])
    logits = torch.where(w > 0, w.log(), float("-inf"))
    m = 1000
    u = (torch.arange(m, dtype=torch.float64) + 0.5) / m
    for p, mass in {0.3: [1, 0, 0, 0, 0, 0, 0], 0.5: [1, .5, .5, 0, 0, 0, 0],
                    0.85: [1, .5, .5, .25, 0, 0, 0]}.items():
        top_p = torch.full((m,), p, dtype=torch.float64)
        args = (logits.expand(m, 7).contiguous(), torch.ones(m, 1), top_p, torch.zeros(m, 1), u)
        got = native.sample_top_p_rows(*args, sample_ops.EXP_FLOOR, sample_ops.FLUSH_BELOW)
        assert torch.equal(got, sample_native.sample_top_p(*args, use_native=False)), p
        want = torch.tensor(mass, dtype=torch.float64) / sum(mass) * m
        assert (torch.bincount(got, minlength=7).double() - want).abs().max() <= 1, p


@pytest.mark.parametrize("candidates", [(8, 64), (256, 4096)])
def test_top_p_floor_candidates_and_histogram_agree(monkeypatch, candidates):
    """The reference finds each row's floor among its heaviest candidates where they suffice
    and by the weight histogram elsewhere: both ways give the same floor for every row."""
    monkeypatch.setattr(sample_ops, "TOP_P_CANDIDATES", candidates)
    logits, inv_temp, _, _ = batch(200, 3000, seed=5)
    w = sample_ops.weights(logits[2:], inv_temp[2:])  # rows 0 and 1 have one weight or none
    top_p = TOP_PS.repeat(30)[:len(w)]
    limit = top_p * w.sum(dim=-1, dtype=torch.float64)
    torch.testing.assert_close(sample_ops.top_p_floor(w, top_p),
                               sample_ops._histogram_floor(w, limit), rtol=0, atol=0)


def test_weights_match_and_keep_the_contract(native):
    logits, inv_temp, _, _ = batch(64, 49152, seed=1)
    got = native.sample_weights(logits, inv_temp, sample_ops.EXP_FLOOR, sample_ops.FLUSH_BELOW)
    want = sample_ops.weights(logits, inv_temp)
    assert (got[0] == 0).all() and want[0].isnan().all()  # all -inf: torch's are NaN
    got, want = got[1:], want[1:]
    assert torch.equal(got == 0, want == 0)
    both = want > 0
    assert ((got[both] - want[both]).abs() / want[both]).max() <= 3e-7  # 2 + 1 ulp
    assert (got[1:].amax(dim=-1) == 1.0).all()  # the top token weighs exactly 1
    edge = torch.tensor([[5.0, float("-inf"), 5.0 - 86.0, 5.0 - 90.0, -1e30, 4.0]])
    for t in (1.0, 1 / 3.0):
        w = native.sample_weights(edge, torch.full((1, 1), t), sample_ops.EXP_FLOOR,
                                  sample_ops.FLUSH_BELOW)
        ref = sample_ops.weights(edge, torch.full((1, 1), t))
        assert torch.equal(w == 0, ref == 0) and w[0, 0] == 1.0
        assert torch.allclose(w, ref, rtol=3e-7, atol=0)
        assert ((w == 0) | (w >= torch.finfo(torch.float32).tiny)).all()  # none subnormal


def test_nan_rows_give_token_zero_on_both_paths(native):
    """torch's weights of such a row are NaN, the kernel's 0: either way token 0."""
    logits = torch.randn(3, 500)
    logits[0, 7] = float("nan")
    logits[1, 0] = float("inf")  # inf - inf is NaN too
    u = torch.full((3,), 0.5, dtype=torch.float64)
    ones, zeros = torch.ones(3, 1), torch.zeros(3, 1)
    got = native.sample_rows(logits, ones, zeros, u, sample_ops.EXP_FLOOR,
                             sample_ops.FLUSH_BELOW)
    want = sample_ops.sample_rows(sample_ops.weights(logits, ones), u)
    assert got[:2].tolist() == want[:2].tolist() == [0, 0]


def test_argmax_is_torchs(native):
    """Greedy rows: the native argmax gives torch.argmax's index, ties to the first max, a
    row's first NaN, 0 for an all -inf row, strided rows and a tail past the vector width."""
    gen = torch.Generator().manual_seed(5)
    for v in (1, 7, 16, 33, 3000, 49_153):
        logits = torch.randn(6, v, generator=gen) * 4
        logits[1] = float("-inf")
        if v > 3:
            logits[2, v - 1] = logits[2, 2] = logits[2].max() + 1  # a tie: the first wins
            logits[3, v // 2] = float("nan")
            logits[3, v - 1] = float("nan")
            logits[4, v - 1] = float("inf")
        want = torch.argmax(logits, dim=-1)
        assert torch.equal(native.argmax_rows(logits), want), v
        assert torch.equal(sample_native.argmax(logits), want)
        assert torch.equal(sample_ops.argmax(logits), want)
    wide = torch.cat([logits, torch.full((6, 11), 1e9)], dim=1)[:, :v]  # row stride v + 11
    assert torch.equal(native.argmax_rows(wide), torch.argmax(logits, dim=-1))
    with pytest.raises(ValueError, match="logits must be"):
        native.argmax_rows(logits.double())


def test_strided_rows_and_bad_arguments(native):
    logits, inv_temp, min_p, u = batch(8, 1000, seed=3)
    wide = torch.cat([logits, torch.zeros(8, 24)], dim=1)[:, :1000]  # row stride 1024
    args = (sample_ops.EXP_FLOOR, sample_ops.FLUSH_BELOW)
    assert torch.equal(native.sample_rows(wide, inv_temp, min_p, u, *args),
                       native.sample_rows(logits, inv_temp, min_p, u, *args))
    with pytest.raises(ValueError, match="u must be"):
        native.sample_rows(logits, inv_temp, min_p, u.float(), *args)
    with pytest.raises(ValueError, match="logits must be"):
        native.sample_rows(logits.t(), inv_temp, min_p, u, *args)
    with pytest.raises(ValueError, match="inv_temp must be"):
        native.sample_weights(logits, inv_temp[:4], *args)


def requests(n, seed):
    kinds = [dict(temperature=1.0), dict(temperature=0.7, min_p=0.05), dict(temperature=0.0),
             dict(temperature=0.9, top_p=0.9), dict(temperature=1.3, top_k=20, min_p=0.01)]
    return [Request(f"r{i}", [1], SamplingParams(seed=seed + i, max_tokens=8,
                                                 **kinds[i % len(kinds)]), 8)
            for i in range(n)]


def test_sampler_gives_the_torch_paths_tokens(native):
    """Greedy, plain, min-p and filtered rows in one batch: the engine's sampler (native
    where it runs) and the torch-only sampler agree, row for row."""
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(40, 3000, generator=gen) * 3
    reqs = requests(40, seed=100)
    assert Sampler(3000)(logits, reqs).token_ids == \
        Sampler(3000, use_native=False)(logits, reqs).token_ids
    plain = [r for r in reqs if r.params.top_p == 1 and r.params.top_k <= 0]
    rows = torch.tensor([reqs.index(r) for r in plain])
    assert Sampler(3000)(logits[rows], plain).token_ids == \
        Sampler(3000, use_native=False)(logits[rows], plain).token_ids


def test_no_native_takes_the_torch_path(monkeypatch):
    logits, inv_temp, min_p, u = batch(16, 1000, seed=4)
    monkeypatch.setenv("PDSERVE_NO_NATIVE", "1")
    assert sample_native.kernels_for(logits) is None
    want = sample_ops.sample_rows(reference_weights(logits, inv_temp, min_p), u)
    assert torch.equal(sample_native.sample_plain(logits, inv_temp, min_p, u), want)
    torch.testing.assert_close(sample_native.weights(logits, inv_temp),  # bit for bit
                               sample_ops.weights(logits, inv_temp), rtol=0, atol=0,
                               equal_nan=True)


@pytest.mark.parametrize("isa", ["avx2", "scalar"])
def test_narrow_build_samples_the_same(isa):
    if isa == "avx2" and not {"avx2", "fma"} <= cpu_native._cpu_flags():
        pytest.skip("this CPU has no AVX2")
    env = dict(os.environ, PDSERVE_CPU_ISA=isa, OMP_NUM_THREADS="2")
    probe = subprocess.run(
        [sys.executable, "-c", "from pdserve.common.attention.cpu_native import "
         "load_cpu_kernels as load; print(load().simd)"],
        env=env, capture_output=True, text=True, timeout=900)
    assert probe.stdout.split() == [isa], probe.stderr[-2000:]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-k", "not narrow", "tests/unit/test_sample_native.py"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:]
    assert " passed" in run.stdout.splitlines()[-1]
