"""A request inside the engine, and the one state machine every request moves through.

    WAITING -> (WAITING_FOR_KV) -> RUNNING -> (PREEMPTED -> WAITING) -> FINISHED | CANCELLED
    FINISHED | CANCELLED -> RECLAIMED   (its blocks are back in the pool)

Every status change goes through `Request.transition`, which refuses any edge not in
`_TRANSITIONS`; nothing else assigns `status`.
"""

from __future__ import annotations

import enum
import time
from typing import Optional


from pdserve.common.engine.kv_transfer import NO_KV_TRANSFER, KVTransferParams
from pdserve.common.engine.outputs import FinishReason, TokenLogprob
from pdserve.common.kv.block_hash import BlockHash
from pdserve.common.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    RECLAIMED = "reclaimed"


S = RequestStatus
_TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = {
    S.WAITING: frozenset({S.WAITING_FOR_KV, S.RUNNING, S.CANCELLED}),
    S.WAITING_FOR_KV: frozenset({S.RUNNING, S.WAITING, S.CANCELLED}),
    S.RUNNING: frozenset({S.PREEMPTED, S.FINISHED, S.CANCELLED}),
    S.PREEMPTED: frozenset({S.WAITING, S.CANCELLED}),
    S.FINISHED: frozenset({S.RECLAIMED}),
    S.CANCELLED: frozenset({S.RECLAIMED}),
    S.RECLAIMED: frozenset(),
}


class InvalidTransition(RuntimeError):
    pass


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 max_tokens: int, arrival_time: Optional[float] = None,
                 seed: Optional[int] = None,
                 eos_token_ids: tuple[int, ...] = ()):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)  # prompt + output, grows by one per step
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens  # params.max_tokens capped by the model length
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        # the sampling stream's seed: params.seed, or one the engine drew at arrival
        self.seed = seed if seed is not None else (params.seed or 0)
        self.eos_token_ids = () if params.ignore_eos else tuple(eos_token_ids)
        self.status = RequestStatus.WAITING
        self.history: list[RequestStatus] = [RequestStatus.WAITING]
        # monotonic time each status was first entered (queue, KV wait, compute breakdowns)
        self.status_times: dict[RequestStatus, float] = {RequestStatus.WAITING: self.arrival_time}
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prompt tokens found in the prefix cache, at first schedule
        self.num_external_tokens = 0  # tokens loaded through the KV connector
        self.kv_transfer: KVTransferParams = NO_KV_TRANSFER  # where the caller stored its KV
        self.block_hashes: list[BlockHash] = []  # hashes of full blocks of all_token_ids
        self.num_preemptions = 0
        self.finish_reason: Optional[FinishReason] = None
        self.stop_reason: Optional[object] = None
        self.logprobs: Optional[list[TokenLogprob]] = [] if params.logprobs is not None else None
        self.first_token_time: Optional[float] = None

    def transition(self, new: RequestStatus) -> None:
        if new not in _TRANSITIONS[self.status]:
            raise InvalidTransition(f"request {self.request_id}: {self.status.name} -> "
                                    f"{new.name} is not allowed")
        self.status = new
        self.history.append(new)
        self.status_times.setdefault(new, time.monotonic())

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status in (S.FINISHED, S.CANCELLED, S.RECLAIMED)

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
