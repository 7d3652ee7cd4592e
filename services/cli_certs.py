"""`pdserve certs`: a private CA and per-role certificates for the internal plane's mutual TLS
(services/common/certs.py), in the folder layout every `--tls-dir` flag reads."""

from __future__ import annotations

import argparse

from pdserve.services.common.certs import CertSpec, complete, make_certs, split_words
from pdserve.services.common.kv_secrets import make_kv_secrets
from pdserve.services.common.redis_auth import make_redis_auth
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
    p.add_argument("--keep-existing", action="store_true",
                   help="leave a folder that already holds every file as it is (a stack's "
                        "init step: restarts keep their CA)")
    p.add_argument("--redis-url", default="", help="also make a Redis password: "
                   "redis.conf (requirepass) and redis-url (this URL with the password) in "
                   "--redis-auth-out; an existing pair is kept")
    p.add_argument("--redis-auth-out", default="", help="folder for those two files")
    p.add_argument("--kv-secrets-out", default="", help="also make the KV store's secrets "
                   "there: store-secret (master and nodes) and block-secret (engines and "
                   "router); existing ones are kept")
    p.set_defaults(func=_run_certs)


def _run_certs(args: argparse.Namespace) -> int:
    spec = CertSpec(roles=split_words([args.roles]), dns_names=split_words(args.dns),
                    ip_addresses=split_words(args.ip), days=args.days,
                    keep_ca_key=args.keep_ca_key)
    if bool(args.redis_url) != bool(args.redis_auth_out):
        raise ValueError("--redis-url and --redis-auth-out go together")
    if args.keep_existing and complete(args.out, spec.roles):
        print(f"{args.out}: certificates present, kept")
    else:
        for path in make_certs(args.out, spec):
            print(path)
    if args.redis_url:
        make_redis_auth(args.redis_auth_out, args.redis_url)
        print(f"{args.redis_auth_out}: redis.conf, redis-url")
    if args.kv_secrets_out:
        made = make_kv_secrets(args.kv_secrets_out, group_readable=True)
        print(f"{made.store}, {made.block}")
    return 0
