"""The ITL-adaptive step token budget: a deterministic controller fed fake step times, and
AsyncEngine setting the scheduler's budget from it between steps."""

import asyncio
from types import SimpleNamespace

import pytest

from pdserve.common.engine.step_budget import StepBudgetConfig, StepBudgetController
from pdserve.common.sampling_params import SamplingParams
from pdserve.services.engine_host.async_engine import AsyncEngine
from pdserve.tests.unit.fake_engine import FakeEngineCore


def _steps(ctl, fixed_s, per_token_s, sizes):
    for n in sizes:
        ctl.observe(n, fixed_s + per_token_s * n)


def test_budget_is_full_until_the_fit_has_a_slope():
    ctl = StepBudgetController(StepBudgetConfig(0.05, 512))
    assert ctl.budget(has_decodes=True) == 512
    _steps(ctl, 0.02, 1e-4, [8, 8, 8])  # one step size: no slope yet
    assert ctl.model() is None and ctl.budget(True) == 512


def test_budget_hits_the_target_of_a_linear_step_time():
    ctl = StepBudgetController(StepBudgetConfig(0.05, 2048, min_tokens=16))
    _steps(ctl, 0.02, 1e-4, [8, 300, 64, 1000, 8, 520])
    fixed, per_token = ctl.model()
    assert fixed == pytest.approx(0.02) and per_token == pytest.approx(1e-4)
    assert ctl.budget(has_decodes=True) == 299  # (0.05 - 0.02) / 1e-4, floored (float)
    assert ctl.budget(has_decodes=False) == 2048  # pure prefill: nobody's ITL at stake


def test_budget_is_clamped_and_follows_a_slower_machine():
    ctl = StepBudgetController(StepBudgetConfig(0.05, 256, min_tokens=16, decay=0.5))
    _steps(ctl, 0.001, 1e-5, [8, 200, 100])  # fast: the target allows more than the max
    assert ctl.budget(True) == 256
    _steps(ctl, 0.045, 1e-3, [8, 200, 100, 50, 150] * 4)  # slow: decodes alone near target
    assert ctl.budget(True) == 16
    _steps(ctl, 0.01, 2e-4, [8, 200, 100, 50, 150] * 6)  # recovers as it forgets
    assert 150 <= ctl.budget(True) <= 250


@pytest.mark.parametrize("kw", [dict(target_s=0), dict(max_tokens=8, min_tokens=16),
                                dict(decay=1.0)])
def test_bad_config_is_refused(kw):
    base = dict(target_s=0.05, max_tokens=512)
    with pytest.raises(ValueError):
        StepBudgetConfig(**{**base, **kw})


class _BudgetedFake(FakeEngineCore):
    """Records the budget each step ran with; a step of n tokens 'takes' 1 ms + 0.1 ms * n
    (reported through the profile, as EngineCore does)."""

    def __init__(self):
        super().__init__(step_s=0)
        self.token_budget = 2048
        self.budgets = []

    def running_requests(self):
        return [SimpleNamespace(request_id=r, num_tokens=2, num_computed_tokens=1)
                for r in self._reqs]

    def set_token_budget(self, num_tokens):
        super().set_token_budget(num_tokens)
        self.token_budget = num_tokens

    def step(self):
        self.budgets.append(self.token_budget)
        n = 8 if len(self.budgets) % 2 else 400  # alternate sizes so the fit has a slope
        self.profile.num_steps += 1
        self.profile.last_step_tokens = n
        return super().step()


def test_async_engine_sets_the_budget_between_steps():
    core = _BudgetedFake()
    ctl = StepBudgetController(StepBudgetConfig(0.05, 2048))
    seen = []
    ctl_observe = ctl.observe
    ctl.observe = lambda n, s: seen.append(n) or ctl_observe(n, 0.001 + 1e-4 * n)

    async def main():
        engine = AsyncEngine(core, step_budget=ctl)
        engine.start(asyncio.get_running_loop())
        try:
            stream = await engine.submit("a", [65, 66], SamplingParams(max_tokens=6))
            [o async for o in stream]
            stream.close()
        finally:
            engine.stop()
    asyncio.run(main())
    assert seen[:4] == [8, 400, 8, 400]  # every step's size reached the controller
    assert core.budgets[0] == 2048  # nothing learned yet
    assert core.budgets[-1] == 490  # (0.05 - 0.001) / 1e-4, set on the scheduler
