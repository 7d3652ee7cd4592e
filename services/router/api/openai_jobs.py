"""Validated OpenAI request bodies to Jobs (tokenized, length-checked, sampling validated)."""

from __future__ import annotations

from typing import Optional

from pdserve.services.router.api.errors import bad_request
from pdserve.services.router.dispatch.job import Job, fan_out
from pdserve.services.router.api.openai_protocol import ChatCompletionRequest, CompletionRequest
from pdserve.services.router.api.prompts import (chat_prompt, check_length, completion_prompts,
                                             message_dicts)
from pdserve.services.router.api.sampling import build_sampling_params, check_token_ids
from pdserve.services.router.api.tools import tool_plan
from pdserve.services.router.state import RouterState


def completion_job(body: CompletionRequest, state: RouterState, request_id: str) -> Job:
    state.check_model(body.model)
    _check_stream_options(body)
    if body.echo and body.logprobs is not None:
        raise bad_request("echo with logprobs is not supported: the engine does not compute "
                          "prompt logprobs; use echo without logprobs", param="echo",
                          code="unsupported_parameter")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request(f"best_of must equal n ({body.n}): ranking extra candidates is not "
                          f"supported", param="best_of", code="unsupported_parameter")
    prompts = completion_prompts(body.prompt, state.tokenizer)
    vocab = state.vocab_size
    for ids in prompts:
        check_token_ids(ids, vocab, "prompt")
    max_len = state.pool.max_model_len
    check_length(prompts, max_len, "prompt")
    max_tokens = 16 if body.max_tokens is None else body.max_tokens  # OpenAI's default
    params = build_sampling_params(body, max_tokens, body.logprobs, state.config.max_stop,
                                   state.config.limits, vocab)
    return fan_out(request_id, prompts, params, body.n, state.config.max_n, body.cache_salt)


def chat_job(body: ChatCompletionRequest, state: RouterState, request_id: str) -> Job:
    state.check_model(body.model)
    _check_stream_options(body)
    ids = chat_prompt(message_dicts(body.messages), state.tokenizer, body.add_generation_prompt)
    max_len = state.pool.max_model_len
    check_length([ids], max_len, "messages")
    max_tokens = _chat_max_tokens(body, len(ids), max_len, state.config.default_chat_max_tokens)
    logprobs = _chat_logprobs(body)
    plan = tool_plan(body, state.tokenizer.chat_template)
    params = build_sampling_params(body, max_tokens, logprobs, state.config.max_stop,
                                   state.config.limits, state.vocab_size,
                                   plan.constraint if plan is not None else None)
    return fan_out(request_id, [ids], params, body.n, state.config.max_n, body.cache_salt)


def _check_stream_options(body) -> None:
    opts = body.stream_options
    if opts is None:
        return
    if not body.stream:
        raise bad_request("stream_options is only allowed when stream is true",
                          param="stream_options")
    if opts.continuous_usage_stats:
        raise bad_request("stream_options.continuous_usage_stats is not supported",
                          param="stream_options.continuous_usage_stats",
                          code="unsupported_parameter")


def _chat_max_tokens(body, prompt_len: int, max_len: Optional[int], default: int) -> int:
    asked = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    if asked is not None:
        return asked
    return min(default, max_len - prompt_len) if max_len else default


def _chat_logprobs(body: ChatCompletionRequest) -> Optional[int]:
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
    if not body.logprobs:
        return None
    return body.top_logprobs or 0
