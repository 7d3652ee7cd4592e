"""The producer's save with pipeline stages (P > 1), a mixin of StoreKVConnector.

Rank 0 holds only the first stage's layers and up to P steps are in flight, so the engine
calls `stage_step` when it submits a step (staging as `begin_step`, and one save counted in
flight for every request of the step, so an abort cannot free blocks the later stages still
write) and `save_step` once the step came back from the last stage: every layer is copied out
then, through the shared-memory mapping of every rank's cache
(common/distributed/kv_share.py), and put as one step.

The host class provides `_stage`, `_copy_layer`, `_save_started`, `_saves_done`,
`_submit_save`, `_lock` and `heads` (store_connector.py, save_io.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pdserve.connector.staging import StagedStep


@dataclass(frozen=True)
class PipelinedSave:
    """A step submitted down the pipeline: its staged blocks (None: nothing to save) and its
    requests, each counted as one save in flight until the step is saved."""
    step: Optional[StagedStep]
    rids: list[str]


class PipelinedSaves:
    def stage_step(self, batch) -> PipelinedSave:
        """When the step is submitted, stage its full blocks and count one save in flight for
        each of its requests until `save_step`: a request aborted while its step is in flight
        keeps its blocks (request_finished -> True) until every stage is done with them, so
        neither a later step nor a load (written from here, past the pipeline's order) can
        reuse them early."""
        step = self._stage(batch)
        rids = list(dict.fromkeys(req.request_id for req, _, _ in batch))
        with self._lock:
            for rid in rids:
                self._save_started(rid)
        return PipelinedSave(step, rids)

    def save_step(self, handle: Optional[PipelinedSave]) -> None:
        """The step came back (every stage wrote its layers; kv_share.py): copy every layer
        of its staged blocks out of the ranks' caches, then put them."""
        if handle is None:
            return
        step = handle.step
        saving = set() if step is None else {rid for rid, _, _ in step.staged}
        with self._lock:  # a request with no block to save is done with now
            self._saves_done([rid for rid in handle.rids if rid not in saving])
        if step is None:
            return
        for layer in range(self.heads.num_layers):
            self._copy_layer(step.views, layer, step.ids)
        self._submit_save(step, [r for r in handle.rids if r in saving],
                          reserved=step.reserved)
