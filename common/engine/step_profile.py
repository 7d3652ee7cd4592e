"""Where an engine's step time goes: cumulative per-phase counters (served-path profile).

One `StepProfile` per engine, written only by the thread that steps it (plain ints: a reader on
another thread sees a slightly stale but never torn value in CPython). Phases of `EngineCore.step`:

  schedule   Scheduler.schedule (and the connector's begin/end_step)
  forward    the executor's forward (all ranks)
  sample     the sampler
  update     Scheduler.update_from_output + building RequestOutputs (detokenize)

and of the service around it (services/engine_host):

  publish    the engine thread handing a step's outputs to the event loop
  handoff    a step's outputs waiting for the event loop to run their callback
  deliver    the event loop putting them into the request streams
  send       gRPC writes of the streamed messages (decode servicer)
"""

from __future__ import annotations

from dataclasses import dataclass, fields

PHASES = ("schedule", "forward", "sample", "update", "publish", "handoff", "deliver", "send")


@dataclass
class StepProfile:
    num_steps: int = 0
    num_tokens: int = 0  # tokens computed (prompt chunks + decodes)
    num_sampled: int = 0  # rows sampled (tokens generated)
    num_messages: int = 0  # streamed messages written by the servicers
    last_step_tokens: int = 0
    schedule_ns: int = 0
    forward_ns: int = 0
    sample_ns: int = 0
    update_ns: int = 0
    publish_ns: int = 0
    handoff_ns: int = 0
    deliver_ns: int = 0
    send_ns: int = 0

    def add_step(self, num_tokens: int, num_sampled: int, t0: int, t1: int, t2: int, t3: int,
                 t4: int) -> None:
        """Stamps (time.perf_counter_ns) at: start, scheduled, forward done, sampled, done."""
        self.num_steps += 1
        self.num_tokens += num_tokens
        self.num_sampled += num_sampled
        self.last_step_tokens = num_tokens
        self.schedule_ns += t1 - t0
        self.forward_ns += t2 - t1
        self.sample_ns += t3 - t2
        self.update_ns += t4 - t3

    def reset(self) -> None:
        """Every counter back to 0, in place (readers hold this object)."""
        for f in fields(self):
            setattr(self, f.name, 0)

    def snapshot(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
