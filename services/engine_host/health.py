"""Health and GetLoad answers, shared by the prefill and decode services."""

from __future__ import annotations

import time
from dataclasses import dataclass

from pdserve.common.rpc import engine_pb2 as pb
from pdserve.services.engine_host.async_engine import AsyncEngine
from pdserve.services.common.convert import kv_stats_to_proto, stats_to_proto

ROLES = ("unified", "prefill", "decode")


@dataclass(frozen=True)
class InstanceInfo:
    """What an instance says about itself in Health."""

    model: str
    role: str
    max_model_len: int
    vocab_size: int
    fingerprint: str = ""  # the model fingerprint that seeds block hashes
    block_size: int = 0
    kv_role: str = ""  # the KV connector's role; "" -> no store

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.max_model_len <= 0 or self.vocab_size <= 0:
            raise ValueError("max_model_len and vocab_size must be > 0")
        if self.block_size < 0:
            raise ValueError(f"block_size must be >= 0, got {self.block_size}")


def health_response(engine: AsyncEngine, info: InstanceInfo) -> pb.HealthResponse:
    status = pb.HealthResponse.SERVING if engine.healthy else pb.HealthResponse.NOT_SERVING
    return pb.HealthResponse(status=status, model=info.model, role=info.role,
                             max_model_len=info.max_model_len, vocab_size=info.vocab_size,
                             model_fingerprint=info.fingerprint, block_size=info.block_size,
                             kv_role=info.kv_role)


def load_response(engine: AsyncEngine) -> pb.LoadResponse:
    load = stats_to_proto(engine.stats())
    load.num_aborted = engine.num_aborted
    load.num_finished = engine.num_finished
    load.num_step_failures = engine.num_step_failures
    p = engine.profile.snapshot()
    del p["last_step_tokens"]
    load.profile.CopyFrom(pb.StepProfile(**p))
    load.profile.step_cpu_ns = engine.step_cpu_ns
    # GetLoad runs on the event loop thread: its own CPU clock is the loop's
    load.profile.loop_cpu_ns = time.thread_time_ns()
    load.profile.process_cpu_ns = time.process_time_ns()
    kv = engine.kv_stats()
    if kv is not None:
        load.kv.CopyFrom(kv_stats_to_proto(kv))
    return load
