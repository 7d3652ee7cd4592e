"""Conversions between the pdserve.v1 messages and the engine's typed dataclasses.

Services call these at the gRPC edge only; nothing past them sees a generated class.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from pdserve.common.engine.outputs import (EngineStats, FinishReason, RequestOutput,
                                           TokenLogprob)
from pdserve.common.rpc import engine_pb2 as pb
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.structured_output import StructuredKind, StructuredOutput

_OPTIONAL = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
             "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs")

FINISH_TO_PROTO = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}
FINISH_FROM_PROTO = {v: k for k, v in FINISH_TO_PROTO.items()}

# What one request may carry into an engine. The router enforces tighter, configurable
# limits (docs/hardening.md); these hold for any caller that reaches the engine's port.
MAX_REQUEST_ID_CHARS = 256
MAX_SALT_CHARS = 1024
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 4096  # per stop string
MAX_BLOCK_KEY_BYTES = 64
MAX_TOKEN_COUNT = 2 ** 32 - 1  # max_tokens / min_tokens travel as uint32


@dataclass(frozen=True)
class EngineLimits:
    """The engine's shape, as the gRPC edge checks requests against it."""

    vocab_size: int
    max_model_len: int
    block_size: int = 0  # 0: unknown (no KV store): block keys bounded by max_model_len

    def __post_init__(self):
        if self.vocab_size <= 0 or self.max_model_len <= 0 or self.block_size < 0:
            raise ValueError("vocab_size and max_model_len must be > 0, block_size >= 0")


def check_engine_request(limits: EngineLimits, request_id: str, prompt_ids: Sequence[int],
                         params: SamplingParams, first_token_id: Optional[int] = None,
                         block_keys: Sequence[bytes] = ()) -> None:
    """Raises ValueError naming the field for anything the engine must not be handed: token
    ids outside [0, vocab), a prompt that leaves no room, oversized strings and lists. The
    engine re-checks what it owns; this runs first, before anything is queued."""
    vocab = limits.vocab_size
    _bound(len(request_id) <= MAX_REQUEST_ID_CHARS, "request_id",
           f"at most {MAX_REQUEST_ID_CHARS} characters", len(request_id))
    _bound(0 < len(prompt_ids) < limits.max_model_len, "prompt_token_ids",
           f"1 to {limits.max_model_len - 1} ids", len(prompt_ids))
    _bound(_ids_in(prompt_ids, vocab), "prompt_token_ids", f"ids in [0, {vocab})",
           _out_of(prompt_ids, vocab))
    _bound(_ids_in(params.stop_token_ids, vocab), "stop_token_ids", f"ids in [0, {vocab})",
           _out_of(params.stop_token_ids, vocab))
    bias_ids = [t for t, _ in params.logit_bias]
    _bound(_ids_in(bias_ids, vocab), "logit_bias", f"keyed by ids in [0, {vocab})",
           _out_of(bias_ids, vocab))
    if first_token_id is not None:
        _bound(0 <= first_token_id < vocab, "first_token_id", f"in [0, {vocab})",
               first_token_id)
    _bound(params.max_tokens <= MAX_TOKEN_COUNT, "max_tokens", f"<= {MAX_TOKEN_COUNT}",
           params.max_tokens)
    _bound(len(params.stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} strings",
           len(params.stop))
    longest = max((len(s) for s in params.stop), default=0)
    _bound(longest <= MAX_STOP_CHARS, "stop", f"strings of at most {MAX_STOP_CHARS} characters",
           longest)
    salt = params.cache_salt or ""
    _bound(len(salt) <= MAX_SALT_CHARS, "cache_salt", f"at most {MAX_SALT_CHARS} characters",
           len(salt))
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty"):
        value = getattr(params, name)
        _bound(math.isfinite(value), name, "a finite number", value)
    bs = limits.block_size or 1
    max_keys = limits.max_model_len // bs + 1
    _bound(len(block_keys) <= max_keys, "block_keys", f"at most {max_keys} keys",
           len(block_keys))
    _bound(all(len(k) <= MAX_BLOCK_KEY_BYTES for k in block_keys), "block_keys",
           f"keys of at most {MAX_BLOCK_KEY_BYTES} bytes", "a longer key")


def _bound(ok: bool, name: str, allowed: str, got) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {got!r}")


def _ids_in(ids: Sequence[int], vocab: int) -> bool:
    return not ids or (min(ids) >= 0 and max(ids) < vocab)


def _out_of(ids: Sequence[int], vocab: int):
    return next((t for t in ids if not 0 <= t < vocab), None)


def params_from_proto(msg: pb.SamplingParams, cache_salt: Optional[str] = None) -> SamplingParams:
    """Unset optional fields keep SamplingParams' defaults; raises ValueError on bad values."""
    kw = {name: getattr(msg, name) for name in _OPTIONAL if msg.HasField(name)}
    return SamplingParams(
        **kw,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        include_stop_str_in_output=msg.include_stop_str_in_output,
        min_tokens=msg.min_tokens,
        cache_salt=cache_salt,
        structured_output=(structured_from_proto(msg.structured_output)
                           if msg.HasField("structured_output") else None),
        logit_bias=tuple(msg.logit_bias.items()),
    )


def params_to_proto(p: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
        min_p=p.min_p, repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        stop=list(p.stop), stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos,
        include_stop_str_in_output=p.include_stop_str_in_output, min_tokens=p.min_tokens)
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    if p.structured_output is not None:
        msg.structured_output.CopyFrom(structured_to_proto(p.structured_output))
    for token_id, bias in p.logit_bias:
        msg.logit_bias[token_id] = bias
    return msg


def structured_from_proto(msg: pb.StructuredOutput) -> StructuredOutput:
    """Raises ValueError for an empty oneof or a spec StructuredOutput refuses (too long,
    not JSON, too many choices)."""
    which = msg.WhichOneof("constraint")
    if which is None:
        raise ValueError("structured_output must set one constraint")
    if which == "json_object":
        return StructuredOutput(StructuredKind.JSON_OBJECT)
    if which == "choice":
        return StructuredOutput(StructuredKind.CHOICE, choices=tuple(msg.choice.choices))
    return StructuredOutput(StructuredKind(which), spec=getattr(msg, which))


def structured_to_proto(so: StructuredOutput) -> pb.StructuredOutput:
    k = so.kind
    if k == StructuredKind.JSON_OBJECT:
        return pb.StructuredOutput(json_object=pb.StructuredOutput.JsonObject())
    if k == StructuredKind.CHOICE:
        return pb.StructuredOutput(choice=pb.StructuredOutput.Choices(choices=so.choices))
    return pb.StructuredOutput(**{k.value: so.spec})


def logprob_to_proto(lp: TokenLogprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                           top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])


def logprob_from_proto(msg: pb.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(token_id=msg.token_id, logprob=msg.logprob,
                        top=tuple((t.token_id, t.logprob) for t in msg.top))


def output_to_proto(out: RequestOutput) -> pb.DecodeResponse:
    return pb.DecodeResponse(
        token_ids=out.new_token_ids,
        text=out.new_text,
        logprobs=[logprob_to_proto(lp) for lp in out.logprobs or ()],
        finish_reason=FINISH_TO_PROTO[out.finish_reason if out.finished else None],
        stop_reason="" if out.stop_reason is None else str(out.stop_reason),
        num_prompt_tokens=out.num_prompt_tokens,
        num_cached_tokens=out.num_cached_tokens,
        num_output_tokens=out.num_output_tokens,
    )


def stats_to_proto(s: EngineStats) -> pb.LoadResponse:
    return pb.LoadResponse(
        num_running=s.num_running, num_waiting=s.num_waiting, kv_usage=s.kv_usage,
        num_waiting_tokens=s.num_waiting_tokens, num_free_blocks=s.num_free_blocks,
        num_total_blocks=s.num_total_blocks, num_waiting_for_kv=s.num_waiting_for_kv,
        num_kv_load_failures=s.num_kv_load_failures)


def kv_stats_to_proto(s) -> pb.KVTransferStats:
    """A connector's ConnectorStats (connector/store_connector.py) as a message."""
    return pb.KVTransferStats(
        blocks_saved=s.blocks_saved, blocks_loaded=s.blocks_loaded, bytes_saved=s.bytes_saved,
        bytes_loaded=s.bytes_loaded, save_failures=s.save_failures,
        load_failures=s.load_failures, lookup_failures=s.lookup_failures,
        save_seconds=s.save_seconds, load_seconds=s.load_seconds,
        failure_reasons=dict(s.failure_reasons))
