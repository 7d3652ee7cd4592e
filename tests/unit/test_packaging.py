"""pyproject's explicit package list names every package of the tree, so a non-editable
install (the Docker image) ships all of them."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SKIP = {".venv", "tests", "deploy", ".git", "scripts", "proto"}


def test_every_package_is_listed():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())
                 ["tool"]["setuptools"]["packages"])
    found = set()
    for init in ROOT.rglob("__init__.py"):
        rel = init.parent.relative_to(ROOT)
        if rel.parts and rel.parts[0] in SKIP:
            continue
        found.add(".".join(("pdserve",) + rel.parts))
    assert found - listed == set(), "add these to [tool.setuptools] packages"
    assert listed - found == set(), "these are listed but do not exist"
    assert all(re.fullmatch(r"pdserve(\.\w+)*", p) for p in listed)

