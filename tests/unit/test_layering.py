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


def test_router_kvstore_and_cli_import_no_torch():
    """The router, the KV store and `pdserve --help` run without the engine: importing them must
    not pull torch in (it costs ~1.5 s and hundreds of MB per process)."""
    import subprocess
    import sys

    code = ("import sys, importlib\n"
            "for m in ('pdserve.services.router.server', 'pdserve.services.kvstore.cli',\n"
            "          'pdserve.services.kvstore.master_service', 'pdserve.services.cli_serve',\n"
            "          'pdserve.cli', 'pdserve.services.common.signals'):\n"
            "    importlib.import_module(m)\n"
            "heavy = [m for m in ('torch', 'pdserve.services.engine_host.async_engine')\n"
            "         if m in sys.modules]\n"
            "print(','.join(heavy))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
