"""An ITL-adaptive per-step token budget for chunked prefill (`--itl-target-ms`).

Colocated, a decode's inter-token latency is the time of the step it rides in, and that time
grows with the prompt tokens chunked into the same step. The scheduler takes its token budget
per step (`Scheduler.token_budget`); this controller sets it between steps from measured step
times so that steps that carry decodes stay near the target, while steps with no decodes
(pure prefill) use the full budget: nobody's ITL is at stake there.

Model: step time ~= fixed + per_token * tokens. Both are learned from observed steps by an
exponentially weighted least-squares fit (a handful of floats, nothing per token). The budget
for the next step is the token count the model predicts to take `target_s`, clamped to
[min_tokens, max_tokens]; before the fit has two distinct points the budget is max_tokens.

Lifecycle: one controller per engine, touched only by the engine thread: `budget(has_decodes)`
before a step, `observe(tokens, seconds)` after it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepBudgetConfig:
    target_s: float  # the step time to hold when decodes share the step
    max_tokens: int  # the scheduler's configured max_num_batched_tokens (buffers sized to it)
    min_tokens: int = 16  # prefill keeps moving even when decodes alone miss the target
    decay: float = 0.9  # weight of the past in the fit, per observed step (0..1)

    def __post_init__(self):
        if not self.target_s > 0:
            raise ValueError(f"target_s must be > 0, got {self.target_s}")
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"need 1 <= min_tokens ({self.min_tokens}) <= max_tokens "
                             f"({self.max_tokens})")
        if not 0.0 < self.decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {self.decay}")


class StepBudgetController:
    """Learns step time vs tokens; answers the per-step token budget."""

    def __init__(self, cfg: StepBudgetConfig):
        self.cfg = cfg
        # decayed sums for the least-squares line t = a + b * n
        self._w = self._sn = self._st = self._snn = self._snt = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        """One finished step: how many tokens it computed and how long it took."""
        if num_tokens <= 0 or seconds <= 0:
            return
        d = self.cfg.decay
        n, t = float(num_tokens), float(seconds)
        self._w = d * self._w + 1.0
        self._sn = d * self._sn + n
        self._st = d * self._st + t
        self._snn = d * self._snn + n * n
        self._snt = d * self._snt + n * t

    def model(self) -> tuple[float, float] | None:
        """(fixed_s, per_token_s) of the current fit, None until it is determined."""
        w = self._w
        if w <= 0:
            return None
        var = self._snn / w - (self._sn / w) ** 2
        if var <= 1e-9 * max(1.0, (self._sn / w) ** 2):
            return None  # every step had the same size: no slope yet
        per_token = (self._snt / w - (self._sn / w) * (self._st / w)) / var
        if per_token <= 0:
            return None  # noise swamped the signal; keep the full budget
        fixed = max(0.0, self._st / w - per_token * self._sn / w)
        return fixed, per_token

    def budget(self, has_decodes: bool) -> int:
        """Token budget for the next step: the full one when no decode waits on this step or
        before the fit knows the slope; else what the fit predicts to take `target_s`."""
        cfg = self.cfg
        if not has_decodes:
            return cfg.max_tokens
        m = self.model()
        if m is None:
            return cfg.max_tokens
        fixed, per_token = m
        n = int((cfg.target_s - fixed) / per_token)
        return max(cfg.min_tokens, min(cfg.max_tokens, n))
