"""The KV connector protocol the engine calls; `connector/` implements it (dependencies point
down: common never imports connector).

Two halves, as in vLLM's KV connector:

Scheduler side (called by the Scheduler, single-threaded, between steps)
- `get_num_new_matched_tokens(request, num_computed_tokens)`: how many tokens past
  num_computed_tokens can be loaded from outside (whole blocks only), or None while the answer
  is still being looked up (the scheduler asks again next step; the engine thread never waits
  on the store). No side effects beyond starting that lookup.
- `update_state_after_alloc(request, block_ids, num_computed_tokens, num_external_tokens)`: the
  scheduler allocated blocks for those tokens; the connector starts loading them. The request
  waits in WAITING_FOR_KV until the load is reported finished or failed.
- `request_preempted(request, block_ids)`: the scheduler is about to free a preempted
  request's blocks; the connector may copy them out now, never read them later.
- `request_finished(request, block_ids) -> bool`: True when the connector still reads those
  blocks (a save in flight); the engine then keeps them allocated until `get_finished` reports
  the request among the finished saves.

Worker side (called by EngineCore around rank 0's forward)
- `register_kv_shards(shards)` once (every tensor-parallel rank's caches; at T = 1 the
  default hands rank 0's to `register_kv_caches(kv_caches)`); `begin_step(batch)`,
  `save_layer(layer, kv_cache)` after each layer's attention, `end_step()` after the forward. A producer copies the blocks that
  became full in this step out of each layer as the forward goes, so saving overlaps compute.
- With pipeline stages (P > 1) rank 0 runs only the first stage's layers and up to P steps are
  in flight, so instead: `stage_step(batch) -> handle` when a step is submitted (it picks the
  blocks to save and keeps every request of the step "in use", so blocks of a request aborted
  while its step is in flight stay allocated), and `save_step(handle)` once the step's logits
  came back, when every stage has written its layers; it reads every layer then (all ranks'
  caches are in shared memory, common/distributed/kv_share.py).
- `get_finished() -> (saved request ids, loaded request ids)` and `get_failed_loads() ->
  {request id: tokens that did load}`; every load ends in exactly one of the two.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pdserve.common.engine.request import Request


class KVConnector(abc.ABC):
    # -- scheduler side --------------------------------------------------------------------
    @abc.abstractmethod
    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> "int | None":
        ...

    @abc.abstractmethod
    def update_state_after_alloc(self, request: "Request", block_ids: list[int],
                                 num_computed_tokens: int, num_external_tokens: int) -> None:
        ...

    @abc.abstractmethod
    def request_finished(self, request: "Request", block_ids: list[int]) -> bool:
        ...

    def request_preempted(self, request: "Request", block_ids: list[int]) -> None:
        """Before a preempted request's blocks are freed (copy them now or never)."""

    # -- worker side -----------------------------------------------------------------------
    @abc.abstractmethod
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        ...

    def register_kv_shards(self, shards: list[list[torch.Tensor]]) -> None:
        """Every tensor-parallel rank's caches (rank order; rank r holds a contiguous run of
        KV heads). The default handles one rank only."""
        if len(shards) != 1:
            raise NotImplementedError(f"{type(self).__name__} reads one rank's KV cache only")
        self.register_kv_caches(shards[0])

    def begin_step(self, batch: list[tuple["Request", int, list[int]]]) -> None:
        """batch: (request, new tokens this step, its block ids), before the forward."""

    def save_layer(self, layer_idx: int, kv_cache: torch.Tensor) -> None:
        """After layer layer_idx wrote this step's K/V into kv_cache."""

    def end_step(self) -> None:
        """After the whole forward."""

    def stage_step(self, batch: list[tuple["Request", int, list[int]]]) -> object:
        """Pipeline stages: `begin_step`'s batch, when the step is submitted; returns the
        handle `save_step` takes once the step came back from every stage."""
        raise NotImplementedError(f"{type(self).__name__} with pipeline stages")

    def save_step(self, handle: object) -> None:
        """Pipeline stages: after `stage_step`'s step came back (every layer written)."""
        raise NotImplementedError(f"{type(self).__name__} with pipeline stages")

    @abc.abstractmethod
    def get_finished(self) -> tuple[set[str], set[str]]:
        ...

    @abc.abstractmethod
    def get_failed_loads(self) -> dict[str, int]:
        ...

    def finish_waits_for_save(self) -> bool:
        """True when a finished request's last output must wait until its KV is saved (a
        prefill instance: the consumer reads the blocks next)."""
        return False

    def transfer_stats(self):
        """Transfer counters for metrics (connector.ConnectorStats), or None."""
        return None

    def close(self) -> None:
        """Stop background work; pending saves may be dropped."""
