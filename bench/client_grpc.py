"""Streaming client for the router's gRPC API (pdserve.v1.Router/Generate)."""

from __future__ import annotations

import time
from typing import Optional

import grpc

from pdserve.bench.record import StreamTrace
from pdserve.bench.request import BenchRequest
from pdserve.bench.target import TargetConfig
from pdserve.common.rpc import engine_pb2, router_pb2
from pdserve.common.rpc import router_pb2_grpc


class GrpcClient:
    def __init__(self, target: TargetConfig):
        self._t = target
        self._channel: Optional[grpc.aio.Channel] = None
        self._stub = None

    async def start(self) -> None:
        from pdserve.services.common.tls import TlsConfig, open_channel

        tls = TlsConfig.from_dir(self._t.tls_dir, "client") if self._t.tls_dir else TlsConfig()
        self._channel = open_channel(self._t.grpc_addr, tls, "router")
        self._stub = router_pb2_grpc.RouterStub(self._channel)

    @property
    def model(self) -> str:
        return self._t.model_name

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()

    def _request(self, req: BenchRequest, messages: Optional[list[dict]]):
        params = engine_pb2.SamplingParams(max_tokens=req.max_tokens,
                                           temperature=self._t.temperature,
                                           ignore_eos=self._t.ignore_eos)
        if self._t.top_p < 1:
            params.top_p = self._t.top_p
        msg = router_pb2.GenerateRequest(model=self._t.model_name, params=params)
        if req.is_chat:
            msg.chat.CopyFrom(router_pb2.ChatMessages(messages=[
                router_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages]))
        elif req.prompt_ids is not None:
            msg.token_ids.CopyFrom(router_pb2.TokenIds(ids=req.prompt_ids))
        else:
            msg.text = req.prompt
        return msg

    async def send(self, req: BenchRequest, messages: Optional[list[dict]],
                   trace: StreamTrace) -> None:
        try:
            call = self._stub.Generate(self._request(req, messages), timeout=self._t.timeout_s)
            async for msg in call:
                now = time.perf_counter()
                if msg.token_ids or msg.text:
                    trace.add(now, max(len(msg.token_ids), 1), msg.text)
                if msg.HasField("usage"):
                    trace.usage_prompt = msg.usage.prompt_tokens
                    trace.usage_completion = msg.usage.completion_tokens
                trace.breakdown = _breakdown(msg) or trace.breakdown
        except grpc.aio.AioRpcError as exc:
            trace.error = f"gRPC {exc.code().name}: {exc.details()}"
        finally:
            trace.done_t = time.perf_counter()


def _breakdown(msg) -> Optional[dict]:
    """The final message's `breakdown` (a message or a map), once the proto has one."""
    if "breakdown" not in msg.DESCRIPTOR.fields_by_name:
        return None
    field = msg.DESCRIPTOR.fields_by_name["breakdown"]
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        return dict(msg.breakdown) or None
    if field.message_type is not None and msg.HasField("breakdown"):
        from google.protobuf.json_format import MessageToDict

        return MessageToDict(msg.breakdown, preserving_proto_field_name=True) or None
    return None
