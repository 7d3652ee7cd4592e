"""One Redis for the tests that need one: a testcontainers Redis container when a Docker engine
answers, a private `redis-server` process (RedisProcess) otherwise. The choice is logged.

PDSERVE_TEST_REDIS=docker|local forces a path (docker fails loudly without an engine); unset or
"auto" chooses by asking the Docker engine for a ping. The container image is
PDSERVE_TEST_REDIS_IMAGE (default redis:7-alpine).
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterator

log = logging.getLogger("pdserve.tests.redis")

MODES = ("auto", "docker", "local")


def docker_reachable() -> bool:
    """True when the Docker SDK finds an engine that answers a ping within 2 s."""
    try:
        import docker

        client = docker.from_env(timeout=2)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception as exc:  # no SDK, no socket, no permission: all mean "no Docker here"
        log.debug("no Docker engine: %s", exc)
        return False


def choose_mode(requested: str = "") -> str:
    requested = requested or os.environ.get("PDSERVE_TEST_REDIS", "auto")
    if requested not in MODES:
        raise ValueError(f"PDSERVE_TEST_REDIS must be one of {', '.join(MODES)}, "
                         f"got {requested!r}")
    if requested != "auto":
        return requested
    return "docker" if docker_reachable() else "local"


@contextlib.contextmanager
def redis_container(image: str) -> Iterator[str]:
    from testcontainers.community.redis import RedisContainer  # moved there in 4.15

    with RedisContainer(image) as container:
        host = container.get_container_host_ip()
        port = container.get_exposed_port(container.port)
        yield f"redis://{host}:{port}/0"


@contextlib.contextmanager
def redis_local() -> Iterator[str]:
    from pdserve.services.kvstore.redis_proc import RedisProcess

    with RedisProcess() as proc:
        yield proc.url


@contextlib.contextmanager
def redis_service(mode: str = "") -> Iterator[str]:
    """Yields a redis:// URL to a fresh, empty Redis; stops it on exit."""
    mode = choose_mode(mode)
    if mode == "docker":
        image = os.environ.get("PDSERVE_TEST_REDIS_IMAGE", "redis:7-alpine")
        log.warning("Redis for tests: a testcontainers container (%s)", image)
        with redis_container(image) as url:
            yield url
    else:
        log.warning("Redis for tests: a local redis-server process (no Docker engine)")
        with redis_local() as url:
            yield url
