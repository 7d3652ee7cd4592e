"""`pdserve bench serve --chaos-kill-every K`: fault injection from the launcher's own list.

Lifecycle: `Chaos(cfg).start()` starts a thread that, every `every_s` seconds, reads
`<up log dir>/services.json` (name -> pid, which `pdserve up` rewrites whenever it starts or
restarts a service) and `services_ready.json` beside it (the names serving now), picks one
ready service whose name starts with one of `kinds` at random (seeded) and SIGKILLs it;
`stop()` ends the thread and returns the kills made. The launcher restarts what was killed,
so the run measures serving through faults.

Which services may die (`keep_one_ready`, on by default): never one still restarting (that
kills nothing that serves, and keeps it from ever coming back), and never the last ready one
of its kind, so a stream always has another instance to move to. A tick with no such service
kills nothing and is counted in `skipped`. Why: a SmolLM2 engine takes 30-50 s to restart on
two shared cores, longer than a 30 s kill period; without the rule the second kill of a
2-decode fleet often lands on the only decode left, and the run measures an outage (no
instance anywhere), not fault tolerance.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ChaosConfig:
    services_file: str  # the launcher's services.json
    every_s: float
    kinds: tuple[str, ...] = ("decode",)  # name prefixes that may be killed
    seed: int = 0
    keep_one_ready: bool = True  # see the module docstring

    def __post_init__(self):
        if self.every_s <= 0 or not self.kinds or not self.services_file:
            raise ValueError("chaos needs every_s > 0, kinds and the services file")


class Chaos:
    def __init__(self, cfg: ChaosConfig):
        self.cfg = cfg
        self._rng = random.Random(cfg.seed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos", daemon=True)
        self.kills: list[str] = []
        self.skipped = 0  # ticks with no service that may be killed

    def start(self) -> "Chaos":
        self._thread.start()
        return self

    def stop(self) -> list[str]:
        self._stop.set()
        self._thread.join(10)
        return self.kills

    def _run(self) -> None:
        while not self._stop.wait(self.cfg.every_s):
            pids = json.loads(Path(self.cfg.services_file).read_text())
            names = self._victims(sorted(n for n in pids if n.startswith(self.cfg.kinds)))
            if not names:
                self.skipped += 1
                print("chaos: no service may be killed now (restarting, or the last ready "
                      "one of its kind); skipped", flush=True)
                continue
            name = self._rng.choice(names)
            try:
                os.kill(int(pids[name]), signal.SIGKILL)
            except ProcessLookupError:
                continue  # already gone (restarting)
            self.kills.append(name)
            print(f"chaos: killed {name} (pid {pids[name]})", flush=True)


    def _victims(self, names: list[str]) -> list[str]:
        """The `names` that may be killed now (see the module docstring)."""
        if not self.cfg.keep_one_ready:
            return names
        ready_file = Path(self.cfg.services_file).with_name("services_ready.json")
        ready = set(json.loads(ready_file.read_text())) if ready_file.exists() else set(names)
        up = [n for n in names if n in ready]
        return [n for n in up if sum(_kind(m) == _kind(n) for m in up) > 1]


def _kind(name: str) -> str:
    """'decode1' -> 'decode': instances of one kind differ in their trailing number."""
    return name.rstrip("0123456789")


def right_text_share(baseline, faulty) -> float:
    """Share of the faulty run's requests that finished with the baseline's text."""
    base = {r.index: r.text for r in baseline if r.ok}
    good = sum(1 for r in faulty if r.ok and r.index in base and r.text == base[r.index])
    return good / len(faulty) if faulty else 0.0
