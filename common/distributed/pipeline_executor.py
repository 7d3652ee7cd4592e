"""PipelineExecutor: P stages of T ranks each, rank 0 (the engine process) is the first stage's
tensor rank 0, with up to P steps in flight (docs/parallelism.md).

`submit(out)` sends the step to every worker, runs the first stage's layers here and hands the
hidden states on (asynchronously), so it returns while the later stages work; `collect()`
waits for the oldest submitted step's logits from the last stage. The engine submits step k+1
before it collects step k, so rank 0 schedules, samples and runs stage 0 while the later
stages run the step before: the stages overlap. Workers run the steps in the order they were
sent, each stage after the previous one, so the steps stay ordered along the pipeline (a
step's KV writes on a stage happen before the next step's there).

Failure: as MultiProcExecutor, and the worker group's watch thread kills every worker as soon as
one dies, so a wait here ends with an error.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

import torch

from pdserve.common.distributed.executor import MultiProcExecutor, WorkerGroup
from pdserve.common.distributed.pipeline import StageLink
from pdserve.common.distributed.pipeline_head import Rank0Head
from pdserve.common.engine.model_runner import ModelRunner
from pdserve.common.engine.scheduler_output import SchedulerOutput


class PipelineExecutor(MultiProcExecutor):
    def __init__(self, runner: ModelRunner, workers: WorkerGroup, link: StageLink,
                 depth: int, kv_shards: Optional[list[list[torch.Tensor]]] = None,
                 head: Optional[Rank0Head] = None):
        """`kv_shards`: every rank's caches in shared memory (a KV connector; kv_share.py),
        which it reads and writes only between steps: `link` then has the last stage mark
        the end of every step (`collect` returns only once every stage wrote its layers).
        `head`: rank 0's rows of a split LM head (pipeline_head.py; the last stage then
        sends its rows' logits and the hidden rows), None: the last stage sends logits."""
        super().__init__(runner, workers, kv_shards)
        self.link, self.depth, self.head = link, depth, head
        self._started: deque[SchedulerOutput] = deque()

    def submit(self, out: SchedulerOutput) -> None:
        if len(self._started) >= self.depth:
            raise RuntimeError(f"{self.depth} steps are in flight already: collect one first")
        self.check_health()
        try:
            self._send_step(out)
            self.link.send_hidden(self.runner.execute(out))  # [T, hidden] -> stage 1
        except Exception as exc:
            self._failed(exc)
        self._started.append(out)

    def collect(self) -> torch.Tensor:
        if not self._started:
            raise RuntimeError("no step started")
        out = self._started.popleft()
        rows = sum(c.sample for c in out.chunks)
        try:
            if self.head is None:
                return self.link.recv_logits(rows)
            received = self.link.recv_logits(rows, self.head.received_width)
        except Exception as exc:
            self._failed(exc)
        return self.head.join(received)  # [rows, V]

    def execute_model(self, out, layer_done=None) -> torch.Tensor:
        if layer_done is not None:  # rank 0 holds the first stage's layers only
            raise NotImplementedError("per-layer callbacks with pipeline stages: a KV "
                                      "connector saves a step's blocks once it is collected")
        self.submit(out)
        return self.collect()
