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

import weakref
from dataclasses import dataclass
from typing import Optional

import torch

from pdserve.common.engine import sample_native, sample_ops
from pdserve.common.engine.grammar import GrammarBackend, GrammarState
from pdserve.common.random_stream import stream_key, uniform
from pdserve.common.engine.request import Request
from pdserve.common.structured_output import StructuredKind

_JSON = (StructuredKind.JSON_SCHEMA, StructuredKind.JSON_OBJECT)


@dataclass
class SamplerOutput:
    token_ids: list[int]  # [N]
    logprobs: Optional[list[Optional[tuple[float, list[tuple[int, float]]]]]]  # per row or None


class Sampler:
    def __init__(self, vocab_size: int, tokenizer=None, use_native: bool = True):
        """`tokenizer`: the engine's Tokenizer, needed only by structured outputs.
        `use_native`: False keeps the torch path even where the native kernel runs (the
        reference, for tests and `pdserve bench sampler`)."""
        self.vocab_size = vocab_size
        self.use_native = use_native
        self._tokenizer = tokenizer
        self._grammar: Optional[GrammarBackend] = None  # built on the first constrained request
        # one grammar state per live request; it goes with the request object
        self._states: "weakref.WeakKeyDictionary[Request, GrammarState]" = \
            weakref.WeakKeyDictionary()

    def check(self, params) -> None:
        """Raises ValueError if params.structured_output cannot be enforced (engines call
        this when a request arrives, so a bad grammar is a 400, not a failed step)."""
        if params.structured_output is not None:
            self._backend().new_state(params.structured_output)

    def _backend(self) -> GrammarBackend:
        if self._grammar is None:
            if self._tokenizer is None:
                raise ValueError("structured_output needs the engine's tokenizer")
            self._grammar = GrammarBackend(self._tokenizer, self.vocab_size)
        return self._grammar

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> SamplerOutput:
        """logits [N, V] fp32, reqs [N]; the k-th output token of a request is drawn with
        uniform(stream_key(req.seed), k), k = its outputs so far."""
        raw = logits
        if any(r.params.needs_penalties for r in reqs):
            logits = apply_penalties(logits.clone(), reqs)
        if any(r.params.logit_bias for r in reqs):
            logits = _apply_logit_bias(logits if logits is not raw else raw.clone(), reqs)
        logits = _suppress_min_tokens(logits, reqs)
        if any(r.params.structured_output is not None for r in reqs):
            logits = self._mask_grammars(logits if logits is not raw else raw.clone(), reqs)
        rows = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if not rows:
            tokens = sample_native.argmax(logits, self.use_native)
        elif len(rows) == len(reqs):
            tokens = _sample(logits, reqs, self.use_native)
        else:
            tokens = sample_native.argmax(logits, self.use_native)  # random rows overwritten below
            tokens[rows] = _sample(logits[rows], [reqs[i] for i in rows], self.use_native)
        token_list = tokens.tolist()
        return SamplerOutput(token_list, _logprobs(raw, reqs, token_list))


    def _mask_grammars(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """In place on a copy: each constrained row's forbidden tokens become -inf, after its
        grammar state has accepted every output token it has not seen yet."""
        backend = self._backend()
        mask = backend.allocate_mask(len(reqs))  # [N, V/32] int32
        rows = []
        for i, r in enumerate(reqs):
            spec = r.params.structured_output
            if spec is None:
                continue
            state = self._states.get(r)
            if state is None:
                state = self._states[r] = backend.new_state(spec)
            state.catch_up(r.output_token_ids)
            if state.fill(mask, i):
                rows.append(i)
        if rows:
            json_rows = [i for i in rows if reqs[i].params.structured_output.kind in _JSON]
            backend.apply_mask(logits, mask, rows, json_rows)
        return logits


def _sample(logits: torch.Tensor, reqs: list[Request], use_native: bool) -> torch.Tensor:
    """Random rows: logits [n, V] -> token ids [n]. Rows without top-k / top-p take the fused
    native kernel (sample_native.sample_plain), rows with top-p alone the fused top-p kernel
    (sample_native.sample_top_p), where it runs; rows with top-k the torch path."""
    n, v = logits.shape
    params = [r.params for r in reqs]
    u = torch.tensor([uniform(stream_key(r.seed), r.num_output_tokens) for r in reqs],
                     dtype=torch.float64)  # [n]
    inv_temp = torch.tensor([1.0 / p.temperature for p in params]).unsqueeze(1)  # [n, 1]
    min_p = torch.tensor([p.min_p for p in params]).unsqueeze(1)  # [n, 1]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < v else v for p in params])  # [n]
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64)  # [n]
    with_k = top_k < v
    top_p_only = ~with_k & (top_p < 1)
    plain = ~with_k & ~top_p_only

    def plain_rows(i):
        return sample_native.sample_plain(logits[i], inv_temp[i], min_p[i], u[i], use_native)

    def top_p_rows(i):
        return sample_native.sample_top_p(logits[i], inv_temp[i], top_p[i], min_p[i], u[i],
                                          use_native)

    def top_k_rows(i):
        w = sample_native.weights(logits[i], inv_temp[i], use_native)  # [len(i), V]
        return sample_ops.sample_filtered(w, top_k[i], top_p[i], min_p[i], u[i])

    tokens = torch.empty(n, dtype=torch.long)
    for rows, draw in ((plain, plain_rows), (top_p_only, top_p_rows), (with_k, top_k_rows)):
        if bool(rows.all()):
            return draw(slice(None))  # one kind: no copy of the logits
        if bool(rows.any()):
            i = rows.nonzero().squeeze(1)
            tokens[i] = draw(i)
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


def _apply_logit_bias(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """In place on logits [N, V]: each request's biases added to its row (OpenAI's
    logit_bias; ids past the vocabulary are never produced, so they are skipped)."""
    v = logits.shape[-1]
    rows, cols, vals = [], [], []
    for i, r in enumerate(reqs):
        for token_id, bias in r.params.logit_bias:
            if token_id < v:
                rows.append(i)
                cols.append(token_id)
                vals.append(bias)
    if rows:
        logits.index_put_((torch.tensor(rows), torch.tensor(cols)),
                          torch.tensor(vals, dtype=logits.dtype), accumulate=True)
    return logits


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
