"""Sampling from a batch of logits, one row per request that completes a sequence this step.

Greedy rows take the argmax of the (penalized) logits. Random rows apply temperature, top-k,
top-p and min-p and draw by inverse CDF with one uniform per row (sample_ops), all rows at
once. A request's k-th output token uses `random_stream.uniform(key(seed), k)`: a function of
its seed and k only, so the same seed gives the same output whatever else is in the batch,
whichever row it is, and on whichever instance or path (prefill then decode, store hit,
preempted) the token is sampled. Log-probabilities are those of the model's raw
distribution, as OpenAI and vLLM report them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pdserve.common.engine import sample_ops
from pdserve.common.random_stream import stream_key, uniform
from pdserve.common.engine.request import Request


@dataclass
class SamplerOutput:
    token_ids: list[int]  # [N]
    logprobs: Optional[list[Optional[tuple[float, list[tuple[int, float]]]]]]  # per row or None


class Sampler:
    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> SamplerOutput:
        """logits [N, V] fp32, reqs [N]; the k-th output token of a request is drawn with
        uniform(stream_key(req.seed), k), k = its outputs so far."""
        raw = logits
        if any(r.params.needs_penalties for r in reqs):
            logits = apply_penalties(logits.clone(), reqs)
        logits = _suppress_min_tokens(logits, reqs)
        rows = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if not rows:
            tokens = sample_ops.argmax(logits)
        elif len(rows) == len(reqs):
            tokens = _sample(logits, reqs)
        else:
            tokens = sample_ops.argmax(logits)  # greedy rows; the random ones are overwritten
            tokens[rows] = _sample(logits[rows], [reqs[i] for i in rows])
        token_list = tokens.tolist()
        return SamplerOutput(token_list, _logprobs(raw, reqs, token_list))


def _sample(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """Random rows: logits [n, V] -> token ids [n]."""
    n, v = logits.shape
    params = [r.params for r in reqs]
    u = torch.tensor([uniform(stream_key(r.seed), r.num_output_tokens) for r in reqs],
                     dtype=torch.float64)  # [n]
    inv_temp = torch.tensor([1.0 / p.temperature for p in params]).unsqueeze(1)  # [n, 1]
    w = sample_ops.weights(logits, inv_temp)  # [n, V]
    min_p = torch.tensor([p.min_p for p in params]).unsqueeze(1)  # [n, 1]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < v else v for p in params])  # [n]
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64)  # [n]
    filtered = (top_k < v) | (top_p < 1)
    if not bool(filtered.any()):
        if bool((min_p > 0).any()):
            sample_ops.min_p_(w, min_p)
        return sample_ops.sample_rows(w, u)
    if bool(filtered.all()):
        return sample_ops.sample_filtered(w, top_k, top_p, min_p, u)
    tokens = torch.empty(n, dtype=torch.long)
    f, plain = filtered.nonzero().squeeze(1), (~filtered).nonzero().squeeze(1)
    tokens[f] = sample_ops.sample_filtered(w[f], top_k[f], top_p[f], min_p[f], u[f])
    tokens[plain] = sample_ops.sample_rows(sample_ops.min_p_(w[plain], min_p[plain]), u[plain])
    return tokens


def apply_penalties(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """Repetition (prompt + output, HF semantics), presence and frequency (output only, OpenAI
    semantics) penalties, in place on logits [N, V]."""
    n, v = logits.shape
    out_counts = torch.zeros(n, v)
    seen = torch.zeros(n, v, dtype=torch.bool)
    for i, r in enumerate(reqs):
        if not r.params.needs_penalties:
            continue
        out_ids = torch.tensor(r.output_token_ids, dtype=torch.long)
        out_counts[i].index_add_(0, out_ids, torch.ones(len(out_ids)))
        seen[i, torch.tensor(r.all_token_ids, dtype=torch.long)] = True
    rep = torch.tensor([r.params.repetition_penalty for r in reqs]).unsqueeze(1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    freq = torch.tensor([r.params.frequency_penalty for r in reqs]).unsqueeze(1)
    pres = torch.tensor([r.params.presence_penalty for r in reqs]).unsqueeze(1)
    return logits - freq * out_counts - pres * (out_counts > 0)


def _suppress_min_tokens(logits, reqs) -> torch.Tensor:
    """Forbid stop tokens until a request has min_tokens outputs."""
    rows = [(i, r) for i, r in enumerate(reqs)
            if r.params.min_tokens and r.num_output_tokens < r.params.min_tokens]
    if not rows:
        return logits
    logits = logits.clone()
    v = logits.shape[-1]
    for i, r in rows:
        # ids past the vocabulary are never produced, so there is nothing to forbid
        stops = [t for t in (*r.params.stop_token_ids, *r.eos_token_ids) if t < v]
        if stops:
            logits[i, stops] = float("-inf")
    return logits


def _logprobs(raw, reqs, tokens):
    wanted = [r.params.logprobs for r in reqs]
    if all(w is None for w in wanted):
        return None
    rows = [i for i, w in enumerate(wanted) if w is not None]
    lp = raw[rows].log_softmax(dim=-1)
    k = max(wanted[i] for i in rows)
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    chosen = lp.gather(1, torch.tensor([tokens[i] for i in rows]).unsqueeze(1)).squeeze(1)
    out: list = [None] * len(reqs)
    for j, i in enumerate(rows):
        n = wanted[i]
        out[i] = (chosen[j].item(), list(zip(top_i[j, :n].tolist(), top_v[j, :n].tolist())))
    return out
