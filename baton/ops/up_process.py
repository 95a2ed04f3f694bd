"""`baton up` as a child process, for what drives a whole deployment from outside: the
simulator's calibration, the benchmarks, the tests that start one.

`UpProcess.start(flags)` runs `python -m baton_cli up --port P FLAGS` in its own session, its
output collected line by line by threads (its children share the pipes, which must never fill
and block them); `wait_up` waits for the banner's last line ("Ctrl-C stops every process.")
with a deadline and reads the banner (each engine's address and /metrics URL); `stop` is the
user's Ctrl-C (SIGTERM: the launcher stops its children) and a SIGKILL to the whole session if
it hangs. A launcher that exits or stays silent past the deadline raises `UpError` with the tail
of what it said.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from baton.ops.ports import free_port

BANNER_END = "Ctrl-C stops"  # the banner's last line (baton_cli/launcher.py `banner`)
# A banner line of an engine: "  <id>  <address>[  metrics <url>][  ready in <s> s]".
_ENGINE_LINE = re.compile(r"^\s+((?:normal|prompt|completion)-\d+)\s+(\S+)"
                          r"(?:\s+metrics (http://\S+))?")


class UpError(RuntimeError):
    """`baton up` did not come up: it exited, or said nothing like its banner in time."""


class Lines:
    """A pipe's lines, collected by a daemon thread until the pipe closes."""

    def __init__(self, pipe) -> None:
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(pipe), daemon=True).start()

    def matching(self, pattern: str) -> list[re.Match]:
        return [m for m in map(re.compile(pattern).search, list(self.lines)) if m]

    def tail(self, n: int = 40) -> str:
        return "".join(self.lines[-n:])


class UpProcess:
    """One `baton up`; a context manager that waits for it on entry and stops it on exit."""

    def __init__(self, proc: subprocess.Popen, port: int, stdout: Lines,
                 stderr: Lines | None, ready_timeout_s: float) -> None:
        self.proc, self.port = proc, port
        self.stdout, self.stderr = stdout, stderr
        self.ready_timeout_s = ready_timeout_s
        self.engines: dict[str, str] = {}  # engine id -> address, from the banner
        self.metrics_urls: dict[str, str] = {}  # engine id -> its /metrics (unless --no-metrics)

    @classmethod
    def start(cls, flags: Sequence[str], port: int = 0, ready_timeout_s: float = 120.0,
              keep_stderr: bool = True, env: dict[str, str] | None = None) -> UpProcess:
        """`baton up --port PORT FLAGS` (PORT 0: a free one), not waited for; `keep_stderr`
        False sends its log to /dev/null (a long benchmark's would only grow)."""
        port = port or free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "baton_cli", "up", "--port", str(port), *flags],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE if keep_stderr else subprocess.DEVNULL,
            text=True, start_new_session=True, env=env)
        return cls(proc, port, Lines(proc.stdout), Lines(proc.stderr) if keep_stderr else None,
                   ready_timeout_s)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def banner(self) -> str:
        return "".join(self.stdout.lines)

    def tail(self, n: int = 40) -> str:
        """The end of what it said: its log where kept, else its standard output."""
        return (self.stderr or self.stdout).tail(n)

    def wait_up(self, timeout_s: float | None = None) -> UpProcess:
        limit_s = self.ready_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit_s
        while not any(BANNER_END in line for line in list(self.stdout.lines)):
            if self.proc.poll() is not None:
                raise UpError(f"baton up exited with {self.proc.returncode} before it was "
                              f"up:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise UpError(f"baton up not up within {limit_s:g} s:\n{self.tail()}")
            time.sleep(0.05)
        for m in self.stdout.matching(_ENGINE_LINE.pattern):
            self.engines[m.group(1)] = m.group(2)
            if m.group(3):
                self.metrics_urls[m.group(1)] = m.group(3)
        return self

    def stop(self, timeout_s: float = 60.0) -> None:
        """Its Ctrl-C (SIGTERM: it stops every child), then SIGKILL to its session if it
        hangs. Safe to call twice, and on one that already exited."""
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def __enter__(self) -> UpProcess:
        try:
            return self.wait_up()
        except BaseException:
            self.stop()  # one that did not come up leaves nothing running
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


def start_up(flags: Sequence[str], ready_timeout_s: float = 120.0, **kw) -> UpProcess:
    """`UpProcess.start(...)` and waited for: up, or stopped and UpError raised."""
    return UpProcess.start(flags, ready_timeout_s=ready_timeout_s, **kw).__enter__()
