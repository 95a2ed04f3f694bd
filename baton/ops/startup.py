"""Where an engine's start-up time goes: one INFO line when it is ready to serve.

    start-up 9.3 s: imports 7.8, weights 0.9 (hit), kv pool + runner 0.0, engine core 0.0,
    transfer agent 0.5, service 0.2 (since process start, pid 11473)

(a completion engine restarted under `baton up` at load average 9; "hit" is what the load
cache did, baton/model/load_cache.py).

Phases are marked in order by the composition root (baton_cli/engine_main.py); "imports" runs
from the process's start, read from /proc/self/stat (the kernel's start time, so the
interpreter's own start counts), or, where there is no /proc, from the first import of this
module.
"""

from __future__ import annotations

import logging
import os
import time

logger = logging.getLogger(__name__)

_IMPORTED_AT = time.time()


def process_age_s() -> float | None:
    """Seconds since this process started, from /proc (Linux); None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        # Field 22, counted after the command name's closing parenthesis (it may hold spaces).
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def process_start_time() -> tuple[float, str]:
    """(wall-clock time this process started, where that came from)."""
    age = process_age_s()
    if age is not None:
        return time.time() - age, "process start"
    return _IMPORTED_AT, "first import of baton.ops.startup (no /proc)"


class StartupClock:
    """Named phases of a start-up, each from the end of the previous one."""

    def __init__(self) -> None:
        self.started_at, self.origin = process_start_time()
        self._last = self.started_at
        self.phases: list[tuple[str, float]] = []
        self.notes: dict[str, str] = {}

    def mark(self, phase: str, note: str = "") -> float:
        """End `phase` now; returns its seconds."""
        return self.mark_split([], phase, note)

    def mark_split(self, parts: list[tuple[str, float]], rest: str, note: str = "") -> float:
        """End a span now that holds `parts` (phases timed inside it, name and seconds) and
        `rest`, the remainder; returns the remainder's seconds."""
        now = time.time()
        self.phases.extend(parts)
        remainder = max(0.0, now - self._last - sum(s for _, s in parts))
        self.phases.append((rest, remainder))
        if note:
            self.notes[rest] = note
        self._last = now
        return remainder

    @property
    def total_s(self) -> float:
        return self._last - self.started_at

    def summary(self) -> str:
        parts = ", ".join(f"{name} {s:.1f}" + (f" ({self.notes[name]})" if name in self.notes
                                                 else "") for name, s in self.phases)
        return f"start-up {self.total_s:.1f} s: {parts} (since {self.origin}, pid {os.getpid()})"

    def log(self) -> None:
        logger.info("%s", self.summary())
