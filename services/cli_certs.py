"""`pdserve certs`: a private CA and per-role certificates for the internal plane's mutual TLS
(services/common/certs.py), in the folder layout every `--tls-dir` flag reads."""

from __future__ import annotations

import argparse

from pdserve.services.common.certs import CertSpec, make_certs, split_words
from pdserve.services.common.tls import ROLES


def add_certs_subcommand(subparsers) -> None:
    p = subparsers.add_parser("certs", help="make a CA and per-role certificates (mTLS)")
    p.add_argument("--out", required=True, help="folder to write (created 0700 if missing)")
    p.add_argument("--dns", action="append", default=[],
                   help="extra DNS SAN on every certificate (repeat or comma-separate): "
                        "Service names, hostnames")
    p.add_argument("--ip", action="append", default=[], help="extra IP SAN (repeatable)")
    p.add_argument("--roles", default=",".join(ROLES), help="comma-separated subset of "
                   + ", ".join(ROLES))
    p.add_argument("--days", type=int, default=CertSpec.days, help="validity")
    p.add_argument("--keep-ca-key", action="store_true",
                   help="also write ca-key.pem (keep it out of every service's mount)")
    p.set_defaults(func=_run_certs)


def _run_certs(args: argparse.Namespace) -> int:
    spec = CertSpec(roles=split_words([args.roles]), dns_names=split_words(args.dns),
                    ip_addresses=split_words(args.ip), days=args.days,
                    keep_ca_key=args.keep_ca_key)
    for path in make_certs(args.out, spec):
        print(path)
    return 0
