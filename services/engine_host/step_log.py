"""Every step an engine runs, one line each: the served step's work beside its time (issue 19).

The GetLoad trace (bench/serve_step_trace.py) sees one step only when a poll falls between two
steps, and its polls are served by the engine's own threads. This log is written by the engine
thread itself: per step the tokens computed and sampled, the wall, forward and engine-thread
CPU time, and what could make one decode step costlier than another at the same batch — the
batch's context lengths (sum and max), whether its requests differ from the previous step's,
and how many steps ago the last step with prompt tokens ran. Enabled by the environment of the
engine process, `PDSERVE_STEP_LOG=PATH` (an experiment switch, off by default); the records
are kept in memory, at most MAX_RECORDS, and appended to PATH whenever the engine goes idle, so
no file I/O falls inside a step. `bench/step_log_split.py` reads the file.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Optional

ENV = "PDSERVE_STEP_LOG"
MAX_RECORDS = 200_000  # a bound on memory if the engine never idles (a few MB)


@dataclass(frozen=True)
class StepLogRecord:
    t_ns: int  # wall clock (time.time_ns) at the step's start
    tokens: int  # tokens computed (prompt chunks + decodes)
    sampled: int  # rows sampled
    wall_ns: int  # EngineCore.step's wall time on the engine thread
    forward_ns: int  # the forward's share of it (StepProfile)
    cpu_ns: int  # the engine thread's CPU time in the step
    running: int  # requests running when the step began (a decode-only step's batch)
    ctx_sum: int  # their computed tokens (the KV each attends over), summed
    ctx_max: int
    same_batch: bool  # the same requests ran in the previous step (no join, no leave)
    since_prompt: int  # steps since the last step with prompt tokens (1: the one before)
    # from the previous step's end to this one's start (publish, commands, stats: the engine
    # thread's own time between steps) and its CPU time in it; a gap that is mostly not CPU
    # is a wait (for the GIL, for a core); the first step after an idle spell has a long gap
    gap_ns: int = 0
    gap_cpu_ns: int = 0

    def __post_init__(self) -> None:
        if min(self.tokens, self.sampled, self.wall_ns, self.running, self.ctx_sum) < 0:
            raise ValueError(f"negative field in {self}")


class StepLog:
    """Built and written by the engine thread only."""

    def __init__(self, path: str, max_records: int = MAX_RECORDS):
        if not path:
            raise ValueError("StepLog needs a path")
        if max_records <= 0:
            raise ValueError(f"max_records must be > 0, got {max_records}")
        self.path = path
        self._max = max_records
        self._records: list[StepLogRecord] = []
        self._prev_ids: frozenset = frozenset()
        self._since_prompt = 1 << 30  # no prompt step seen yet
        self._end = (0, 0)  # the previous step's end: (time.time_ns, time.thread_time_ns)

    def before_step(self, running) -> tuple[frozenset, int, int, bool]:
        """(ids, context sum, context max, same batch as the previous step) of the requests
        running now; `running` is the scheduler's list of Requests."""
        ids = frozenset(r.request_id for r in running)
        ctx = [r.num_computed_tokens for r in running]
        same = ids == self._prev_ids
        self._prev_ids = ids
        return ids, sum(ctx), max(ctx, default=0), same

    def observe(self, t_ns: int, tokens: int, sampled: int, wall_ns: int, forward_ns: int,
                cpu_ns: int, before: tuple[frozenset, int, int, bool],
                start_cpu_ns: int = 0) -> None:
        """`start_cpu_ns`: the engine thread's time.thread_time_ns() at the step's start."""
        ids, ctx_sum, ctx_max, same = before
        gap, gap_cpu = (t_ns - self._end[0], start_cpu_ns - self._end[1]) if self._end[0] \
            else (0, 0)
        self._end = (t_ns + wall_ns, start_cpu_ns + cpu_ns)
        if len(self._records) < self._max:
            self._records.append(StepLogRecord(t_ns, tokens, sampled, wall_ns, forward_ns,
                                               cpu_ns, len(ids), ctx_sum, ctx_max, same,
                                               self._since_prompt, gap, gap_cpu))
        self._since_prompt = 1 if tokens > sampled else self._since_prompt + 1

    def flush(self) -> int:
        """Appends the records kept so far to the file; returns how many."""
        recs, self._records = self._records, []
        if recs:
            with open(self.path, "a") as f:
                f.writelines(json.dumps(asdict(r)) + "\n" for r in recs)
        return len(recs)


def read_step_log(path: str) -> list[StepLogRecord]:
    """The records a StepLog wrote to `path`, in file order (bench/step_log_split.py)."""
    with open(path) as f:
        return [StepLogRecord(**json.loads(line)) for line in f if line.strip()]


def step_log_from_env() -> Optional[StepLog]:
    path = os.environ.get(ENV, "")
    return StepLog(path) if path else None
