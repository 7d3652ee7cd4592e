"""The engine interface the services drive (services/engine_host/async_engine.py and friends).

`EngineCore` implements it, and so does the services' test fake (tests/unit/fake_engine.py), so
the services never need to look inside an engine. All methods are called from one thread (the
engine thread); only `tokenizer`, `max_model_len` and `fingerprint` are read-only
facts that other threads may read.
"""

from __future__ import annotations

from typing import Optional, Protocol, Sequence

from pdserve.common.engine.step_profile import StepProfile
from pdserve.common.engine.kv_transfer import KVTransferParams
from pdserve.common.engine.outputs import EngineStats, RequestOutput
from pdserve.common.engine.request import Request
from pdserve.common.sampling_params import SamplingParams


class EngineFatalError(RuntimeError):
    """A step failed in a way the engine cannot recover from (a tensor-parallel rank is gone):
    the engine is dead, unlike an ordinary step error, which fails only that step's batch."""


class EngineClient(Protocol):
    tokenizer: object  # encode / decode / encode_chat / eos_token_ids / vocab_size
    max_model_len: int
    fingerprint: str  # "" when the engine has no model fingerprint
    profile: StepProfile  # cumulative step-phase counters, written by the stepping thread

    def warm_up(self) -> int:
        """Run a few steps so the first request pays no kernel load or allocation, leaving no
        trace (cache, counters); idempotent; returns the steps run. Before any request."""

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, first_token_id: Optional[int] = None,
                    kv_transfer: Optional[KVTransferParams] = None) -> None:
        """Queue a request. ValueError (nothing queued) when any field is bad."""

    def abort_request(self, request_id: str) -> None:
        """Cancel in any state; idempotent. The next step reports it as ABORT."""

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[RequestOutput]:
        """One scheduler step. EngineFatalError when the engine is broken (a worker died); any
        other exception fails only this step's batch (the caller aborts it and goes on)."""

    def stats(self) -> EngineStats: ...

    def kv_transfer_stats(self) -> Optional[object]:
        """The KV connector's counters (connector.ConnectorStats), None without one."""

    def cached_block_hashes(self, limit: int) -> tuple:
        """The newest `limit` block keys of the local prefix cache."""

    def get_request(self, request_id: str) -> Optional[Request]:
        """The live request (read on the engine thread only), None when unknown."""

    def running_requests(self) -> Sequence[Request]:
        """The requests the scheduler is running (the next step's batch, the batch a step that
        raised was computing); engine thread only, valid until the next step."""

    def set_token_budget(self, num_tokens: int) -> None:
        """The most tokens a step may schedule, from the next step on (the ITL controller's
        knob, common/engine/step_budget.py). ValueError when below 1."""

    def close(self) -> None:
        """Stop background work and worker processes; idempotent."""
