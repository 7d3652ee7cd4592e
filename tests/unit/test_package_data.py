"""Every native source the package compiles at run time ships in a non-editable install (the
Docker image's `pip install /src`): pyproject's package-data matches each C/C++ source and
header under the packages, so no kernel build there fails for a missing file."""

import fnmatch
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository root is the `pdserve` package


def _package_dir(package: str) -> Path:
    return ROOT.joinpath(*package.split(".")[1:])


def test_package_data_covers_every_native_source():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    data = config["package-data"]
    assert set(data) <= set(config["packages"])
    shipped = {path for package, patterns in data.items() for pattern in patterns
               for path in _package_dir(package).glob(pattern)}
    sources = {path for top in ("client", "common", "connector", "services", "bench")
               for path in (ROOT / top).rglob("*") if path.suffix in (".c", ".cpp", ".h")}
    assert sources, "no native sources found: the test looks in the wrong place"
    missing = sorted(p.relative_to(ROOT).as_posix() for p in sources - shipped)
    assert not missing, f"native sources not in package-data: {missing}"
    assert fnmatch.filter([p.name for p in shipped], "nh.c")  # the block MAC's NH
