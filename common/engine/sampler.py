"""Sampling from a batch of logits, one row per request that completes a sequence this step.

Greedy rows take the argmax of the (penalized) logits. Random rows apply temperature, top-k,
top-p and min-p, then draw with the exponential-race trick (argmax of p / Exp(1) noise), where
the noise row comes from the request's own generator when it has a seed: the same seed gives
the same output whatever else is in the batch. Log-probabilities are those of the model's raw
distribution, as OpenAI and vLLM report them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pdserve.common.engine.request import Request


@dataclass
class SamplerOutput:
    token_ids: list[int]  # [N]
    logprobs: Optional[list[Optional[tuple[float, list[tuple[int, float]]]]]]  # per row or None


class Sampler:
    def __init__(self, vocab_size: int, generator: torch.Generator):
        self.vocab_size = vocab_size
        self.generator = generator  # for requests without a seed

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> SamplerOutput:
        """logits [N, V] fp32, reqs [N]."""
        raw = logits
        if any(r.params.needs_penalties for r in reqs):
            logits = apply_penalties(logits.clone(), reqs)
        logits = _suppress_min_tokens(logits, reqs)
        greedy = [r.params.greedy for r in reqs]
        if all(greedy):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample(logits, reqs, greedy)
        token_list = tokens.tolist()
        return SamplerOutput(token_list, _logprobs(raw, reqs, token_list))

    def _sample(self, logits, reqs, greedy) -> torch.Tensor:
        tokens = logits.argmax(dim=-1)
        rows = [i for i, g in enumerate(greedy) if not g]
        sub = logits[rows]
        temps = torch.tensor([reqs[i].params.temperature for i in rows]).unsqueeze(1)
        probs = _filter(sub / temps, [reqs[i].params for i in rows]).softmax(dim=-1)
        noise = torch.empty_like(probs)
        for j, i in enumerate(rows):
            noise[j].exponential_(generator=reqs[i].generator or self.generator)
        tokens[rows] = (probs / noise).argmax(dim=-1)
        return tokens


def _filter(logits: torch.Tensor, params) -> torch.Tensor:
    """Top-k, top-p and min-p as -inf masks on logits [n, V]."""
    top_ks = [p.top_k for p in params]
    if any(k > 0 for k in top_ks):
        v = logits.shape[-1]
        k = torch.tensor([k if k > 0 else v for k in top_ks]).clamp(max=v)
        kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1).unsqueeze(1))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    top_ps = torch.tensor([p.top_p for p in params])
    if (top_ps < 1).any():
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = (cum - sorted_logits.softmax(-1)) >= top_ps.unsqueeze(1)  # keep the first past p
        logits = logits.scatter(1, idx, sorted_logits.masked_fill(drop, float("-inf")))
    min_ps = torch.tensor([p.min_p for p in params])
    if (min_ps > 0).any():
        probs = logits.softmax(-1)
        floor = probs.max(-1, keepdim=True).values * min_ps.unsqueeze(1)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


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
