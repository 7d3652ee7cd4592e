"""Handing activations from one pipeline stage to the next, and the logits back to rank 0.

Stage s's tensor rank j sends its hidden states [T, hidden] (after its last layer; the layers
fold the residual into their output, so this one tensor is all the next stage needs) to stage
s+1's tensor rank j: every rank of a stage ends the stage with the same hidden states (the
all-reduce made them equal), so each next-stage rank gets a whole copy and no collective is
needed. The last stage's tensor rank 0 sends the sampled rows' logits [N, vocab] fp32 to
rank 0, the engine process, which samples. Both sides know every shape from the step's
SchedulerOutput, so only the tensors move.

With a KV connector (`mark_every_step`) the last stage's tensor rank 0 also ends a step that
samples nothing with a one-float marker on the logits tag, so rank 0's `recv_logits` returns
for every step only after every stage wrote that step's K/V (the connector then reads them
through shared memory; kv_share.py). Without one, such a step moves nothing back.

Transport: torch.distributed point-to-point (gloo on the CPU, NCCL on CUDA) on the world group,
with one tag per direction. Sends are asynchronous (`isend`): a stage hands step k on and
starts step k+1 while the bytes move; at most two sends stay pending per rank (the tensors
are kept alive until they complete).
"""

from __future__ import annotations

from collections import deque
from typing import Optional

import torch
import torch.distributed as dist

from pdserve.common.distributed.layout import RankPlace

_HIDDEN_TAG, _LOGITS_TAG = 1, 2
_MAX_PENDING = 2


class StageLink:
    def __init__(self, place: RankPlace, hidden_size: int, dtype: torch.dtype,
                 vocab_size: int, device: str, mark_every_step: bool = False):
        self.place, self.mark_every_step = place, mark_every_step
        self._hidden, self._dtype, self._vocab = hidden_size, dtype, vocab_size
        self._device = device
        stage, j = place.stage, place.tp_rank
        self._prev = place.global_rank(stage - 1, j) if stage > 0 else None
        last = place.pp_size - 1
        self._next = place.global_rank(stage + 1, j) if stage < last else None
        self._last_root = place.global_rank(last, 0)  # sends the logits
        self._pending: deque = deque()  # (work, tensor) of sends in flight

    def _send(self, t: torch.Tensor, dst: int, tag: int) -> None:
        while len(self._pending) >= _MAX_PENDING:
            self._pending.popleft()[0].wait()
        t = t.contiguous()
        self._pending.append((dist.isend(t, dst, tag=tag), t))

    def send_hidden(self, hidden: torch.Tensor) -> None:
        """hidden [T, hidden] -> the next stage's rank of the same tensor rank."""
        self._send(hidden, self._next, _HIDDEN_TAG)

    def recv_hidden(self, num_tokens: int) -> torch.Tensor:
        """The previous stage's hidden states [num_tokens, hidden] (blocks until they came)."""
        buf = torch.empty(num_tokens, self._hidden, dtype=self._dtype, device=self._device)
        dist.recv(buf, self._prev, tag=_HIDDEN_TAG)
        return buf

    def send_logits(self, logits: torch.Tensor) -> None:
        """The last stage's tensor rank 0, after each step: logits [N, vocab] fp32 -> rank 0
        (N = 0: nothing moves, or the end-of-step marker with `mark_every_step`)."""
        if logits.shape[0]:
            self._send(logits, 0, _LOGITS_TAG)
        elif self.mark_every_step:
            self._send(torch.zeros(1, device=self._device), 0, _LOGITS_TAG)

    def recv_logits(self, num_rows: int, width: Optional[int] = None) -> torch.Tensor:
        """Rank 0: the last stage's logits [num_rows, vocab] fp32 ([0, vocab] when nothing
        was sampled: without a transfer, or after the end-of-step marker). `width`: the
        columns the last stage sends when not vocab (a split head: pipeline_head.py)."""
        buf = torch.empty(num_rows, width or self._vocab, dtype=torch.float32,
                          device=self._device)
        if num_rows:
            dist.recv(buf, self._last_root, tag=_LOGITS_TAG)
        elif self.mark_every_step:
            dist.recv(torch.empty(1, device=self._device), self._last_root, tag=_LOGITS_TAG)
        return buf
