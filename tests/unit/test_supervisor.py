"""The launcher's supervisor with stand-in services: each is started and reported ready in
order; one that is SIGKILLed is restarted after its backoff while the other keeps running;
backoff doubles and resets after a long run; services.json follows the pids and
services_ready.json the services that are ready."""

import io
import json
import os
import signal
import sys
import threading
import time

import pytest

from pdserve.services.launcher import Child, Step
from pdserve.services.supervisor import Backoff, Supervisor

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def test_backoff_doubles_caps_and_resets():
    b = Backoff(0.5, 2.0, 30.0)
    assert [b.after_run(1.0) for _ in range(4)] == [0.5, 1.0, 2.0, 2.0]
    assert b.after_run(31.0) == 0.5
    with pytest.raises(ValueError):
        Backoff(0.0)


def test_a_killed_service_is_restarted_and_the_other_keeps_running(tmp_path):
    alpha_ready = threading.Event()
    alpha_ready.set()
    steps = [Step(Child(n, SLEEPER, tmp_path), ready, lambda: "budget line")
             for n, ready in (("alpha", alpha_ready.is_set), ("beta", lambda: True))]
    out = io.StringIO()
    sup = Supervisor(steps, out=out, backoff=Backoff(0.1, 1.0, 30.0))
    stop = threading.Event()
    try:
        sup.start_all(stop)
        pids = json.loads((tmp_path / "services.json").read_text())
        assert pids == {"alpha": steps[0].child.proc.pid, "beta": steps[1].child.proc.pid}
        assert _ready(tmp_path) == ["alpha", "beta"]
        watcher = threading.Thread(target=sup.watch, args=(stop, 0.02))
        watcher.start()
        beta = steps[1].child.proc.pid
        alpha_ready.clear()
        os.kill(steps[0].child.proc.pid, signal.SIGKILL)
        _wait_for(out, "alpha        restarting (restart 1)")
        assert _ready(tmp_path) == ["beta"]  # alpha is not serving until its check passes
        alpha_ready.set()
        _wait_for(out, "alpha        ready again")
        assert _ready(tmp_path) == ["alpha", "beta"]
        stop.set()
        watcher.join(10)
        text = out.getvalue()
        assert "alpha        exited (code -9); restarting in 0.1s" in text
        assert "alpha        ready again" in text and "; budget line" in text
        assert steps[0].child.alive and sup.restarts("alpha") == 1
        assert steps[1].child.proc.pid == beta and sup.restarts("beta") == 0
        assert json.loads((tmp_path / "services.json").read_text())["alpha"] == \
            steps[0].child.proc.pid
    finally:
        for s in steps:
            s.child.stop(5)


def _ready(folder) -> list:
    return json.loads((folder / "services_ready.json").read_text())


def _wait_for(out: io.StringIO, line: str) -> None:
    deadline = time.monotonic() + 20
    while line not in out.getvalue():
        assert time.monotonic() < deadline, f"never printed {line!r}: {out.getvalue()}"
        time.sleep(0.02)
