"""`pdserve up --side-cpus`: redis, the KV store and the router stay off the cores a decode or
unified engine is pinned to (auto), go where told, or stay unpinned ("any", or when the
engines hold every core); engines keep their own cores."""

import pytest

from pdserve.cli import build_parser
from pdserve.services import launch_plans
from pdserve.services.launch_plans import plan_stack

SIDE = ("redis", "kvstore", "router")


def _plan(tmp_path, monkeypatch, cores, *extra):
    monkeypatch.setattr(launch_plans.os, "sched_getaffinity", lambda _pid: set(cores))
    args = build_parser().parse_args(["up", "--model", "tiny", "--num-blocks", "64", *extra])
    return plan_stack(args, tmp_path, "", str(tmp_path / "secrets"))


def _pins(plan) -> dict[str, str]:
    """name -> the cores its command line pins it to ("" when not pinned)."""
    return {s.child.name: s.child.argv[2] if s.child.argv[0] == "taskset" else ""
            for s in plan.steps}


def test_auto_keeps_side_processes_off_the_decode_core(tmp_path, monkeypatch):
    plan = _plan(tmp_path, monkeypatch, {0, 1, 2, 3}, "--mode", "disagg",
                 "--prefill-cpus", "0", "--decode-cpus", "1,2")
    pins = _pins(plan)
    assert pins["prefill0"] == "0" and pins["decode0"] == "1,2"
    assert all(pins[n] == "0,3" for n in SIDE), pins
    assert "router     " in plan.layout and "cores 0,3" in plan.layout


def test_auto_follows_the_engines_own_pinning(tmp_path, monkeypatch):
    """No explicit cores: each engine gets one (prefill first), the rest stay off decode's."""
    pins = _pins(_plan(tmp_path, monkeypatch, {0, 1}, "--mode", "disagg"))
    assert pins["prefill0"] == "0" and pins["decode0"] == "1"
    assert all(pins[n] == "0" for n in SIDE), pins


@pytest.mark.parametrize("extra", [("--mode", "colocated", "--cpus", "0,1"),
                                   ("--mode", "colocated"),
                                   ("--mode", "disagg", "--side-cpus", "any",
                                    "--decode-cpus", "1")])
def test_unpinned_when_engines_hold_every_core_or_when_asked(tmp_path, monkeypatch, extra):
    pins = _pins(_plan(tmp_path, monkeypatch, {0, 1}, *extra))
    present = [n for n in SIDE if n in pins]
    assert present and all(pins[n] == "" for n in present), pins


def test_explicit_cores_are_taken_as_given_and_checked(tmp_path, monkeypatch):
    pins = _pins(_plan(tmp_path, monkeypatch, {0, 1}, "--mode", "disagg", "--side-cpus", "1"))
    assert all(pins[n] == "1" for n in SIDE) and pins["decode0"] == "1"
    with pytest.raises(ValueError, match="core list"):
        _plan(tmp_path, monkeypatch, {0, 1}, "--mode", "disagg", "--side-cpus", "0;1")
