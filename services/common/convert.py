"""Conversions between the pdserve.v1 messages and the engine's typed dataclasses.

Services call these at the gRPC edge only; nothing past them sees a generated class.
"""

from __future__ import annotations

from typing import Optional

from pdserve.common.engine.outputs import (EngineStats, FinishReason, RequestOutput,
                                           TokenLogprob)
from pdserve.common.rpc import engine_pb2 as pb
from pdserve.common.sampling_params import SamplingParams

_OPTIONAL = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
             "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs")

FINISH_TO_PROTO = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}
FINISH_FROM_PROTO = {v: k for k, v in FINISH_TO_PROTO.items()}


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
    )


def params_to_proto(p: SamplingParams) -> pb.SamplingParams:
    if p.structured_output is not None:  # refused, not silently dropped
        raise ValueError("structured_output is not carried over gRPC yet")
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
    return msg


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
