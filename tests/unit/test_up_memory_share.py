"""`pdserve up`: engines on one host split one share of its memory (each budget printed), and
--no-prefix-caching reaches every engine."""

from pdserve.cli import build_parser
from pdserve.common.config import CacheConfig
from pdserve.services.launch_plans import engine_memory_share, plan_stack


def _engine_words(plan):
    return [s.child.argv for s in plan.steps if s.child.name.startswith(("prefill", "decode",
                                                                          "unified"))]


def _flag(words, name):
    return [words[i + 1] for i, w in enumerate(words) if w == name]


def test_engines_split_one_share_and_print_it(tmp_path):
    args = build_parser().parse_args(["up", "--model", "tiny", "--mode", "disagg", "--prefill",
                                      "2", "--decode", "1", "--no-prefix-caching"])
    plan = plan_stack(args, tmp_path, "", str(tmp_path / "secrets"))
    engines = _engine_words(plan)
    assert len(engines) == 3
    budgets = [int(b) for w in engines for b in _flag(w, "--memory-budget-bytes")]
    assert len(budgets) == 3 and len(set(budgets)) == 1
    from pdserve.common.kv.memory import available_memory_bytes
    # the three together take one share of the host, not three
    assert sum(budgets) <= available_memory_bytes("cpu") * CacheConfig.kv_cache_fraction * 1.05
    assert all("--no-prefix-caching" in w for w in engines)
    assert plan.layout.count("memory budget") == 3


def test_explicit_sizing_is_passed_through_not_split(tmp_path):
    for extra, flag in ((["--kv-cache-bytes", "1000000"], "--kv-cache-bytes"),
                        (["--memory-budget-bytes", "300000000"], "--memory-budget-bytes")):
        args = build_parser().parse_args(["up", "--model", "tiny", "--mode", "colocated",
                                          "--replicas", "2", "--discovery", "static", *extra])
        assert engine_memory_share(args, 2) is None
        engines = _engine_words(plan_stack(args, tmp_path, ""))
        assert [_flag(w, flag) for w in engines] == [[extra[1]]] * 2
        assert not any("--no-prefix-caching" in w for w in engines)
