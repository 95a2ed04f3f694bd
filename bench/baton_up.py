"""`baton up` driven by a chaos test or a soak (started and stopped by baton/ops/up_process.py):
an engine's pid found by id to SIGKILL it, the supervisor's restarts counted from its log, and
the wait until every victim is back and every pool is whole. Shared by tests/stress/test_chaos.py
and bench/soak.py (a sibling module, not a package: tests put bench/ on sys.path, as tests/bench
do).
"""

from __future__ import annotations

import re
import time

import psutil

from baton.ops.up_process import UpProcess
from baton.service.client import is_whole, probe_engine
from kv_transfer.auth import ClusterKeys, keys_from_env


class BatonUp(UpProcess):
    """A `baton up` (baton/ops/up_process.py) with what a chaos run needs: its children by
    name, the supervisor's restarts, each engine probed with the cluster's keys."""

    def __init__(self, up: UpProcess, keys: ClusterKeys | None) -> None:
        super().__init__(up.proc, up.port, up.stdout, up.stderr, up.ready_timeout_s)
        self.keys = keys  # to probe the engines

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

    def tail(self, n: int = 60) -> str:
        return super().tail(n)


def start_baton_up(num_prompt: int, num_completion: int, engine_args: list[str],
                   up_args: list[str] = (), key_dir: str = "",
                   ready_timeout_s: float = 300.0) -> BatonUp:
    """`baton up` on a free port, up (or stopped, and UpError raised); `key_dir` "" = the
    cluster keys of $BATON_CLUSTER_KEY_DIR."""
    keys_flags = ["--cluster-key-dir", key_dir] if key_dir else []
    up = UpProcess.start(["--prompt-engines", str(num_prompt), "--completion-engines",
                          str(num_completion), *keys_flags, *up_args, "--", *engine_args],
                         ready_timeout_s=ready_timeout_s)
    keys = ClusterKeys.load(key_dir) if key_dir else keys_from_env()
    return BatonUp(up, keys).__enter__()


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
