"""Exact batched sampling by inverse CDF: one uniform per row, no noise over the vocabulary.

Why inverse CDF and not Gumbel-max / the exponential race: the race needs a fresh random
number per vocabulary entry per row per step (64 x 49,152 here), and counter-based noise
(a hash per element, keyed by seed and position) costs several integer passes over that
matrix. Inverse CDF needs one uniform per row; its tensor work is what any exact sampler
does anyway (max, exp), plus one blocked sum. It is the same distribution: token i is drawn
with probability w_i / sum(w), up to float64 rounding of the fp32 weights.

Weights `w` are exp((logit - max) / T): the probabilities scaled so the top token weighs
exactly 1, which makes min-p a plain threshold (w_i >= min_p) and needs no normalization.
Drawing from a row of V weights is two searches of 256-wide float64 prefix sums: pick the
block whose cumulative mass covers u * total, then the token inside it, so no float64 pass
over the whole row and no precision loss from one long fp32 cumulative sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 256  # tokens per block of the two-level search
TOP_P_CANDIDATES = (256, 4096)  # top-p without top-k looks at this many tokens, in turn
KEY_STEPS = 32  # weight buckets per factor of 2 in the top-p histogram
NUM_KEYS = 127 * KEY_STEPS  # buckets of weights in [1.7e-38 (2**-125.5), 1]


EXP_FLOOR = -87.0  # exp(-87) = 1.65e-38, just above fp32's smallest normal (1.18e-38)
FLUSH_BELOW = 1.7e-38  # weights under this (relative to the top token's 1) become 0


def weights(logits: torch.Tensor, inv_temp: torch.Tensor) -> torch.Tensor:
    """logits [n, V] fp32, inv_temp [n, 1] -> new [n, V] fp32 weights, the top one exactly 1
    (the max subtracts to 0 before scaling, so exp gives 1.0 whatever the temperature).

    Weights under FLUSH_BELOW are 0, never subnormal: exp into fp32's subnormal range runs
    ~25x slower on x86 (197 vs 7.5 ms at 64 x 49,152), and SmolLM2's rows reach it at
    temperature 1. Such a weight is invisible next to the top token's 1 in the float64 sums,
    so flushing it changes no draw; a -inf logit (a stop under min_tokens) stays 0."""
    w = logits - logits.amax(dim=-1, keepdim=True)
    if bool((inv_temp != 1).any()):
        w.mul_(inv_temp)
    w.clamp_(min=EXP_FLOOR).exp_()
    return F.threshold_(w, FLUSH_BELOW, 0.0)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, -1) (the first index of each row's max) [n], by blocks: torch's
    CPU argmax over a long row runs scalar (~8 ms at 64 x 49,152), a blocked amax is
    vectorized, and the argmaxes left are over [n, V / BLOCK] and [n, BLOCK]."""
    n, v = logits.shape
    pad = (-v) % BLOCK
    x = F.pad(logits, (0, pad), value=float("-inf")) if pad else logits
    blocks = x.view(n, -1, BLOCK)  # [n, nb, BLOCK]
    b = blocks.amax(dim=-1).argmax(dim=-1)  # the first block holding the max
    return b * BLOCK + blocks[torch.arange(n), b].argmax(dim=-1)


def min_p_(w: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """In place: drop tokens under min_p [n, 1] times the top probability (w's top is 1)."""
    return w.masked_fill_(w < min_p, 0.0)


def pick(w: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse CDF on rows of non-negative weights w [n, m] for targets [n] fp64 in
    [0, row total): the index j with cum[j-1] <= target < cum[j], and target - cum[j-1].
    A target at or past the total (rounding) lands on the last positive weight, so a zero
    weight is never picked."""
    cum = w.cumsum(dim=-1, dtype=torch.float64)  # [n, m]
    j = torch.searchsorted(cum, target.unsqueeze(1), right=True).squeeze(1)
    last = (cum < cum[:, -1:]).sum(dim=-1)  # first index reaching the total = last positive
    j = torch.minimum(j, last)
    before = torch.where(j > 0, cum.gather(1, (j - 1).clamp(min=0).unsqueeze(1)).squeeze(1),
                         torch.zeros_like(target))
    return j, target - before


def sample_rows(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token ids [n] drawn from full rows of weights w [n, V] with uniforms u [n] fp64."""
    n, v = w.shape
    pad = (-v) % BLOCK
    blocks = (F.pad(w, (0, pad)) if pad else w).view(n, -1, BLOCK)  # [n, nb, BLOCK]
    mass = blocks.sum(dim=-1, dtype=torch.float64)  # [n, nb]
    b, rest = pick(mass, u * mass.sum(dim=-1))
    inner = blocks[torch.arange(n), b]  # [n, BLOCK]
    j, _ = pick(inner, rest)
    return b * BLOCK + j


def sample_filtered(w: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    min_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token ids [n] from weights w [n, V] under top-k [n] (V = off), then top-p [n] (mass
    relative to what top-k kept; the first token past p is kept), then min-p [n, 1]; u [n].
    Rows without top-k take sample_top_p; rows with it draw among their top max(top-k) tokens,
    in weight order."""
    v = w.shape[-1]
    top_p_only = top_k >= v
    if bool(top_p_only.all()):
        return sample_top_p(w, top_p, min_p, u)
    tokens = torch.empty(len(u), dtype=torch.long)
    rows = top_p_only.nonzero().squeeze(1)
    if rows.numel():
        tokens[rows] = sample_top_p(w[rows], top_p[rows], min_p[rows], u[rows])
    rows = (~top_p_only).nonzero().squeeze(1)
    tokens[rows] = _sample_top_k(w[rows], top_k[rows], top_p[rows], min_p[rows], u[rows])
    return tokens


def sample_top_p(w: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                 u: torch.Tensor) -> torch.Tensor:
    """Token ids [n] from weights w [n, V] (top 1) cut to each row's top-p set (top_p [n] fp64,
    top_p_floor), then by min-p [n, 1], drawn in token order as sample_rows (what the native
    sample_top_p_rows does, so both paths give the same token for the same uniform u [n])."""
    keep = torch.maximum(top_p_floor(w, top_p), min_p)  # [n, 1]
    return sample_rows(w.masked_fill(w < keep, 0.0), u)


def top_p_floor(w: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The lightest weight each row's top-p set keeps [n, 1], from weights w [n, V] (top 1,
    zeros allowed) and top_p [n] fp64: from the heaviest token down, a token is kept while the
    mass before it is under top_p * total; tokens tied with the lightest kept are kept too.
    Looks at each row's TOP_P_CANDIDATES[0] heaviest tokens, then the next count for the rows
    whose set needs more, and finds the rest (flat rows) with a weight histogram
    (_histogram_floor) instead of sorting the row."""
    n, v = w.shape
    w = w.nan_to_num(nan=0.0)  # a NaN row (all logits -inf) keeps nothing: token 0, as plain
    floor = torch.empty(n, 1, dtype=w.dtype)
    limit = top_p * w.sum(dim=-1, dtype=torch.float64)  # [n]
    rows = torch.arange(n)
    for k in dict.fromkeys(min(c, v) for c in TOP_P_CANDIDATES):
        vals, _ = w[rows].topk(k, dim=-1)  # [r, k] sorted, descending
        cum = vals.cumsum(dim=-1, dtype=torch.float64)
        lim = limit[rows].unsqueeze(1)
        kept = ((cum - vals) < lim) & (vals > 0)
        fits = (cum[:, -1:] >= lim).squeeze(1) | (k == v)  # k == v: the whole row was seen
        floor[rows[fits]] = torch.where(kept, vals, torch.inf).amin(dim=-1, keepdim=True)[fits]
        rows = rows[~fits]
        if not rows.numel():
            return floor
    floor[rows] = _histogram_floor(w[rows], limit[rows])
    return floor


def top_p_keep_(w: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """In place on weights w [n, V] (top 1, zeros allowed), top_p [n] fp64: zero every token
    outside the top-p set (top_p_floor), found by the weight histogram."""
    limit = top_p * w.sum(dim=-1, dtype=torch.float64)
    return w.masked_fill_(w < _histogram_floor(w, limit), 0.0)


def _histogram_floor(w: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """top_p_floor [n, 1] for the rows' mass limits [n] (top_p * total) without sorting: a
    histogram of the mass by weight bucket
    (floor(log2(w) * KEY_STEPS)) finds the bucket where the running mass from the top crosses
    the limit: heavier buckets are in, lighter ones out, and only that bucket's tokens are
    sorted, which gives the lightest weight kept."""
    n = w.shape[0]
    key = torch.log2(w).mul_(KEY_STEPS).floor_()  # [n, V] in [-NUM_KEYS, 0]; -inf where 0
    slot = key.clamp(min=1 - NUM_KEYS).add_(NUM_KEYS - 1).long()  # 0 .. NUM_KEYS - 1
    mass = torch.zeros(n, NUM_KEYS, dtype=torch.float64).scatter_add_(1, slot, w.double())
    from_top = mass.flip(-1).cumsum(dim=-1)  # [n, NUM_KEYS] mass at or above
    pos = torch.searchsorted(from_top, limit.unsqueeze(1)).squeeze(1).clamp(max=NUM_KEYS - 1)
    edge = (-pos).unsqueeze(1).to(key.dtype)  # [n, 1] the key where the limit is crossed
    above = torch.where(pos > 0, from_top.gather(1, (pos - 1).clamp(min=0).unsqueeze(1))
                        .squeeze(1), torch.zeros_like(limit))
    in_edge = (key == edge) & (w > 0)
    c = max(int(in_edge.sum(dim=-1).max()), 1)
    vals, _ = torch.where(in_edge, w, 0.0).topk(c, dim=-1)  # [n, c] the edge bucket, sorted
    cum = above.unsqueeze(1) + vals.cumsum(dim=-1, dtype=torch.float64)
    kept = ((cum - vals) < limit.unsqueeze(1)) & (vals > 0)
    floor = torch.where(kept, vals, torch.inf).amin(dim=-1, keepdim=True)  # lightest kept
    # an empty edge (rounding left the limit unreached): keep every positive weight
    return torch.where(floor.isinf(), torch.where(w > 0, w, torch.inf).amin(-1, keepdim=True),
                       floor)


def _sample_top_k(w, top_k, top_p, min_p, u):
    """Rows with top-k [n] < V: sample among each row's k heaviest weights (k = max top-k),
    the cut by top-p relative to their mass, then min-p; picked in weight order."""
    k = int(top_k.max())
    vals, idx = w.topk(k, dim=-1)  # [n, k] sorted, descending
    vals = vals.masked_fill(torch.arange(k) >= top_k.unsqueeze(1), 0.0)
    cum = vals.cumsum(dim=-1, dtype=torch.float64)  # [n, k]
    limit = torch.where(top_p < 1, top_p * cum[:, -1], torch.inf).unsqueeze(1)
    vals = vals.masked_fill((cum - vals) >= limit, 0.0)  # mass before a token reached p
    vals = min_p_(vals, min_p)
    j, _ = pick(vals, u * vals.sum(dim=-1, dtype=torch.float64))
    return idx.gather(1, j.unsqueeze(1)).squeeze(1)
