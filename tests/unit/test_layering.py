"""Dependencies point down (DESIGN.md): services -> connector -> common. common never imports
connector or services; connector never imports services; the router reaches engines only over
gRPC (it may use shared types, never the engine, model or KV code)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROUTER_MAY_USE = ("pdserve.common.engine.outputs", "pdserve.common.sampling_params",
                  "pdserve.common.config")


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def offenders(folder: str, forbidden: tuple[str, ...], allowed: tuple[str, ...] = ()):
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for mod in imports(path):
            if mod.startswith(forbidden) and not mod.startswith(allowed):
                bad.append(f"{path.relative_to(ROOT)} imports {mod}")
    return bad


def test_common_imports_neither_connector_nor_services():
    assert offenders("common", ("pdserve.connector", "pdserve.services")) == []


def test_connector_does_not_import_services():
    assert offenders("connector", ("pdserve.services",)) == []


def test_router_does_not_import_engine_code():
    forbidden = ("pdserve.common.engine", "pdserve.common.models.llama",
                 "pdserve.common.kv.kv_cache_manager",
                 "pdserve.common.attention", "pdserve.services.decode", "pdserve.services.prefill")
    assert offenders("services/router", forbidden, ROUTER_MAY_USE) == []
