"""OpenAI sampling parameters to a validated SamplingParams (errors name the parameter)."""

from __future__ import annotations

from typing import Optional

from pdserve.common.sampling_params import SamplingParams
from pdserve.services.router.api.errors import bad_request


def build_sampling_params(body, max_tokens: int, logprobs: Optional[int],
                          max_stop: int) -> SamplingParams:
    stop = body.stop
    stop = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
    if len(stop) > max_stop:
        raise bad_request(f"stop may list at most {max_stop} strings", param="stop")
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
        logprobs=logprobs,
        min_tokens=body.min_tokens,
        cache_salt=body.cache_salt,
    )
    if body.seed is not None and not 0 <= body.seed < 2 ** 63:
        raise bad_request(f"seed must be in [0, 2**63), got {body.seed}", param="seed")
    try:
        return SamplingParams(**kw)
    except ValueError as exc:
        # SamplingParams says "<field> must be ..."; the field is the OpenAI parameter.
        raise bad_request(str(exc), param=str(exc).split(" ", 1)[0]) from None


def _or(value, default):
    return default if value is None else value
