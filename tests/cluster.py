"""Real engine processes for integration tests: `python -m baton_cli ROLE ...` on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from baton.protocol import EngineStats
from baton.service.client import EngineClient, is_whole, probe_engine
from kv_transfer.auth import keys_from_env

# The session's cluster keys (tests/conftest.py): the engines get them from the environment.
KEYS = keys_from_env()

# Small pools and one thread each: several engines share this machine's two cores. The exact
# mode (the servers' default is auto, int4 on the default model): these tests compare with
# transformers and with in-process exact engines; tests/router/test_quantized_deployments.py
# runs int4 (a later --quantization wins).
BASE_ARGS = ["--num-threads", "1", "--block-size", "16", "--quantization", "none"]


class EngineProcess:
    def __init__(self, command: str, engine_id: str, log_dir: Path, redis_url: str = "",
                 prefix: str = "baton", args: list[str] | None = None, port: int = 0,
                 env: dict[str, str] | None = None):
        """`port` 0: the engine binds an ephemeral port and writes its address to a file
        (--address-file), read by wait_ready. A port picked here in advance could be taken,
        before the engine binds it, by another engine's ephemeral KV side channel. `env`:
        variables added to the engine's environment (e.g. a test fault)."""
        self.command, self.engine_id = command, engine_id
        self.port = port
        self.address = f"tcp://127.0.0.1:{port}" if port else ""
        stem = f"{engine_id}-{time.monotonic_ns()}"
        self.log = log_dir / f"{stem}.log"
        self.address_file = log_dir / f"{stem}.address"
        self.argv = [sys.executable, "-m", "baton_cli", command, "--engine-id", engine_id,
                     "--host", "127.0.0.1", "--port", str(port),
                     "--address-file", str(self.address_file),
                     "--registry-prefix", prefix, *BASE_ARGS, *(args or [])]
        if redis_url:
            self.argv += ["--redis-url", redis_url]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True,
                                         env={**os.environ, **env} if env else None)

    def wait_ready(self, deadline: float) -> EngineProcess:
        while not (self.address or self._read_address()) or \
                probe_engine(self.address, timeout_s=0.5, keys=KEYS) is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"engine {self.engine_id} did not start:\n{self.tail()}")
            time.sleep(0.2)
        return self

    def _read_address(self) -> bool:
        if not self.address_file.exists():
            return False
        self.address = self.address_file.read_text().strip()
        self.port = int(self.address.rsplit(":", 1)[1])
        return True

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def client(self) -> EngineClient:
        return EngineClient(self.address, keys=KEYS)

    def stats(self) -> EngineStats:
        with self.client() as client:
            return client.stats(5.0)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def kill(self) -> None:
        self.stop(signal.SIGKILL)


def start_all(engines: list[EngineProcess], timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    for engine in engines:
        engine.wait_ready(deadline)


def wait_for(predicate, timeout_s: float = 10.0, poll_s: float = 0.01) -> None:
    """Until `predicate()` holds; the bound only stops a hung test, no assert rests on it."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(poll_s)


def wait_whole(engines: list[EngineProcess], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = [e.stats() for e in engines]
        if all(is_whole(s) for s in stats):
            return
        assert time.monotonic() < deadline, f"pools not whole: {stats}"
        time.sleep(0.1)
