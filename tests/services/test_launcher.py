"""`baton up` as a user runs it: everything starts, answers, survives a killed engine or router
(restarted under the same id), and stops on Ctrl-C; a busy port or a missing model gives one
clear message and leaves nothing running."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from baton.ops.cpus import cpu_shares, parse_cpus
from baton.ops.ports import free_port
from baton_cli.launch_config import LaunchConfig, role_engine_args

pytestmark = pytest.mark.slow

ENGINE_FLAGS = ["--", "--num-blocks", "64", "--max-model-len", "512"]


def _up(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "baton_cli", "up", *args],
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


class _Lines:
    """Collects a pipe's lines in a thread, so the children never block on a full pipe."""

    def __init__(self, pipe) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=lambda: self.lines.extend(pipe), daemon=True)
        self._thread.start()

    def wait_for(self, text: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in self.lines):
            assert time.monotonic() < deadline, f"no {text!r} in:\n{''.join(self.lines[-40:])}"
            time.sleep(0.1)


def _ask(port: int) -> None:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is",
            "max_tokens": 4, "temperature": 0}
    reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"].strip().startswith("Paris")


def _child(proc: subprocess.Popen, word: str) -> psutil.Process:
    for child in _descendants(proc):
        try:
            if word in child.cmdline():
                return child
        except psutil.NoSuchProcess:
            pass
    raise AssertionError(f"no child running {word}")


def test_up_serves_restarts_the_killed_and_ctrl_c_stops_every_child():
    port = free_port()
    proc = _up("--port", str(port), *ENGINE_FLAGS)
    stderr = _Lines(proc.stderr)
    children: list[psutil.Process] = []
    try:
        banner = ""
        deadline = time.monotonic() + 240
        while "Ctrl-C stops" not in banner:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "".join(stderr.lines[-40:])
            banner += line
            assert time.monotonic() < deadline, banner
        assert f"http://127.0.0.1:{port}/v1" in banner and "SmolLM2" in banner
        for name in ("prompt-0", "completion-0", "router"):  # each child's time-to-ready
            assert re.search(rf"{name} .* ready in [\d.]+ s", banner), banner
        children = _descendants(proc)
        assert len(children) >= 4  # redis, prompt engine, completion engine, router
        engines = [c for c in children if {"prompt-engine", "completion-engine"} & set(c.cmdline())]
        masks = [set(c.cpu_affinity()) for c in engines]
        assert len(masks) == 2
        if len(os.sched_getaffinity(0)) >= 2:  # each engine pinned to its own cores
            assert masks[0] and masks[1] and masks[0].isdisjoint(masks[1]), masks
        _ask(port)
        # Every engine's Prometheus endpoint is in the banner and counted the request.
        urls = re.findall(r"metrics (http://127\.0\.0\.1:\d+/metrics)", banner)
        assert len(urls) == 2, banner
        finished = {}
        for url in urls:
            families = text_string_to_metric_families(httpx.get(url, timeout=10).text)
            for sample in next(f for f in families if f.name == "baton_request_success").samples:
                if sample.name.endswith("_total"):
                    finished[sample.labels["role"], sample.labels["finished_reason"]] = sample.value
        assert finished == {("prompt", "handed_off"): 1, ("completion", "length"): 1}, finished
        # One death stops nothing: the killed engine comes back under its old id and port.
        killed = _child(proc, "completion-engine")
        survivors = [c for c in children if c.pid != killed.pid and killed not in c.parents()]
        killed.kill()
        stderr.wait_for("completion-0 exited (signal 9); restarting in 0 s (restart 1 of 5)", 30)
        stderr.wait_for("completion-0 is back (restart 1 of 5", 180)
        assert all(c.is_running() for c in survivors)
        _ask(port)
        _child(proc, "router").kill()  # the router is supervised too
        stderr.wait_for("router exited (signal 9); restarting in 0 s (restart 1 of 5)", 30)
        stderr.wait_for("router is back (restart 1 of 5", 120)
        _ask(port)
        children = _descendants(proc)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    assert proc.returncode == 0, "".join(stderr.lines[-40:])
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive


def test_cpus_flag_parses_lists_and_ranges():
    assert parse_cpus("0") == {0}
    assert parse_cpus("0,2-3") == {0, 2, 3}
    for bad in ("", "a", "3-x", "-1"):
        with pytest.raises(ValueError, match="--cpus"):
            parse_cpus(bad)


def test_cpu_shares_are_disjoint_or_none():
    cpus = sorted(os.sched_getaffinity(0))
    assert cpu_shares(1, len(cpus)) == []  # one engine: nothing to separate
    assert cpu_shares(len(cpus) + 1, 1) == []  # more engines than cores: no pinning
    if len(cpus) >= 2:
        shares = cpu_shares(2, len(cpus) // 2)
        sets = [parse_cpus(s) for s in shares]
        assert len(sets) == 2 and sets[0].isdisjoint(sets[1])
        assert sets[0] | sets[1] <= set(cpus)


def test_engine_flags_reach_the_roles_that_have_them():
    # `baton up -- --lease-ttl 8` used to make every completion engine exit at start-up.
    args = ["--num-blocks", "8", "--lease-ttl", "8", "--kv-timeout=5", "--max-model-len", "512"]
    common = ["--num-blocks", "8", "--max-model-len", "512"]
    assert role_engine_args(args, "normal") == common
    assert role_engine_args(args, "prompt") == ["--num-blocks", "8", "--lease-ttl", "8",
                                                "--max-model-len", "512"]
    assert role_engine_args(args, "completion") == ["--num-blocks", "8", "--kv-timeout=5",
                                                    "--max-model-len", "512"]
    assert role_engine_args(common, "completion") == common
    # A prompt engine runs no decode-only step: --decode-threads is not one of its flags.
    decode = ["--decode-threads", "1"]
    assert role_engine_args(decode, "prompt") == []
    assert role_engine_args(decode, "normal") == role_engine_args(decode, "completion") == decode


def test_an_engine_flag_no_role_takes_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match="--lease-tll 8"):
        LaunchConfig(engine_args=["--lease-tll", "8"])
    result = subprocess.run([sys.executable, "-m", "baton_cli", "up", "--", "--no-such-flag"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "no engine takes the engine flag(s) --no-such-flag" in result.stderr


def test_engine_counts_mixed_fleet_and_normal_alone():
    """--normal-engines alone is co-located serving (prompt and completion default to 0);
    explicit prompt and completion counts beside it make a mixed fleet; a prompt engine
    without a completion engine (or the reverse) beside it is refused by name."""
    from baton_cli.launch_config import LaunchConfig, engine_counts
    from baton_cli.main import build_parser

    def counts(*flags: str):
        return engine_counts(build_parser("up").parse_args(["up", *flags]))

    assert counts() == (1, 1, 0)
    assert counts("--prompt-engines", "2") == (2, 1, 0)
    assert counts("--normal-engines", "2") == (0, 0, 2)
    assert counts("--normal-engines", "1", "--prompt-engines", "0") == (0, 0, 1)
    mixed = counts("--normal-engines", "1", "--prompt-engines", "1", "--completion-engines", "1")
    assert mixed == (1, 1, 1)
    LaunchConfig(num_prompt_engines=1, num_completion_engines=1, num_normal_engines=1)
    prompt, completion, normal = counts("--normal-engines", "1", "--prompt-engines", "1")
    with pytest.raises(ValueError, match="mixed fleet needs both --prompt-engines and "
                                         "--completion-engines"):
        LaunchConfig(num_prompt_engines=prompt, num_completion_engines=completion,
                     num_normal_engines=normal)
