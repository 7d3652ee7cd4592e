"""What the scheduler decided for one step, as a frozen value the model runner of every rank
can execute without the scheduler's state (it is pickled to tensor-parallel workers).

Chunks are ordered decodes first (one new token), then prefill / extend chunks: the runner packs
them in this order, and the rows it samples follow it too.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.common.engine.kv_rank_messages import Transfer


@dataclass(frozen=True)
class ScheduledChunk:
    """One request's tokens to compute this step.

    token_ids: the new tokens, at positions start .. start + len(token_ids) - 1.
    block_ids: the request's whole block table (KV of positions 0 .. end lives there).
    sample: the chunk reaches the request's last token, so its last row is sampled.
    """

    request_id: str
    token_ids: tuple[int, ...]
    start: int
    block_ids: tuple[int, ...]
    sample: bool

    def __post_init__(self):
        if not self.token_ids:
            raise ValueError("a scheduled chunk has at least one token")
        if self.start < 0:
            raise ValueError(f"start must be >= 0, got {self.start}")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...] = ()
    preempted: tuple[str, ...] = ()  # request ids preempted (blocks freed) this step
    # per-rank KV transfers every rank starts now: only a message with no chunks carries them
    # (RankKVLink.send; docs/parallelism.md, "Per-rank transfers")
    transfers: tuple[Transfer, ...] = ()

    def __post_init__(self):
        if self.transfers and self.chunks:
            raise ValueError("KV transfers travel in a message of their own, not in a step")

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def sampled_ids(self) -> list[str]:
        """Request ids whose row is sampled, in sampler order."""
        return [c.request_id for c in self.chunks if c.sample]


EMPTY_STEP = SchedulerOutput()
