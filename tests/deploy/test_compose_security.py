"""deploy/compose's security, checked without a Docker engine: the secrets step makes the
certificates and Redis's password into their own volumes; every engine and the router run
mutual TLS with the mounted certificates (health checks too), the KV store included, which
also gets the store secret while the engines and the router get the block secret; Redis reads its password from the
config file and the KV store its URL from a file, so no command or environment holds a secret;
pdserve containers have read-only root filesystems; only the router is published."""

import json

from pdserve.tests.deploy.test_compose import (COMPOSE, PDSERVE_SERVICES, SCALE, load_compose,
                                               merge_override, parse)

TLS = "/etc/pdserve/tls"
AUTH = "/etc/pdserve/redis-auth"


def test_engines_and_router_run_mutual_tls_with_the_mounted_certificates():
    merged = merge_override(load_compose(), load_compose(SCALE), COMPOSE.parent)
    svcs = merged["services"]
    secrets = parse(svcs["secrets"]["command"])
    assert secrets.out == TLS and secrets.keep_existing
    names = set(secrets.dns.pop().split(","))  # every engine host name is in the certificates
    store_checked = False
    for name, svc in svcs.items():
        if name == "secrets" or "command" not in svc or name not in {
                *PDSERVE_SERVICES, "prefill-2", "decode-2"}:
            continue
        args = parse(svc["command"])
        assert args.tls_dir == TLS, name
        assert f"pdserve-tls:{TLS}:ro" in svc["volumes"], name
        if args.service in ("decode", "prefill", "kvstore"):
            test = svc["healthcheck"]["test"]
            assert test[test.index("--tls-dir") + 1] == TLS, name
        if args.service in ("decode", "prefill"):
            assert name in names
        if args.service == "kvstore":  # the secrets step writes both under TLS/kv
            assert args.store_secret_file == f"{TLS}/kv/store-secret"
            store_checked = True
        elif args.kv_store:
            assert args.kv_block_secret_file == f"{TLS}/kv/block-secret", name
    assert store_checked and secrets.kv_secrets_out == f"{TLS}/kv"
    assert svcs["secrets"]["restart"] == "no"
    for name in ("redis",):
        assert svcs[name]["depends_on"]["secrets"]["condition"] == \
            "service_completed_successfully"


def test_no_secret_on_any_command_line_or_environment():
    svcs = load_compose()["services"]
    redis = svcs["redis"]
    assert redis["command"][:2] == ["redis-server", f"{AUTH}/redis.conf"]
    assert f"redis-auth:{AUTH}:ro" in redis["volumes"] and "10001" in redis["group_add"]
    kv = svcs["kvstore"]["command"]
    assert kv[kv.index("--redis-url") + 1] == f"@{AUTH}/redis-url"
    assert f"redis-auth:{AUTH}:ro" in svcs["kvstore"]["volumes"]
    for name, svc in svcs.items():
        text = json.dumps([svc.get("command", []), svc.get("environment", {})])
        assert "requirepass" not in text and ":@" not in text and "password" not in text, name
    for name in PDSERVE_SERVICES + ("kvstore",):
        if name == "secrets":
            continue
        assert svcs[name]["read_only"] is True and svcs[name]["tmpfs"] == ["/tmp"], name
    published = {n for n, s in svcs.items() if s.get("ports") and "profiles" not in s}
    assert published == {"router"}
