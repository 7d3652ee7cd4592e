"""OpenAI sampling parameters to a validated SamplingParams (errors name the parameter), and
the router's own bounds on them (the engine's gRPC edge checks again)."""

from __future__ import annotations

import math
from typing import Optional, Sequence

from pdserve.common.sampling_params import MAX_BIAS, MAX_LOGIT_BIAS, SamplingParams
from pdserve.common.structured_output import StructuredOutput
from pdserve.services.common.convert import MAX_TOKEN_COUNT
from pdserve.services.router.api.errors import bad_request
from pdserve.services.router.api.structured import structured_output_of
from pdserve.services.router.limits_config import LimitsConfig

_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
           "frequency_penalty")


def build_sampling_params(body, max_tokens: int, logprobs: Optional[int], max_stop: int,
                          limits: LimitsConfig = LimitsConfig(),
                          vocab_size: Optional[int] = None,
                          tool_constraint: Optional[StructuredOutput] = None) -> SamplingParams:
    """`tool_constraint`: the grammar of a tool call (tools.py), exclusive with the body's
    own structured-output fields."""
    structured = structured_output_of(body)
    if tool_constraint is not None:
        if structured is not None:
            raise bad_request("tool_choice (a tool call) and a structured-output constraint "
                              "(response_format, structured_outputs, guided_*) exclude each "
                              "other", param="tool_choice")
        structured = tool_constraint
    stop = body.stop
    stop = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
    if len(stop) > max_stop:
        raise bad_request(f"stop may list at most {max_stop} strings", param="stop")
    for name in _FLOATS:  # NaN and inf fail here, before any range check can miss them
        value = getattr(body, name)
        if value is not None and not math.isfinite(value):
            raise bad_request(f"{name} must be a finite number, got {value}", param=name)
    for name, value in (("max_tokens", max_tokens), ("min_tokens", body.min_tokens)):
        if value > MAX_TOKEN_COUNT:
            raise bad_request(f"{name} must be at most {MAX_TOKEN_COUNT}, got {value}",
                              param=name)
    if body.seed is not None and not 0 <= body.seed < 2 ** 63:
        raise bad_request(f"seed must be in [0, 2**63), got {body.seed}", param="seed")
    check_text(body.user, limits.max_user_chars, "user")
    kw = dict(
        max_tokens=max_tokens,
        temperature=_or(body.temperature, 1.0),
        top_p=_or(body.top_p, 1.0),
        top_k=_or(body.top_k, 0),
        min_p=_or(body.min_p, 0.0),
        seed=body.seed,
        repetition_penalty=_or(body.repetition_penalty, 1.0),
        presence_penalty=_or(body.presence_penalty, 0.0),
        frequency_penalty=_or(body.frequency_penalty, 0.0),
        stop=stop,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        include_stop_str_in_output=body.include_stop_str_in_output,
        logprobs=logprobs,
        min_tokens=body.min_tokens,
        cache_salt=body.cache_salt,
        structured_output=structured,
        logit_bias=_logit_bias(body.logit_bias, vocab_size),
    )
    try:
        params = SamplingParams(**kw)
    except (ValueError, TypeError, OverflowError) as exc:
        # SamplingParams says "<field> must be ..."; the field is the OpenAI parameter.
        raise bad_request(str(exc), param=str(exc).split(" ", 1)[0]) from None
    check_params(params, limits, vocab_size)
    return params


def check_params(params: SamplingParams, limits: LimitsConfig,
                 vocab_size: Optional[int]) -> None:
    """The router's bounds on a SamplingParams (from HTTP or from the gRPC API)."""
    for name in _FLOATS:
        value = getattr(params, name)
        if not math.isfinite(value):
            raise bad_request(f"{name} must be a finite number, got {value}", param=name)
    if params.max_tokens > MAX_TOKEN_COUNT:
        raise bad_request(f"max_tokens must be at most {MAX_TOKEN_COUNT}, got "
                          f"{params.max_tokens}", param="max_tokens")
    longest = max((len(s) for s in params.stop), default=0)
    if longest > limits.max_stop_chars:
        raise bad_request(f"each stop string must be at most {limits.max_stop_chars} "
                          f"characters, got {longest}", param="stop")
    if len(params.stop_token_ids) > limits.max_stop_token_ids:
        raise bad_request(f"stop_token_ids may list at most {limits.max_stop_token_ids} ids, "
                          f"got {len(params.stop_token_ids)}", param="stop_token_ids")
    check_token_ids(params.stop_token_ids, vocab_size, "stop_token_ids")
    check_token_ids([t for t, _ in params.logit_bias], vocab_size, "logit_bias")
    if params.logprobs is not None and params.logprobs > limits.max_logprobs:
        raise bad_request(f"logprobs must be at most {limits.max_logprobs}, got "
                          f"{params.logprobs}", param="logprobs")
    check_text(params.cache_salt, limits.max_salt_chars, "cache_salt")


def _logit_bias(bias: Optional[dict], vocab_size: Optional[int]) -> tuple:
    """OpenAI's {"token id": bias} as sorted (id, bias) pairs; 400 naming logit_bias."""
    if not bias:
        return ()
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad_request(f"logit_bias may map at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}",
                          param="logit_bias")
    pairs = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise bad_request(f"logit_bias keys must be token ids, got {key[:40]!r}",
                              param="logit_bias")
        if not (math.isfinite(value) and -MAX_BIAS <= value <= MAX_BIAS):
            raise bad_request(f"logit_bias values must be in [-100, 100], got {value}",
                              param="logit_bias")
        pairs.append((int(key), value))
    check_token_ids([t for t, _ in pairs], vocab_size, "logit_bias")
    return tuple(pairs)


def check_token_ids(ids: Sequence[int], vocab_size: Optional[int], param: str) -> None:
    """Every id in [0, vocab_size) (just >= 0 while the vocabulary is unknown)."""
    if not ids:
        return
    lo, hi = min(ids), max(ids)
    top = vocab_size if vocab_size else MAX_TOKEN_COUNT + 1
    if lo < 0 or hi >= top:
        bad = lo if lo < 0 else hi
        raise bad_request(f"{param}: token ids must be in [0, {top}), got {bad}", param=param)


def check_text(value: Optional[str], max_chars: int, param: str) -> None:
    if value is not None and len(value) > max_chars:
        raise bad_request(f"{param} must be at most {max_chars} characters, got {len(value)}",
                          param=param)


def _or(value, default):
    return default if value is None else value
