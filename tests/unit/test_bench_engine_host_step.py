"""bench/engine_host_step.py: only decode-only steps at the round's batch are timed."""

from types import SimpleNamespace

from pdserve.bench.engine_host_step import StepTimer


class FakeCore:
    """Steps through scripted (tokens computed, requests running) pairs."""

    def __init__(self, script):
        self.script = list(script)
        self.profile = SimpleNamespace(last_step_tokens=0)
        self.scheduler = SimpleNamespace(running=[])

    def step(self):
        tokens, running = self.script.pop(0)
        self.profile.last_step_tokens = tokens
        self.scheduler.running = [object()] * running
        return ["out"]


def test_timer_keeps_decode_only_steps_at_the_batch_and_passes_outputs_through():
    core = FakeCore([(512, 2), (2, 2), (2, 2), (1, 1), (3, 3)])
    timer = StepTimer(core)
    core.step = timer
    timer.batch = 2
    outs = [core.step() for _ in range(5)]
    assert outs == [["out"]] * 5
    assert len(timer.times) == 2  # the prompt step and the other batches are not counted
    assert all(t >= 0 for t in timer.times)
