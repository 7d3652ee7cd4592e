"""Random sampling: the stream is keyed by (seed, position) only, and the batched inverse-CDF
sampler draws exactly the filtered distribution (checked on a grid of uniforms against the
reference filter, and statistically against torch.multinomial)."""

import pytest
import torch

from pdserve.common.engine import sample_ops
from pdserve.common.random_stream import derive_seed, stream_key, uniform
from pdserve.common.engine.request import Request
from pdserve.common.engine.sampler import Sampler
from pdserve.common.sampling_params import SamplingParams


def test_stream_is_splitmix64():
    # SplitMix64 from state 0 outputs 0xe220a8397b1dcdaf, 0x6e789e6aa1b965f4, ... (the
    # published reference values): stream_key(seed) is that first output for seed 0, and a
    # stream from state `key` gives position k the top 53 bits of its (k+1)-th output.
    assert stream_key(0) == 0xE220A8397B1DCDAF
    assert uniform(0, 0) == (0xE220A8397B1DCDAF >> 11) * 2.0 ** -53
    assert uniform(0, 1) == (0x6E789E6AA1B965F4 >> 11) * 2.0 ** -53
    key = stream_key(1234)
    us = [uniform(key, k) for k in range(1000)]
    assert all(0 <= u < 1 for u in us) and len(set(us)) == 1000
    assert abs(sum(us) / 1000 - 0.5) < 0.05


def test_derived_choice_seeds():
    assert derive_seed(7, 0) == 7
    seeds = [derive_seed(7, i) for i in range(1, 200)]
    assert len(set(seeds)) == 199 and all(0 <= s < 2 ** 63 for s in seeds)
    assert derive_seed(7, 1) != 8 and derive_seed(8, 0) != derive_seed(7, 1)


def reference_probs(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """The filter as the old sampler applied it (sort-based), as probabilities [V] fp64."""
    x = logits.double() / temperature
    v = x.shape[-1]
    if 0 < top_k < v:
        x = x.masked_fill(x < x.topk(top_k).values[-1], float("-inf"))
    if top_p < 1:
        s, idx = x.sort(descending=True)
        p = s.softmax(-1)
        drop = (p.cumsum(-1) - p) >= top_p
        x = x.scatter(0, idx, s.masked_fill(drop, float("-inf")))
    if min_p > 0:
        p = x.softmax(-1)
        x = x.masked_fill(p < p.max() * min_p, float("-inf"))
    return x.softmax(-1)


FILTERS = [dict(), dict(top_k=5), dict(top_p=0.6), dict(top_p=0.97), dict(min_p=0.05),
           dict(top_k=40, top_p=0.8, min_p=0.02), dict(top_k=700)]


@pytest.mark.parametrize("kw", FILTERS, ids=[str(k) for k in FILTERS])
@pytest.mark.parametrize("vocab, scale", [(600, 3.0), (600, 0.3), (37, 2.0)])
def test_grid_of_uniforms_gives_the_exact_distribution(kw, vocab, scale):
    """Inverse CDF turns M evenly spaced uniforms into each token (M * p_i) +- 1 times: the
    frequencies equal the reference filter's probabilities to 1/M. scale 0.3 makes a flat
    row, where top-p needs more than TOP_P_CANDIDATES[0] tokens (the whole-row fallback)."""
    check_grid(kw, vocab, scale)


@pytest.mark.parametrize("kw", [dict(top_p=0.01), dict(top_p=0.15), dict(top_p=0.3),
                                dict(top_p=0.6), dict(top_p=0.97), dict(top_p=0.9, min_p=0.5),
                                dict(top_k=500, top_p=0.9)], ids=str)
def test_top_p_escalates_to_more_candidates_then_the_histogram(kw, monkeypatch):
    """With candidate counts 8 then 128, a flat row's top-p set fits in the first (p=0.01),
    the second (0.15) or neither (the histogram path); each gives the exact distribution."""
    monkeypatch.setattr(sample_ops, "TOP_P_CANDIDATES", (8, 128))
    check_grid(kw, 600, 0.3)


def test_histogram_top_p_keeps_the_heaviest_prefix_and_its_ties():
    w = torch.tensor([[1.0, 0.5, 0.5, 0.25, 0.0, 0.125, 0.125]])  # total 2.5
    expect = {0.3: [1, 0, 0, 0, 0, 0, 0], 0.5: [1, 1, 1, 0, 0, 0, 0],  # the tie kept whole
              0.85: [1, 1, 1, 1, 0, 0, 0], 0.99: [1, 1, 1, 1, 0, 1, 1]}
    for p, keep in expect.items():
        out = sample_ops.top_p_keep_(w.clone(), torch.tensor([p], dtype=torch.float64))
        assert ((out > 0).int()[0].tolist()) == keep, p


def check_grid(kw, vocab, scale, m=8000, temperature=0.8):
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(vocab)) * scale
    ref = reference_probs(logits, temperature, **kw)
    u = (torch.arange(m, dtype=torch.float64) + 0.5) / m
    w = sample_ops.weights(logits.expand(m, vocab), torch.full((m, 1), 1 / temperature))
    top_k = torch.full((m,), kw.get("top_k", vocab)).clamp(max=vocab)
    top_p = torch.full((m,), kw.get("top_p", 1.0), dtype=torch.float64)
    min_p = torch.full((m, 1), kw.get("min_p", 0.0))
    if kw.get("top_k", vocab) < vocab or kw.get("top_p", 1.0) < 1:
        tokens = sample_ops.sample_filtered(w, top_k, top_p, min_p, u)
    else:
        tokens = sample_ops.sample_rows(sample_ops.min_p_(w, min_p), u)
    freq = torch.bincount(tokens, minlength=vocab).double() / m
    assert (freq[ref == 0] == 0).all()
    assert (freq - ref).abs().max() <= 2.0 / m + 1e-6


def test_weights_top_is_one_and_nothing_is_subnormal():
    logits = torch.tensor([[5.0, float("-inf"), 5.0 - 86.0, 5.0 - 90.0, -1e30, 4.0]])
    w = sample_ops.weights(logits, torch.ones(1, 1))
    assert w[0, 0] == 1.0 and w[0, 1] == w[0, 3] == w[0, 4] == 0.0
    assert w[0, 2] > 0 and w[0, 5] == pytest.approx(torch.e ** -1)
    hot = sample_ops.weights(logits, torch.full((1, 1), 1 / 3.0))
    assert hot[0, 0] == 1.0 and hot[0, 3] == pytest.approx(torch.e ** (-95 / 3), rel=1e-4)
    assert ((w == 0) | (w >= torch.finfo(torch.float32).tiny)).all()


@pytest.mark.parametrize("vocab", [7, 256, 1000, 49152])
def test_blocked_argmax_is_torch_argmax(vocab):
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randint(-3, 4, (50, vocab), generator=gen).float()  # many ties
    x[0] = float("-inf")
    x[1, -1] = 100.0  # in the padded tail block
    x[2] = torch.randn(vocab, generator=gen)
    assert torch.equal(sample_ops.argmax(x), x.argmax(dim=-1))


def test_zero_weights_are_never_picked_even_at_the_edges():
    w = torch.tensor([[0.0, 1.0, 2.0, 0.0, 0.0]]).expand(6, 5)
    targets = torch.tensor([0.0, 0.999, 1.0, 2.999, 3.0, 3.5], dtype=torch.float64)
    j, rest = sample_ops.pick(w, targets)
    assert j.tolist() == [1, 1, 2, 2, 2, 2] and rest[2].item() == 0.0
    row = torch.zeros(1, 3 * sample_ops.BLOCK + 5)  # mass in the first block only
    row[0, 3] = row[0, 100] = 1.0
    top = 1 - 2.0 ** -53
    got = [sample_ops.sample_rows(row, torch.tensor([u], dtype=torch.float64)).item()
           for u in (0.0, 0.4999, 0.5, top)]
    assert got == [3, 3, 100, 100]


def test_same_distribution_as_torch_multinomial():
    """Seeds 0..N-1 at one position, and N multinomial draws: both pass a chi-square test
    against the distribution, and against each other (fixed seeds: deterministic)."""
    probs = torch.tensor([0.30, 0.20, 0.15, 0.12, 0.10, 0.07, 0.04, 0.015, 0.005])
    n, v = 20000, len(probs)
    logits = probs.log().expand(n, v).contiguous()
    reqs = [Request(f"r{i}", [1], SamplingParams(temperature=1.0, seed=i), 4)
            for i in range(n)]
    ours = torch.bincount(torch.tensor(Sampler(v)(logits, reqs).token_ids), minlength=v)
    theirs = torch.bincount(torch.multinomial(probs, n, replacement=True,
                                              generator=torch.Generator().manual_seed(0)),
                            minlength=v)
    expected = probs.double() * n
    critical = 37.0  # chi-square, 8 degrees of freedom, p = 1e-5
    assert ((ours - expected) ** 2 / expected).sum() < critical
    assert ((theirs - expected) ** 2 / expected).sum() < critical
    pooled = (ours + theirs).double() / 2
    assert (((ours - pooled) ** 2 + (theirs - pooled) ** 2) / pooled).sum() < critical
    # one seed along its positions: the same distribution again
    along = [Request("r", [1], SamplingParams(temperature=1.0, seed=99), n) for _ in range(1)]
    toks = []
    for _ in range(2000):
        toks += Sampler(v)(logits[:1], along).token_ids
        along[0].append_token(toks[-1])
    counts = torch.bincount(torch.tensor(toks), minlength=v)
    assert ((counts - probs.double() * 2000) ** 2 / (probs.double() * 2000)).sum() < critical


def _mk(seed, outputs=(), **kw):
    r = Request("x", [3, 4], SamplingParams(seed=seed, max_tokens=64, **kw), 64)
    for t in outputs:
        r.append_token(t)
    return r


def test_row_token_does_not_depend_on_the_batch():
    """One request's row gives the same token alone, at any row of any batch, next to greedy,
    filtered and other seeded rows."""
    v = 1000
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(40, v, generator=gen) * 2
    target = logits[7].clone()
    for kw in (dict(temperature=1.0), dict(temperature=0.7, top_p=0.9),
               dict(temperature=1.3, top_k=50, min_p=0.01)):
        alone = Sampler(v)(target.unsqueeze(0), [_mk(42, [1, 2, 3], **kw)]).token_ids[0]
        others = [_mk(i, **o) for i, o in zip(range(39), [dict(temperature=0.0),
                  dict(temperature=1.0), dict(temperature=0.5, top_k=3)] * 13)]
        for row in (0, 17, 39):
            reqs = others[:row] + [_mk(42, [1, 2, 3], **kw)] + others[row:]
            batch = torch.cat([logits[:row], target.unsqueeze(0), logits[row:39]])
            assert Sampler(v)(batch, reqs).token_ids[row] == alone, (kw, row)


def test_the_stream_depends_on_seed_and_position():
    v = 1000
    logits = torch.zeros(1, v)  # uniform: every uniform gives a different token
    tok = [Sampler(v)(logits, [_mk(1, [0] * k, temperature=1.0)]).token_ids[0] for k in range(6)]
    assert len(set(tok)) > 1  # positions differ
    again = [Sampler(v)(logits, [_mk(1, [9] * k, temperature=1.0)]).token_ids[0]
             for k in range(6)]
    assert again == tok  # the tokens themselves do not matter, only how many
    other = [Sampler(v)(logits, [_mk(2, [0] * k, temperature=1.0)]).token_ids[0]
             for k in range(6)]
    assert other != tok
