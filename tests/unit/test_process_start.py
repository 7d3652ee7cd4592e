"""The flaky-startup class stays gone: the test process and every service run gRPC, OpenMP and
oneDNN threads, and fork() in such a process runs their pthread_atfork handlers, which can
deadlock or break the child before exec. subprocess forks (instead of vfork) whenever a
`preexec_fn` is given, and multiprocessing forks by default on Linux. So no code of ours passes a
`preexec_fn`, and every multiprocessing context is "spawn"."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [p for p in ROOT.rglob("*.py")
           if ".venv" not in p.parts and "tests" not in p.relative_to(ROOT).parts[:1]]


def _calls(tree: ast.AST):
    return (n for n in ast.walk(tree) if isinstance(n, ast.Call))


def test_no_preexec_fn_anywhere():
    bad = [f"{p.relative_to(ROOT)}:{c.lineno}" for p in SOURCES
           for c in _calls(ast.parse(p.read_text()))
           if any(k.arg == "preexec_fn" for k in c.keywords)]
    assert bad == []


def test_multiprocessing_contexts_are_spawn():
    bad = []
    for p in SOURCES:
        for c in _calls(ast.parse(p.read_text())):
            name = getattr(c.func, "attr", getattr(c.func, "id", ""))
            if name in ("get_context", "set_start_method"):
                args = [a.value for a in c.args if isinstance(a, ast.Constant)]
                if args != ["spawn"]:
                    bad.append(f"{p.relative_to(ROOT)}:{c.lineno} {name}{tuple(args)}")
            if name == "Process" and getattr(c.func, "value", None) is not None and \
                    getattr(c.func.value, "id", "") in ("mp", "multiprocessing"):
                bad.append(f"{p.relative_to(ROOT)}:{c.lineno} default-context Process")
    assert bad == []
