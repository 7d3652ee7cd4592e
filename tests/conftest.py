"""Fixtures shared by every test directory."""

import pytest

from pdserve.tests.redis_service import redis_service


@pytest.fixture(scope="session")
def redis_url():
    """A Redis for the whole session: a testcontainers container where a Docker engine
    answers, a local redis-server otherwise (tests/redis_service.py logs which)."""
    with redis_service() as url:
        yield url
