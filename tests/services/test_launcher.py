"""`baton up` as a user runs it: everything starts, answers, and stops on Ctrl-C; a busy port or a
missing model gives one clear message and leaves nothing running."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from baton.redis_server import free_port

pytestmark = pytest.mark.slow

ENGINE_FLAGS = ["--", "--num-blocks", "64", "--max-model-len", "512"]


def _up(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "baton.cli", "up", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _descendants(proc: subprocess.Popen) -> list[psutil.Process]:
    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def test_router_port_in_use_is_one_clear_message():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = _up("--port", str(port))
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert f"127.0.0.1:{port} is already in use" in err


def test_missing_model_stops_everything(tmp_path):
    missing = tmp_path / "no-such-model.gguf"
    proc = _up("--port", str(free_port()), "--model", str(missing), *ENGINE_FLAGS)
    children_seen: list[psutil.Process] = []
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        children_seen += [c for c in _descendants(proc) if c not in children_seen]
        time.sleep(0.2)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert str(missing) in err and "no such file" in err
    assert "exited with status 1 during start-up" in err
    time.sleep(1.0)
    assert not [c for c in children_seen if c.is_running() and c.status() != "zombie"]


def test_up_serves_and_ctrl_c_stops_every_child():
    port = free_port()
    proc = _up("--port", str(port), *ENGINE_FLAGS)
    try:
        banner = ""
        deadline = time.monotonic() + 240
        while "Ctrl-C stops" not in banner:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, proc.stderr.read()[-3000:]
            banner += line
            assert time.monotonic() < deadline, banner
        assert f"http://127.0.0.1:{port}/v1" in banner and "SmolLM2" in banner
        children = _descendants(proc)
        assert len(children) >= 4  # redis, prompt engine, completion engine, router
        body = {"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is",
                "max_tokens": 4, "temperature": 0}
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"].strip().startswith("Paris")
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    assert proc.returncode == 0
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive
