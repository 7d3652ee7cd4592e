"""The `--tls-*` flags every gRPC service and client shares, and the TlsConfig they make.

`--tls-dir DIR` names the folder `pdserve certs` writes (DIR/ca.pem, DIR/<role>.pem,
DIR/<role>-key.pem, the role being the service's); `--tls-ca/--tls-cert/--tls-key` name files
one by one and win over the folder. None of them: plaintext.
"""

from __future__ import annotations

import argparse

from pdserve.services.common.private_dir import PrivateRunDir
from pdserve.services.common.tls import TlsConfig


def add_tls_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("mutual TLS on the internal gRPC plane (default: plaintext)")
    g.add_argument("--tls-dir", default="", help="folder from `pdserve certs`: ca.pem, "
                   "<role>.pem, <role>-key.pem (this service's role)")
    g.add_argument("--tls-ca", default="", help="CA bundle peers must chain to")
    g.add_argument("--tls-cert", default="", help="this process's certificate (PEM)")
    g.add_argument("--tls-key", default="", help="its private key (PEM)")


def tls_from_args(args, role: str) -> TlsConfig:
    base = TlsConfig.from_dir(args.tls_dir, role) if args.tls_dir else TlsConfig()
    return TlsConfig(ca=args.tls_ca or base.ca, cert=args.tls_cert or base.cert,
                     key=args.tls_key or base.key)


def tls_argv(tls_dir: str) -> list[str]:
    """The words that turn mutual TLS on for a child service (`pdserve up`)."""
    return ["--tls-dir", tls_dir] if tls_dir else []


class RunSecrets:
    """`pdserve up`'s secrets, in a new private folder (0700) that `close()` removes, and that
    the next run removes if this one was killed first (services/common/private_dir.py): a fresh
    CA and per-role certificates (the code of `pdserve certs`) in `tls_dir` ("" with
    `insecure`; `given_tls_dir` when one is given, which stays), and room for the run's Redis
    password (services/common/redis_auth.py)."""

    def __init__(self, insecure: bool, given_tls_dir: str = ""):
        if insecure and given_tls_dir:
            raise ValueError("--insecure and --tls-dir contradict each other")
        self._dir = PrivateRunDir("pdserve-secrets-")
        self.dir = self._dir.path
        self.tls_dir = given_tls_dir
        if not insecure and not given_tls_dir:
            from pdserve.services.common.certs import make_certs

            self.tls_dir = f"{self.dir}/tls"
            make_certs(self.tls_dir)

    def close(self) -> None:
        self._dir.close()
