"""Engine processes shorten libgomp's spin-wait (services/engine_host/omp_env.py) before torch
loads it, and leave a user's own OpenMP wait settings alone."""

import os

from pdserve.services import cli_serve
from pdserve.services.engine_host import engine_server
from pdserve.services.engine_host.omp_env import SPIN_COUNT, set_engine_omp_env


def test_sets_a_short_spin_count():
    env = {"PATH": "/bin"}
    assert set_engine_omp_env(env)
    assert env == {"PATH": "/bin", "GOMP_SPINCOUNT": str(SPIN_COUNT)}
    assert SPIN_COUNT < 300_000  # libgomp's default


def test_leaves_the_users_choice():
    for knob, value in (("GOMP_SPINCOUNT", "300000"), ("OMP_WAIT_POLICY", "active")):
        env = {knob: value}
        assert not set_engine_omp_env(env)
        assert env == {knob: value}


def test_the_engine_service_runs_with_it(monkeypatch):
    for knob in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):  # set first: teardown restores them
        monkeypatch.setenv(knob, "0")
        monkeypatch.delenv(knob)
    seen = {}

    async def fake_server(cfg):
        seen["spin"] = os.environ.get("GOMP_SPINCOUNT")

    monkeypatch.setattr(engine_server, "run_engine_server", fake_server)
    monkeypatch.setattr(cli_serve, "engine_service_config", lambda args: None)
    monkeypatch.setattr(cli_serve, "_setup_logging", lambda: None)
    assert cli_serve._run_engine(object()) == 0
    assert seen["spin"] == str(SPIN_COUNT)
