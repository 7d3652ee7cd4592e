"""deploy/compose checked without a Docker engine.

- The compose files (as written, and interpolated with their defaults, and merged with the
  scale override) validate against the Compose Specification's JSON schema (vendored in
  tests/data/compose-spec/).
- Every `${VAR}` they use is in .env.example with the same default, and nothing else is there.
- Every service command parses with `pdserve.cli.build_parser()`; the ports in the commands,
  the published ports and the health checks are the same ones, and each port's default is the
  CLI's own default; the router's health path is a route the router really serves.
- Discovery: every engine registers in the Redis the secrets step protects, with the password
  from that step's file, and the router watches the same registry; static lists are optional.
- depends_on uses service_healthy on services that have a health check; named volumes only
  where state lives; Prometheus scrapes the router and every engine's metrics port, and Grafana
  is provisioned with the dashboard.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import yaml

from pdserve.tests.deploy.compose_files import (COMPOSE, COMPOSE_DIR, PDSERVE_SERVICES, SCALE,
                                                SCHEMA,
                                                cli_default, env_example, healthcheck_parser,
                                                interpolate, load_compose, merge_override,
                                                parse, serve_args, variables_with_defaults)


# ---------------------------------------------------------------- schema


@pytest.fixture(scope="module")
def validator():
    schema = json.loads(SCHEMA.read_text())
    assert "draft/2019-09" in schema["$schema"]
    jsonschema.Draft201909Validator.check_schema(schema)
    return jsonschema.Draft201909Validator(schema)


def _assert_valid(validator, doc, what):
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.path))
    assert not errors, f"{what}: " + "; ".join(
        f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors[:5])


def test_compose_files_validate_against_compose_spec(validator):
    raw = yaml.safe_load(COMPOSE.read_text())
    _assert_valid(validator, raw, "docker-compose.yml as written")
    base = load_compose()
    _assert_valid(validator, base, "docker-compose.yml interpolated with defaults")
    _assert_valid(validator, load_compose(env=env_example()), "with .env.example")
    scale = yaml.safe_load(SCALE.read_text())
    _assert_valid(validator, scale, "docker-compose.scale.yml as written")
    merged = merge_override(base, load_compose(SCALE), COMPOSE_DIR)
    _assert_valid(validator, merged, "docker-compose.yml + docker-compose.scale.yml")


def test_schema_catches_a_broken_file(validator):
    """The schema is strict enough to matter: a typo'd key or a bad depends_on fails."""
    doc = load_compose()
    doc["services"]["router"]["helthcheck"] = doc["services"]["router"].pop("healthcheck")
    assert list(validator.iter_errors(doc))
    doc = load_compose()
    doc["services"]["router"]["depends_on"]["kvstore"]["condition"] = "healthy"
    assert list(validator.iter_errors(doc))


# ---------------------------------------------------------------- variables


def test_env_example_lists_exactly_the_variables_with_the_same_defaults():
    text = COMPOSE.read_text() + SCALE.read_text()
    used = variables_with_defaults(text)
    example = env_example()
    assert set(example) == set(used), (
        f"only in compose: {sorted(set(used) - set(example))}; "
        f"only in .env.example: {sorted(set(example) - set(used))}")
    for name, defaults in used.items():
        assert defaults == {example[name]}, f"{name}: compose defaults {defaults}, " \
                                            f".env.example {example[name]!r}"


def test_interpolation_follows_compose_rules():
    env = {"A": "x", "EMPTY": ""}
    assert interpolate("${A:-d}", env) == "x"
    assert interpolate("${EMPTY:-d}", env) == "d"
    assert interpolate("${EMPTY-d}", env) == ""
    assert interpolate("${B:-a:${A:-z}}", env) == "a:x"
    assert interpolate("$$A ${A}", env) == "$A x"
    with pytest.raises(ValueError):
        interpolate("${B:?needed}", env)


# ---------------------------------------------------------------- commands, ports, health

PORT_FLAGS = {  # service -> (env var, CLI service, CLI flag)
    "router": [("ROUTER_PORT", "router", "--port"), ("ROUTER_GRPC_PORT", "router", "--grpc-port")],
    "decode": [("DECODE_PORT", "decode", "--port")],
    "prefill": [("PREFILL_PORT", "prefill", "--port")],
    "kvstore": [("KVSTORE_PORT", "kvstore", "--port")],
}


def test_every_service_command_parses_with_the_pdserve_cli():
    for path, doc in ((COMPOSE, load_compose()), (SCALE, load_compose(SCALE))):
        for name, svc in doc["services"].items():
            if "command" not in svc or svc.get("image", "").startswith(("redis", "otel", "prom")):
                continue
            if name == "secrets":
                assert parse(svc["command"]).command == "certs"
                continue
            args = parse(serve_args(svc["command"]))
            assert args.command == "serve" and callable(args.func), (path.name, name)


def test_port_defaults_are_the_cli_defaults():
    example = env_example()
    for service, ports in PORT_FLAGS.items():
        for var, cli_service, flag in ports:
            want = cli_default(cli_service, flag)
            assert int(example[var]) == want, f"{var}={example[var]} but `pdserve serve " \
                                              f"{cli_service}` defaults {flag} to {want}"
    assert example["PDSERVE_MODEL"] == cli_default("decode", "--model")
    assert example["MAX_MODEL_LEN"] == str(cli_default("decode", "--max-model-len"))
    assert example["MAX_NUM_SEQS"] == str(cli_default("decode", "--max-num-seqs"))
    assert example["ENGINE_THREADS"] == str(cli_default("decode", "--num-threads"))
    assert example["KVSTORE_CAPACITY_MIB"] == str(cli_default("kvstore", "--capacity-mib"))
    # registry discovery by default: no static lists
    assert example["ROUTER_BACKENDS"] == example["ROUTER_PREFILL_BACKENDS"] == ""
    # pinned, not the CLI's "auto": auto resolves per host (UCX only with a GPU), and the
    # CPU store node and GPU engines must speak the same transport
    assert example["KV_TRANSPORT"] == "tcp"
    assert cli_default("decode", "--kv-transport") == cli_default("kvstore", "--transport")


@pytest.mark.parametrize("env", [{}, {"ROUTER_PORT": "18000", "DECODE_PORT": "15061",
                                      "PREFILL_PORT": "15071", "KVSTORE_PORT": "15090",
                                      "REDIS_PORT": "16379",
                                      "ROUTER_GRPC_PORT": "15051"}],
                         ids=["defaults", "remapped"])
def test_commands_published_ports_and_health_checks_name_the_same_ports(env):
    """Change a port variable and every place that names that port follows it."""
    doc = load_compose(env=env)
    svcs = doc["services"]
    hc = healthcheck_parser()
    routes = _router_routes()
    for name in PDSERVE_SERVICES:
        svc = svcs[name]
        args = parse(serve_args(svc["command"]))
        test = svc["healthcheck"]["test"]
        assert test[0] == "CMD" and test[1] == "pdserve-healthcheck", (name, test)
        mode = test[2]
        if args.service == "router":
            assert mode == "http"
            url = test[3]
            m = re.match(r"http://127\.0\.0\.1:(\d+)(/\S*)$", url)
            assert m and int(m.group(1)) == args.port, (url, args.port)
            assert m.group(2) in routes and "GET" in routes[m.group(2)], m.group(2)
            store = parse(svcs["kvstore"]["command"])
            assert args.kv_store == f"kvstore:{store.port}"
            published = {p.split(":")[-1]: p.split(":")[0] for p in svc["ports"]}
            assert published == {str(args.port): str(args.port),
                                 str(args.grpc_port): str(args.grpc_port)}
        elif args.service in ("decode", "prefill"):
            assert mode == "engine"
            assert test[3] == f"127.0.0.1:{args.port}"
            assert test[test.index("--role") + 1] == args.role
            assert "ports" not in svc  # engines are reached inside the compose network only
            store = parse(svcs["kvstore"]["command"])
            assert args.kv_store == f"kvstore:{store.port}"
            assert args.kv_transport == store.transport
            assert args.role == ("prefill" if args.service == "prefill" else "decode")
        elif args.service == "kvstore":
            assert mode == "kvstore-master"
            assert test[3] == f"{args.host}:{args.port}"
            # the URL is the file the secrets step writes, made from its --redis-url
            cmd = svc["command"]
            assert cmd[cmd.index("--redis-url") + 1] == "@/etc/pdserve/redis-auth/redis-url"
            secrets = parse(svcs["secrets"]["command"])
            assert secrets.redis_auth_out == "/etc/pdserve/redis-auth"
            redis_port = int(re.search(r":(\d+)/", secrets.redis_url).group(1))
            assert redis_port == int(env.get("REDIS_PORT", 6379))
        else:
            pytest.fail(f"unexpected service {args.service}")
        hc.build_arg_parser().parse_args(test[2:])  # and the check's own argv parses
    redis = svcs["redis"]
    assert redis["command"][redis["command"].index("--port") + 1] == env.get("REDIS_PORT", "6379")
    test = redis["healthcheck"]["test"]
    assert test[0] == "CMD-SHELL" and f"redis-cli -p {env.get('REDIS_PORT', '6379')} ping" in test[1]


REDIS_URL_FILE = "@/etc/pdserve/redis-auth/redis-url"  # the secrets step writes it


def _engines(doc: dict) -> dict:
    return {n: parse(svc["command"]) for n, svc in doc["services"].items()
            if svc.get("command", [""])[0] == "serve"
            and svc["command"][1] in ("prefill", "decode")}


def test_discovery_is_the_registry_by_default():
    """Every engine registers in the Redis the secrets step protects (the URL with the
    password, from its file) and the router watches that registry; no static lists."""
    base = load_compose()
    merged = merge_override(base, load_compose(SCALE), COMPOSE_DIR)
    secrets = parse(base["services"]["secrets"]["command"])
    for doc in (base, merged):
        cmd = doc["services"]["router"]["command"]
        assert cmd[cmd.index("--registry") + 1] == REDIS_URL_FILE
        router = parse(cmd)
        # the file holds the secrets step's URL with the password added (compose_files)
        assert router.registry.replace(":pw@", "") == secrets.redis_url
        assert router.backends == router.prefill_backends == ""  # nothing listed statically
        assert router.kv_store  # registry + store: disaggregated
        engines = _engines(doc)
        assert {"prefill", "decode", "prefill-gpu", "decode-gpu"} <= set(engines)
        for name, engine in engines.items():
            ecmd = doc["services"][name]["command"]
            assert ecmd[ecmd.index("--registry") + 1] == REDIS_URL_FILE, name
            # the container's own address is advertised (0.0.0.0 is replaced by it), so a
            # scaled service's instances register one by one
            assert engine.host == "0.0.0.0" and engine.advertise_address == "", name
            vols = doc["services"][name]["volumes"]
            assert "redis-auth:/etc/pdserve/redis-auth:ro" in vols, name
    assert {"prefill-2", "decode-2"} <= set(_engines(merged))
    assert "router" not in load_compose(SCALE)["services"]  # the router needs no edit


def test_static_lists_stay_an_option():
    doc = load_compose(env={"ROUTER_BACKENDS": "decode:50061,decode-2:50061",
                            "ROUTER_PREFILL_BACKENDS": "prefill:50071"})
    router = parse(doc["services"]["router"]["command"])
    assert router.backends == "decode:50061,decode-2:50061"
    assert router.prefill_backends == "prefill:50071"
    assert router.registry  # both: the lists and whatever registers


def test_health_and_dependencies():
    doc = load_compose()
    svcs = doc["services"]
    for name, svc in svcs.items():
        for dep, cond in svc.get("depends_on", {}).items():
            assert dep in svcs, (name, dep)
            if dep == "secrets":  # a one-shot step: done, not healthy
                assert cond["condition"] == "service_completed_successfully", name
                continue
            assert cond["condition"] == "service_healthy", (name, dep)
            assert "healthcheck" in svcs[dep], f"{name} waits for {dep}, which has no check"
    assert svcs["kvstore"]["depends_on"] == {"redis": {"condition": "service_healthy"}}
    for engine in ("prefill", "decode", "router"):
        assert "kvstore" in svcs[engine]["depends_on"]
    # the profiles: CPU stack by default, CUDA and observability opt-in
    assert {n for n, s in svcs.items() if "profiles" not in s} == {
        "secrets", "redis", "kvstore", "prefill", "decode", "router"}
    assert svcs["decode-gpu"]["profiles"] == ["gpu"]
    for gpu in ("prefill-gpu", "decode-gpu"):  # the engine really runs on the device
        cmd = svcs[gpu]["command"]
        assert cmd[cmd.index("--device") + 1] == "cuda"
    assert "--device" not in svcs["decode"]["command"]
    assert svcs["decode-gpu"]["build"]["target"] == "cuda"
    devices = svcs["decode-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]
    assert svcs["decode"]["build"]["target"] == "cpu" and "deploy" not in svcs["decode"]
    assert svcs["otel-collector"]["profiles"] == svcs["prometheus"]["profiles"] == svcs[
        "grafana"]["profiles"] == [
        "observability"]


def test_named_volumes_only_where_state_lives():
    doc = load_compose()
    assert set(doc["volumes"]) == {"redis-data", "prometheus-data", "pdserve-tls", "redis-auth"}
    named: dict[str, set] = {}
    writers: dict[str, set] = {}
    for name, svc in doc["services"].items():
        for vol in svc.get("volumes", []):
            source = vol.split(":")[0]
            if not source.startswith((".", "/")):
                named.setdefault(source, set()).add(name)
                if not vol.endswith(":ro"):
                    writers.setdefault(source, set()).add(name)
    assert named["redis-data"] == {"redis"} and named["prometheus-data"] == {"prometheus"}
    # the secrets: written by the secrets step only
    assert writers["pdserve-tls"] == writers["redis-auth"] == {"secrets"}
    # the Redis password reaches Redis, the KV store and the registry's users
    assert named["redis-auth"] == {"secrets", "redis", "kvstore", "router", "prefill",
                                   "decode", "prefill-gpu", "decode-gpu"}
    assert named["pdserve-tls"] >= {"secrets", "kvstore", "prefill", "decode", "router"}
    redis = doc["services"]["redis"]
    assert redis["command"][redis["command"].index("--dir") + 1] == "/data"


def test_observability_scrapes_router_and_engines_and_provisions_grafana():
    example = env_example()
    prom = yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    job = jobs["pdserve-router"]
    assert job["metrics_path"] in _router_routes()
    assert job["static_configs"][0]["targets"] == [f"router:{example['ROUTER_PORT']}"]
    # every engine service (scaled ones too: DNS answers with each container) on the port
    # its --metrics-port names
    base = load_compose()
    merged = merge_override(base, load_compose(SCALE), COMPOSE_DIR)
    engines = _engines(merged)
    assert job["static_configs"][0]["labels"] == {"role": "router"}
    seen = set()
    for role in ("prefill", "decode"):  # the dashboard groups engine series by `role`
        engine_job = jobs[f"pdserve-{role}"]
        assert engine_job["relabel_configs"] == [{"target_label": "role", "replacement": role}]
        (sd,) = engine_job["dns_sd_configs"]
        assert sd["type"] == "A"
        for name in sd["names"]:
            assert engines[name].service == role, name
            var = f"{role.upper()}_METRICS_PORT"
            assert engines[name].metrics_port == sd["port"] == int(example[var]), name
        seen |= set(sd["names"])
    assert seen == set(engines)
    grafana = base["services"]["grafana"]
    assert grafana["profiles"] == ["observability"]
    mounts = {v.split(":")[0]: v.split(":")[1] for v in grafana["volumes"]}
    prov = (COMPOSE_DIR / "../grafana/provisioning").resolve()
    assert (COMPOSE_DIR / "../grafana/provisioning").is_dir()
    assert mounts["../grafana/provisioning"] == "/etc/grafana/provisioning"
    dash_dir = yaml.safe_load((prov / "dashboards" / "pdserve.yaml").read_text())[
        "providers"][0]["options"]["path"]
    dash = mounts["../grafana/pdserve-dashboard.json"]
    assert dash.startswith(dash_dir + "/")
    assert json.loads((COMPOSE_DIR / "../grafana/pdserve-dashboard.json").read_text())["uid"]
    source = yaml.safe_load((prov / "datasources" / "prometheus.yaml").read_text())
    assert source["datasources"][0]["url"] == "http://prometheus:9090"
    otel = yaml.safe_load((COMPOSE_DIR / "otel-collector.yaml").read_text())
    scrape = otel["receivers"]["prometheus"]["config"]["scrape_configs"][0]
    assert scrape["metrics_path"] == "/metrics"
    assert scrape["static_configs"][0]["targets"] == [f"router:{example['ROUTER_PORT']}"]
    for pipeline in otel["service"]["pipelines"].values():
        assert set(pipeline["receivers"]) <= set(otel["receivers"])
        assert set(pipeline["exporters"]) <= set(otel["exporters"])


def _router_routes() -> dict[str, set[str]]:
    from pdserve.tests.deploy.router_routes import router_app

    app = router_app()
    return {r.path: set(getattr(r, "methods", None) or ()) for r in app.routes}
