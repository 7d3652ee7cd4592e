"""The committed generated modules in common/rpc must match what proto/*.proto generates."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RPC = ROOT / "common" / "rpc"
# Lines that name the generator's version: a newer grpcio-tools changes them, not the API.
_VERSION_LINE = re.compile(r"Protobuf Python Version|GRPC_GENERATED_VERSION = |^\s+\d+,$")


def _normalized(path: Path) -> list[str]:
    return [ln for ln in path.read_text().splitlines() if not _VERSION_LINE.search(ln)]


def test_generated_modules_are_fresh(tmp_path):
    pytest.importorskip("grpc_tools")
    subprocess.run(["bash", str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)],
                   check=True, env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"})
    fresh = sorted(p.name for p in tmp_path.iterdir() if p.is_file())
    committed = sorted(p.name for p in RPC.iterdir() if "_pb2" in p.name)
    assert fresh == committed, "run `make proto` and commit common/rpc"
    protos = list((ROOT / "proto").glob("*.proto"))
    assert {"engine.proto", "router.proto"} <= {p.name for p in protos}
    assert len(fresh) == 3 * len(protos)  # each: _pb2.py, _pb2.pyi, _pb2_grpc.py
    for name in fresh:
        assert _normalized(tmp_path / name) == _normalized(RPC / name), (
            f"common/rpc/{name} is stale: run `make proto` and commit it")


def test_generated_modules_import_as_a_package():
    from pdserve.common.rpc import engine_pb2, router_pb2, router_pb2_grpc  # noqa: F401

    req = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[1, 2]))
    assert req.WhichOneof("input") == "token_ids"
    assert not req.params.HasField("temperature")  # optional fields tell unset from zero
    assert engine_pb2.FINISH_REASON_UNSPECIFIED == 0
