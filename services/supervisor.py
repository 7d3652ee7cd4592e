"""Keeps a started stack running: a service that exits is restarted, with backoff.

Lifecycle: `Supervisor(steps, out)` -> `start_all(stop)` starts each step in order and waits
until it is ready, printing its state as it goes ("starting", "ready in 2.1s", and what the
step's `describe()` adds, e.g. an engine's KV budget); a service that dies during the first
start is a configuration error and stops the launch (RuntimeError). -> `watch(stop)`, until
`stop` is set: a service that exits (any code: a crash, a SIGKILL, a drained SIGTERM) is
started again after a backoff (`Backoff`: 0.5 s doubling to 10 s, back to 0.5 s once a run
lasted 30 s), with the same command line, so it keeps its port and re-registers under the
same address; the others keep serving meanwhile. Each transition is printed. Nothing here
stops a process: the launcher does that, in reverse start order, once `watch` returns.
`<log dir>/services.json` (name -> pid of every started service) and `services_ready.json`
(the names that are ready now) are rewritten on every transition, for tools that inject
faults (bench/chaos.py).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TextIO

from pdserve.services.launcher import Child, Step, wait_until


@dataclass
class Backoff:
    """Delay before the next restart of one service."""

    initial_s: float = 0.5
    cap_s: float = 10.0
    reset_after_s: float = 30.0  # a run at least this long forgets earlier failures
    next_s: float = field(init=False)

    def __post_init__(self):
        if not 0 < self.initial_s <= self.cap_s or self.reset_after_s <= 0:
            raise ValueError("need 0 < initial_s <= cap_s and reset_after_s > 0")
        self.next_s = self.initial_s

    def after_run(self, ran_s: float) -> float:
        """The delay after a run of `ran_s` seconds ended; doubles for the next one."""
        if ran_s >= self.reset_after_s:
            self.next_s = self.initial_s
        delay, self.next_s = self.next_s, min(self.cap_s, self.next_s * 2)
        return delay


@dataclass
class _Watched:
    step: Step
    backoff: Backoff
    state: str = "starting"  # starting | ready | waiting (to restart) | restarting
    started_at: float = 0.0
    due: float = 0.0  # when a waiting service starts again
    restarts: int = 0


class Supervisor:
    def __init__(self, steps: list[Step], out: TextIO = sys.stdout,
                 startup_timeout_s: float = 300.0, backoff: Backoff = None):
        self._watched = [_Watched(s, Backoff(**_fields(backoff))) for s in steps]
        self._out = out
        self._startup_timeout_s = startup_timeout_s
        self.started: list[Child] = []

    def _say(self, text: str) -> None:
        print(text, file=self._out, flush=True)

    def start_all(self, stop: threading.Event) -> None:
        """Each step in order, ready before the next (KeyboardInterrupt when `stop` is set)."""
        for w in self._watched:
            step = w.step
            self._say(f"  {step.child.name:<12} starting")
            t0 = time.monotonic()
            step.child.start()
            self.started.append(step.child)
            self._write_pids()
            wait_until(step.ready, step.child, self._startup_timeout_s, stop)
            w.state, w.started_at = "ready", time.monotonic()
            self._write_pids()
            self._say(f"  {step.child.name:<12} ready in {w.started_at - t0:.1f}s"
                      f"{_extra(step)}")

    def watch(self, stop: threading.Event, tick_s: float = 0.2) -> None:
        """Restarts what exits until `stop` is set."""
        while not stop.wait(tick_s):
            for w in self._watched:
                self._tend(w)

    def _tend(self, w: _Watched) -> None:
        child, now = w.step.child, time.monotonic()
        if w.state in ("ready", "restarting") and not child.alive:
            delay = w.backoff.after_run(now - w.started_at)
            w.state, w.due = "waiting", now + delay
            self._write_pids()
            self._say(f"  {child.name:<12} exited (code {child.proc.returncode}); restarting "
                      f"in {delay:.1f}s")
        elif w.state == "waiting" and now >= w.due:
            w.restarts += 1
            child.start()
            self._write_pids()
            w.state, w.started_at = "restarting", now
            self._say(f"  {child.name:<12} restarting (restart {w.restarts})")
        elif w.state == "restarting" and w.step.ready():
            w.state = "ready"
            self._write_pids()
            self._say(f"  {child.name:<12} ready again after {now - w.started_at:.1f}s"
                      f"{_extra(w.step)}")

    def _write_pids(self) -> None:
        if not self.started:
            return
        folder = self.started[0].log_path.parent
        pids = {c.name: c.proc.pid for c in self.started if c.proc is not None}
        ready = sorted(w.step.child.name for w in self._watched if w.state == "ready")
        _write_json(folder / "services.json", pids)
        _write_json(folder / "services_ready.json", ready)

    def restarts(self, name: str) -> int:
        return next(w.restarts for w in self._watched if w.step.child.name == name)


def _write_json(path, value) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    tmp.replace(path)  # readers never see half a file


def _extra(step: Step) -> str:
    if step.describe is None:
        return ""
    try:
        text = step.describe()
    except Exception as exc:  # a description is a courtesy; never fails the launch
        text = f"({exc})"
    return f"; {text}" if text else ""


def _fields(backoff) -> dict:
    if backoff is None:
        return {}
    return {"initial_s": backoff.initial_s, "cap_s": backoff.cap_s,
            "reset_after_s": backoff.reset_after_s}
