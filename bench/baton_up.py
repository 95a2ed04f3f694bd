"""`baton up` driven by a chaos test or a soak: its output collected line by line, its banner
parsed (each engine's id and address), an engine's pid found by id to SIGKILL it, the
supervisor's restarts counted from its log, and the wait until every victim is back and every
pool is whole. Shared by tests/stress/test_chaos.py and bench/soak.py (a sibling module, not a
package: tests put bench/ on sys.path, as tests/bench do).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import psutil

from baton.ops.ports import free_port
from baton.service.client import is_whole, probe_engine
from kv_transfer.auth import ClusterKeys, keys_from_env


class Lines:
    """A pipe's lines, collected by a thread (the children share the pipe and must not block)."""

    def __init__(self, pipe) -> None:
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(pipe), daemon=True).start()

    def matching(self, pattern: str) -> list[re.Match]:
        return [m for m in map(re.compile(pattern).search, list(self.lines)) if m]


@dataclass
class BatonUp:
    proc: subprocess.Popen
    port: int
    stdout: Lines
    stderr: Lines
    keys: ClusterKeys | None  # to probe the engines
    engines: dict[str, str] = field(default_factory=dict)  # engine id -> address

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_up(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not any("Ctrl-C stops" in line for line in self.stdout.lines):
            assert self.proc.poll() is None and time.monotonic() < deadline, self.tail()
            time.sleep(0.2)
        for m in self.stdout.matching(r"^\s+((?:normal|prompt|completion)-\d+)\s+(tcp://\S+)"):
            self.engines[m.group(1)] = m.group(2)

    def children(self) -> dict[str, psutil.Process]:
        """The launcher's live children by name: each engine's id, "router", "redis"."""
        named = {}
        for child in psutil.Process(self.proc.pid).children():
            try:
                argv = child.cmdline()
            except psutil.NoSuchProcess:
                continue
            if "--engine-id" in argv and "--standby" not in argv:  # not a warm spare
                named[argv[argv.index("--engine-id") + 1]] = child
            elif "router" in argv:
                named["router"] = child
        return named

    def pid_of(self, engine_id: str) -> int | None:
        child = self.children().get(engine_id)
        return child.pid if child else None

    def num_back(self, engine_id: str) -> int:
        return len(self.stderr.matching(rf"{engine_id} is back \(restart"))

    def probe(self, engine_id: str, timeout_s: float = 2.0):
        return probe_engine(self.engines[engine_id], timeout_s, self.keys)

    def tail(self) -> str:
        return "".join(self.stderr.lines[-60:])

    def stop(self) -> None:
        """SIGTERM: the launcher stops its children; SIGKILL to the group if it hangs."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)


def start_baton_up(num_prompt: int, num_completion: int, engine_args: list[str],
                   up_args: list[str] = (), key_dir: str = "") -> BatonUp:
    """`baton up` on a free port; `key_dir` "" = the cluster keys of $BATON_CLUSTER_KEY_DIR."""
    port = free_port()
    keys_flags = ["--cluster-key-dir", key_dir] if key_dir else []
    proc = subprocess.Popen(
        [sys.executable, "-m", "baton_cli", "up", "--port", str(port), "--prompt-engines",
         str(num_prompt), "--completion-engines", str(num_completion), *keys_flags, *up_args,
         "--", *engine_args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    keys = ClusterKeys.load(key_dir) if key_dir else keys_from_env()
    baton = BatonUp(proc, port, Lines(proc.stdout), Lines(proc.stderr), keys)
    try:
        baton.wait_up()
    except BaseException:
        baton.stop()  # a launcher that did not come up leaves nothing running
        raise
    return baton


def held(stats) -> int:
    """Requests an engine holds: running or waiting, and (a prompt engine) KV leases not yet
    released, whose pull fails when the engine dies; -1 when it does not answer."""
    if stats is None:
        return -1
    return stats.num_running + stats.num_waiting + int(stats.extra.get("kv_leases_active", 0))


def recoveries(base_url: str) -> dict[str, float]:
    """The router's migrations and retries so far, by the failed engine's role."""
    import httpx

    counts: dict[str, float] = {}
    for line in httpx.get(f"{base_url}/metrics", timeout=10).text.splitlines():
        match = re.match(r'baton_router_(migrations|engine_retries)_total\{.*role="(\w+)".*\} '
                         r'(\S+)$', line)
        if match:
            key = f"{match.group(1)}_{match.group(2)}"
            counts[key] = counts.get(key, 0.0) + float(match.group(3))
    return counts


def wait_back_and_whole(baton: BatonUp, kills: list[dict], timeout_s: float = 240.0) -> None:
    """Every killed engine back (the supervisor's "is back", once per kill), then every pool
    whole: an orphaned lease (its puller was killed) ends within --lease-ttl."""
    deadline = time.monotonic() + timeout_s
    for engine in baton.engines:
        while baton.num_back(engine) < sum(k["engine"] == engine for k in kills):
            assert time.monotonic() < deadline, f"{engine} not back:\n{baton.tail()}"
            time.sleep(0.2)
    while True:
        stats = {e: baton.probe(e, 5.0) for e in baton.engines}
        if all(s is not None and is_whole(s) for s in stats.values()):
            return
        assert time.monotonic() < deadline, f"pools not whole: {stats}"
        time.sleep(0.5)
