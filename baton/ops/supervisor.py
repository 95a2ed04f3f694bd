"""Keep `baton up`'s children running: restart one that exits, with backoff and a limit.

Life of a child under supervision:
1. it runs; the launcher polls it every `poll_s`;
2. it exits (a crash, a SIGKILL, an OOM kill): the supervisor logs why and schedules a restart
   of the same command line (same engine id, same port: a new instance the router and the
   registry know by its old address): at once the first time in the window (a single crash
   should cost only the start-up), then after 1 s, 2 s, 4 s ... capped at `max_delay_s`;
3. the restart starts it again; until its readiness check passes it counts as restarting, and
   the log says when it is back and how long it was gone;
   With a warm standby (`baton up --warm-standby`, `Child.spawn_standby`), the restart promotes
   a spare that has imported everything and loaded the model, and a new spare starts once
   the child is back;
4. past `max_restarts` restarts within `window_s` it gives up on that child (a crash loop:
   restarting again would only load the model for nothing); the others keep serving.
One child's death never stops the others; only a signal to the launcher stops them all.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass
class RestartPolicy:
    # Restarts of one child allowed within `window_s`; one more exit and it is given up.
    max_restarts: int = 5
    # The sliding window (seconds) the restarts are counted in.
    window_s: float = 600.0
    # Delay before the second restart in the window (the first is immediate); each further one
    # doubles it.
    first_delay_s: float = 1.0
    # The doubling stops here, so a child given a long window still comes back in time.
    max_delay_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        for name in ("window_s", "first_delay_s", "max_delay_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_delay_s < self.first_delay_s:
            raise ValueError(f"max_delay_s ({self.max_delay_s}) must be >= first_delay_s "
                             f"({self.first_delay_s})")

    def delay_s(self, restart: int) -> float:
        """Seconds to wait before restart number `restart` (1-based) of the window: none for
        the first, then `first_delay_s` doubling up to `max_delay_s`."""
        if restart <= 1:
            return 0.0
        return min(self.max_delay_s, self.first_delay_s * 2 ** (restart - 2))


def die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it when the launcher dies, however it dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class LaunchError(RuntimeError):
    """A child failed to start; the message names it and why."""


class Child:
    """One process of `baton up`; `start` again runs the same command line anew.

    With `standby_argv` (an engine's command line with `--standby`), a warm spare of it can be
    kept (`spawn_standby`): a process that has imported everything and loaded the model, and
    waits for a line on its stdin before it binds its port; `start` then promotes the spare
    instead of starting from nothing (the restart costs the NIXL agent and the socket, not the
    imports and the weights).
    """

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None,
                 is_ready: Callable[[], bool] | None = None,
                 standby_argv: list[str] | None = None):
        self.name = name
        self.argv = argv
        self.env = env
        self.is_ready = is_ready  # a quick readiness check (an engine probe, the router's /health)
        self.standby_argv = standby_argv
        self.standby: subprocess.Popen | None = None
        self.proc = self._spawn()

    def _spawn(self, argv: list[str] | None = None, stdin=None) -> subprocess.Popen:
        return subprocess.Popen(argv or self.argv, preexec_fn=die_with_parent, stdin=stdin,
                                env={**os.environ, **(self.env or {})})

    def pin_port(self, port: str) -> None:
        """From now on start with `--port port` (it started with --port 0 and bound `port`):
        a restart binds the port its first start chose, so the engine's address stays."""
        for argv in (self.argv, self.standby_argv or []):
            for i, arg in enumerate(argv[:-1]):
                if arg == "--port":
                    argv[i + 1] = port

    def spawn_standby(self) -> None:
        """Start a warm spare, unless there is one or this child has none."""
        if self.standby_argv is None or (self.standby is not None and self.standby.poll() is None):
            return
        self.standby = self._spawn(self.standby_argv, stdin=subprocess.PIPE)
        logger.info("%s: warm standby started (pid %d)", self.name, self.standby.pid)

    def start(self) -> None:
        spare, self.standby = self.standby, None
        if spare is not None and spare.poll() is None:
            try:
                spare.stdin.write(b"go\n")
                spare.stdin.flush()
                self.proc = spare
                logger.info("%s: warm standby promoted (pid %d)", self.name, spare.pid)
                return
            except OSError:  # it died meanwhile: start from nothing
                spare.kill()
        self.proc = self._spawn()

    def check_alive(self) -> None:
        code = self.proc.poll()
        if code is not None:
            raise LaunchError(f"{self.name} exited with status {code} during start-up "
                              f"(command: {' '.join(self.argv)})")

    def stop(self, timeout_s: float) -> None:
        self.terminate()
        self.wait_stopped(timeout_s)

    def _procs(self) -> list[subprocess.Popen]:
        return [self.proc] + ([self.standby] if self.standby is not None else [])

    def terminate(self) -> None:
        """SIGTERM to the process and its spare (each shuts down gracefully on it)."""
        for proc in self._procs():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    def wait_stopped(self, timeout_s: float) -> None:
        """Wait for `terminate` to take effect; a process that outlives `timeout_s` is killed."""
        for proc in self._procs():
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("%s (pid %d) did not stop within %.0fs; killing it", self.name,
                               proc.pid, timeout_s)
                proc.kill()
                proc.wait(5)


def describe_exit(code: int) -> str:
    return f"signal {-code}" if code < 0 else f"status {code}"


@dataclass
class _Watch:
    """What the supervisor knows of one child."""

    child: Child
    restarts: deque[float] = field(default_factory=deque)  # when each restart in the window ran
    exited_at: float | None = None  # the last exit, until the child is ready again
    restart_at: float | None = None  # a restart is due then
    is_restarting: bool = False  # started again, not yet ready
    is_given_up: bool = False


class Supervisor:
    """Restarts the children that exit; `poll` once per tick, from the launcher's loop."""

    def __init__(self, children: list[Child], policy: RestartPolicy,
                 clock: Callable[[], float] = time.monotonic):
        self.policy = policy
        self.clock = clock
        self.watches = [_Watch(c) for c in children]
        self.num_restarts = 0  # every restart so far, all children together

    @property
    def given_up(self) -> list[str]:
        return [w.child.name for w in self.watches if w.is_given_up]

    def poll(self) -> None:
        now = self.clock()
        for watch in self.watches:
            if watch.is_given_up:
                continue
            if watch.restart_at is not None:
                if now >= watch.restart_at:
                    self._restart(watch, now)
            elif watch.child.proc.poll() is not None:
                self._exited(watch, now)
            elif watch.is_restarting:
                self._check_back(watch, now)

    def _exited(self, watch: _Watch, now: float) -> None:
        name, policy = watch.child.name, self.policy
        how = describe_exit(watch.child.proc.returncode)
        while watch.restarts and now - watch.restarts[0] > policy.window_s:
            watch.restarts.popleft()
        if len(watch.restarts) >= policy.max_restarts:
            watch.is_given_up = True
            logger.error("%s exited (%s) after %d restarts within %g minutes; giving up on it, "
                         "the others keep serving", name, how, len(watch.restarts),
                         policy.window_s / 60)
            return
        restart = len(watch.restarts) + 1
        delay = policy.delay_s(restart)
        watch.exited_at = watch.exited_at if watch.is_restarting else now
        watch.restart_at = now + delay
        watch.is_restarting = False
        logger.warning("%s exited (%s); restarting in %g s (restart %d of %d)", name, how,
                       delay, restart, policy.max_restarts)

    def _restart(self, watch: _Watch, now: float) -> None:
        watch.restarts.append(now)
        watch.restart_at = None
        watch.is_restarting = True
        self.num_restarts += 1
        try:
            watch.child.start()
        except OSError as exc:  # e.g. out of PIDs: counts as an exit, retried with backoff
            logger.error("%s could not be started again: %s", watch.child.name, exc)
            watch.child.proc = _ExitedProc()
            return
        logger.info("%s restarted (pid %d)", watch.child.name, watch.child.proc.pid)

    def _check_back(self, watch: _Watch, now: float) -> None:
        if watch.child.is_ready is not None and not watch.child.is_ready():
            return
        gone_s = now - (watch.exited_at or now)
        watch.is_restarting, watch.exited_at = False, None
        logger.info("%s is back (restart %d of %d, %.1f s after it exited)", watch.child.name,
                    len(watch.restarts), self.policy.max_restarts, gone_s)
        watch.child.spawn_standby()  # the next crash's spare, now that this one is up


class _ExitedProc:
    """Stands in for a process that could not be spawned: it has 'exited' with status 127."""

    pid = -1
    returncode = 127

    def poll(self) -> int:
        return self.returncode

    def send_signal(self, sig: int) -> None:
        pass

    def wait(self, timeout: float | None = None) -> int:
        return self.returncode

    def kill(self) -> None:
        pass
