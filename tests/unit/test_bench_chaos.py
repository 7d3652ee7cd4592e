"""bench serve's fault injection: kills come from the launcher's services.json, only of the
kinds asked for; the right-text share compares with the run without faults."""

import json
import subprocess
import sys
import time

from pdserve.bench.chaos import Chaos, ChaosConfig, right_text_share
from pdserve.bench.record import RequestRecord


def test_kills_only_the_kinds_asked_for(tmp_path):
    victims = {name: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
               for name in ("decode0", "router")}
    path = tmp_path / "services.json"
    path.write_text(json.dumps({n: p.pid for n, p in victims.items()}))
    try:
        chaos = Chaos(ChaosConfig(str(path), 0.05, ("decode",), keep_one_ready=False)).start()
        deadline = time.monotonic() + 10
        while victims["decode0"].poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        kills = chaos.stop()
        assert victims["decode0"].poll() is not None and "decode0" in kills
        assert victims["router"].poll() is None and "router" not in kills
    finally:
        for p in victims.values():
            p.kill()
            p.wait()


def test_never_a_restarting_one_nor_the_last_ready_of_its_kind(tmp_path):
    names = ["decode0", "decode1", "decode2", "prefill0"]
    (tmp_path / "services.json").write_text(json.dumps({n: 1 for n in names}))
    chaos = Chaos(ChaosConfig(str(tmp_path / "services.json"), 30.0, ("decode", "prefill")))
    ready = tmp_path / "services_ready.json"
    ready.write_text(json.dumps(names))  # prefill0 is its kind's only one
    assert chaos._victims(names) == ["decode0", "decode1", "decode2"]
    ready.write_text(json.dumps(["decode0", "decode2", "prefill0"]))  # decode1 restarting
    assert chaos._victims(names) == ["decode0", "decode2"]
    ready.write_text(json.dumps(["decode2", "prefill0"]))  # the last ready decode stays
    assert chaos._victims(names) == []


def _rec(i, text, error=None):
    return RequestRecord(i, "t", 0.0, 1.0, 0.1, (), 3, 2, error, None, text)


def test_right_text_share():
    base = [_rec(0, "ab"), _rec(1, "cd"), _rec(2, "ef")]
    faulty = [_rec(0, "ab"), _rec(1, "cx"), _rec(2, "", error="boom")]
    assert right_text_share(base, faulty) == 1 / 3
