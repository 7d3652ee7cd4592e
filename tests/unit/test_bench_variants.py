"""bench/variants.sh: the variants of a vllm_reference.sh hold, and a variant served from another
checkout (NAME@TREE), whose package must win over the editable install's."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VARIANTS_SH = ROOT / "bench" / "variants.sh"


def _bash(script: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f'set -euo pipefail; source "{VARIANTS_SH}"; {script}'],
                          capture_output=True, text=True, env=env, timeout=60)


def _tree(path: Path, marker: str) -> Path:
    """A stand-in checkout: a package root holding __init__.py and cli.py."""
    path.mkdir(parents=True)
    (path / "__init__.py").write_text(f"MARKER = {marker!r}\n")
    (path / "cli.py").write_text("")
    return path


def test_parse_keeps_order_flags_and_trees(tmp_path):
    base = _tree(tmp_path / "base", "base")
    r = _bash(f'parse_variants "before@{base}=--weights fp32 --x 1;after=--weights packed"; '
              'printf "%s|" "${NAMES[@]}"; echo; printf "%s|" "${FLAGS[@]}"; echo; '
              'printf "%s|" "${TREES[@]}"; echo')
    assert r.returncode == 0, r.stderr
    names, flags, trees = r.stdout.splitlines()
    assert names == "before|after|"
    assert flags == "--weights fp32 --x 1|--weights packed|"
    assert trees == f"{base}||"


def test_bad_specs_exit_2_with_a_reason(tmp_path):
    for spec, reason in [("vllm=--weights fp32", "bad variant name"),
                         ("a b=--weights fp32", "bad variant name"),
                         (f"old@{tmp_path}=--weights fp32", "not a pdserve checkout")]:
        r = _bash(f'parse_variants "{spec}"; echo parsed')
        assert r.returncode == 2 and reason in r.stderr and "parsed" not in r.stdout, spec


def test_tree_variant_imports_the_tree_not_the_installed_package(tmp_path):
    tree = _tree(tmp_path / "old checkout", "old")
    env = {**os.environ, "PYTHONPATH": "/already/there"}
    r = _bash(f'variant_pythonpath "{tmp_path / "out"}" before "{tree}"', env)
    assert r.returncode == 0, r.stderr
    path = r.stdout.strip()
    assert path == f"{tmp_path / 'out' / 'before-pkg'}:/already/there"
    assert (tmp_path / "out" / "before-pkg" / "pdserve").resolve() == tree.resolve()
    # the interpreter the hold runs (this venv's, pdserve installed editable) imports the tree
    got = subprocess.run([sys.executable, "-c", "import pdserve; print(pdserve.MARKER)"],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": path}, cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == "old"
