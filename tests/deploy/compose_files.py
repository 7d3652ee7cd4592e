"""Reading deploy/compose as Compose does, without a Docker engine: variable interpolation,
the files loaded and merged (`-f base -f override`), .env.example, and each service's
command parsed with pdserve's own CLI. Shared by the compose, Dockerfile and stack tests."""

from __future__ import annotations

import json
import re
from pathlib import Path

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
