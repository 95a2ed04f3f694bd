"""Router test fixtures: the model's tokenizer (read once), a router app, a real HTTP server."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import pytest

from router.config import RouterConfig
from router.text import ModelInfo, load_model_info


@pytest.fixture(scope="session")
def model_info() -> ModelInfo:
    """SmolLM2's tokenizer and limits; reading the GGUF takes seconds, so once per session."""
    return load_model_info()


@pytest.fixture
def make_client(model_info):
    """`make_client(**RouterConfig fields)` -> a TestClient over a fresh app, lifespan running.

    It prepares requests on a thread (num_prepare_workers=0) unless told otherwise: spawning
    worker processes for each of many apps would dominate these tests. No engine runs behind
    these apps, so a request gets its 503 at once instead of waiting for one to appear."""
    from fastapi.testclient import TestClient

    from router.app import create_app

    clients = []

    def make(**overrides) -> TestClient:
        overrides.setdefault("num_prepare_workers", 0)
        overrides.setdefault("engine_wait_timeout_s", 0)
        client = TestClient(create_app(RouterConfig(**overrides), info=model_info))
        client.__enter__()
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)


@pytest.fixture
def engines():
    """`engines(role, tokens, **kwargs)` -> a ScriptedEngine (tests/router/scripted_engine.py),
    closed after the test."""
    from tests.router.scripted_engine import ScriptedEngine

    started: list[ScriptedEngine] = []

    def start(*args, **kwargs) -> ScriptedEngine:
        started.append(ScriptedEngine(*args, **kwargs))
        return started[-1]

    yield start
    for engine in started:
        engine.close()


@contextlib.contextmanager
def serve_router(config: RouterConfig, info: ModelInfo | None = None) -> Iterator[str]:
    """Run the router under uvicorn in a thread on a free loopback port; yields its base URL."""
    import uvicorn

    from baton.ops.ports import free_port
    from router.app import create_app
    from router.limits import uvicorn_limits

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(config, info=info), host="127.0.0.1",
                                           port=port, log_level="warning", access_log=False,
                                           **uvicorn_limits(config)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "router did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@contextlib.contextmanager
def router_process(*args: str, timeout_s: float = 60.0) -> Iterator[tuple[str, object]]:
    """`baton router ARGS` as its own process on a free loopback port: (base URL, Popen).

    For what the test process's own threads must not disturb (latency, memory)."""
    import subprocess
    import sys

    import httpx

    from baton.ops.ports import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "baton_cli", "router", "--port", str(port),
                             *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "router did not start"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
