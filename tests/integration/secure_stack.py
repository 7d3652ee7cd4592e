"""`pdserve up`'s disaggregated stack with everything on, for the attacker suite: the plan
`pdserve up --mode disagg` builds (services/launch_plans.py: mutual TLS from a fresh CA, a Redis
password, the store and block secrets), plus API keys for two tenants, started in this
process's Supervisor (the tiny model, one prefill and one decode instance).

Lifecycle: `secure_stack(log_dir)` builds the plan, starts each step in order and waits for
both engines to be routed to -> the test attacks it -> on exit every child stops (router
first) and the run's secrets are removed, failure included.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.connector.kvstore.auth import BlockKeys, read_secret
from pdserve.services.cli_serve import add_subcommands
from pdserve.services.common.redis_auth import URL_FILE
from pdserve.services.common.tls_args import RunSecrets
from pdserve.services.launch_plans import plan_stack
from pdserve.services.launcher import Child, free_port
from pdserve.services.supervisor import Supervisor
from pdserve.tests.integration.disagg_helpers import metric

HOST = "127.0.0.1"
TENANTS = ("alpha", "beta")


def up_args(*extra: str) -> argparse.Namespace:
    """`pdserve up ...` parsed by its own parser (nothing started)."""
    parser = argparse.ArgumentParser()
    add_subcommands(parser.add_subparsers())
    return parser.parse_args(["up", *extra])


def flag(child: Child, name: str) -> str:
    """The word after `name` on a planned child's command line."""
    return child.argv[child.argv.index(name) + 1]


@dataclass
class SecureStack:
    http_url: str
    grpc_addr: str  # the router's gRPC API
    master: str
    engines: dict[str, str]  # prefill0 / decode0 -> address
    tls_dir: str
    secret_dir: str
    keys: dict[str, str]  # tenant -> API key
    tenant_secret: bytes
    block_keys: BlockKeys
    children: dict[str, Child] = field(default_factory=dict)

    def auth(self, tenant: str = TENANTS[0]) -> dict:
        return {"Authorization": f"Bearer {self.keys[tenant]}"}

    @property
    def redis_url(self) -> str:
        """redis://:password@host:port/0 (what only the stack's services hold)."""
        return (Path(self.secret_dir) / "redis" / URL_FILE).read_text().strip()

    def routed(self) -> bool:
        """The router sees both engines up."""
        return all(metric(self.http_url, "pdserve_instance_up", f'instance="{a}"') == 1
                   for a in self.engines.values())


def _wait(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {timeout_s:.0f}s")
        time.sleep(0.2)


@contextlib.contextmanager
def secure_stack(log_dir: Path):
    log_dir.mkdir(parents=True, exist_ok=True)
    keys = {t: secrets.token_hex(16) for t in TENANTS}
    key_file, tenant_file = log_dir / "api-keys", log_dir / "tenant-secret"
    key_file.write_text("".join(f"{k} tenant={t}\n" for t, k in keys.items()))
    tenant_file.write_text(secrets.token_hex(32))
    hp, gp = free_port(HOST), free_port(HOST)
    args = up_args("--mode", "disagg", "--model", "tiny", "--port", str(hp),
                   "--grpc-port", str(gp), "--num-blocks", "64", "--max-model-len", "256",
                   "--kv-transport", "tcp", "--kv-capacity-mib", "32",
                   "--router-arg=--api-key-file", f"--router-arg={key_file}",
                   "--router-arg=--tenant-secret-file", f"--router-arg={tenant_file}",
                   "--router-arg=--health-interval", "--router-arg=0.3")
    run = RunSecrets(insecure=False)  # what `pdserve up` makes: a fresh CA, Redis password
    sup = None
    try:
        plan = plan_stack(args, log_dir, run.tls_dir, run.dir)
        by_name = {s.child.name: s.child for s in plan.steps}
        engines = {n: f"{HOST}:{flag(c, '--port')}" for n, c in by_name.items()
                   if n in ("prefill0", "decode0")}
        stack = SecureStack(
            f"http://{HOST}:{hp}", f"{HOST}:{gp}",
            f"{HOST}:{flag(by_name['kvstore'], '--port')}", engines, run.tls_dir, run.dir,
            keys, read_secret(str(tenant_file)),
            BlockKeys.from_secret(read_secret(flag(by_name["router"],
                                                   "--kv-block-secret-file"))),
            by_name)
        sup = Supervisor(plan.steps, out=io.StringIO(), startup_timeout_s=120)
        sup.start_all(threading.Event())
        _wait(stack.routed, 30, "both engines routed to")
        yield stack
    finally:
        for child in reversed(sup.started if sup is not None else []):
            child.stop(10.0)
        run.close()
