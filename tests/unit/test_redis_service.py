"""The tests' Redis: one fixture, two paths (a testcontainers container where a Docker engine
answers, a local redis-server otherwise), the choice logged; a forced Docker path without an
engine fails loudly instead of falling back."""

import logging

import pytest
import redis

from pdserve.tests import redis_service as rs


def test_mode_choice_follows_the_environment_and_docker(monkeypatch):
    monkeypatch.setattr(rs, "docker_reachable", lambda: False)
    monkeypatch.delenv("PDSERVE_TEST_REDIS", raising=False)
    assert rs.choose_mode() == "local"
    monkeypatch.setattr(rs, "docker_reachable", lambda: True)
    assert rs.choose_mode() == "docker"
    monkeypatch.setenv("PDSERVE_TEST_REDIS", "local")
    assert rs.choose_mode() == "local"
    monkeypatch.setenv("PDSERVE_TEST_REDIS", "podman")
    with pytest.raises(ValueError, match="PDSERVE_TEST_REDIS"):
        rs.choose_mode()


def test_the_local_path_serves_redis_and_logs_the_choice(caplog):
    caplog.set_level(logging.INFO, logger="pdserve.tests.redis")
    with rs.redis_service("local") as url:
        client = redis.Redis.from_url(url)
        assert client.ping() and client.set("k", "v") and client.get("k") == b"v"
        client.close()
    assert any("local redis-server" in r.getMessage() for r in caplog.records)


def test_the_docker_path_builds_a_real_container_and_says_when_docker_is_missing(monkeypatch,
                                                                                 caplog):
    """Here there is no Docker engine: the forced path reaches testcontainers' Docker client
    (real code, not a stub) and fails loudly rather than falling back."""
    if rs.docker_reachable():
        pytest.skip("a Docker engine answers here: the container path runs for real instead")
    caplog.set_level(logging.INFO, logger="pdserve.tests.redis")
    with pytest.raises(Exception) as info:
        with rs.redis_service("docker"):
            pass
    assert "docker" in f"{type(info.value).__module__} {info.value}".lower()
    assert any("testcontainers container" in r.getMessage() for r in caplog.records)
