"""Kill-to-ready of a completion engine under `baton up`: SIGKILL it, time until the supervisor
logs "completion-0 is back" (its readiness probe answered), median of --kills.

    .venv/bin/python bench/restart_time.py [--kills 5] [--modes no-cache,cache] [--window 15]

Modes: no-cache (`-- --no-load-cache`: every start parses the GGUF file, as before the load
cache), cache (a fresh cache directory: `baton up`'s first start writes it, every restart maps
it) and standby (cache, and `baton up --warm-standby`: a restart promotes a spare that has
loaded the model already; each kill waits for the spare to be ready). The supervisor restarts a child at once the first time in its window and backs off
after (1, 2, 4 ... s); kills come --window + 1 s after the previous restart was back and
`baton up` runs with --restart-window --window, so each kill is the first in its window, and
the table shows the delay the supervisor chose. Each row gives the load average (1 min) at
the kill and the restarted engine's own start-up line. Writes bench/results/restart_time.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BACK = re.compile(r"completion-0 is back \(restart (\d+) of \d+, ([\d.]+) s after it exited\)")
RESTARTING = re.compile(r"completion-0 exited .*; restarting in ([\d.]+) s")
RESTARTED = re.compile(r"completion-0 restarted \(pid (\d+)\)")
STARTUP = re.compile(r"start-up ([\d.]+) s: (.*) \(since process start, pid (\d+)\)")


class Up:
    """`baton up` (1 prompt + 1 completion engine) with its log lines timestamped on arrival."""

    def __init__(self, port: int, window_s: float, up_args: list[str], engine_args: list[str],
                 env: dict) -> None:
        argv = [sys.executable, "-m", "baton_cli", "up", "--port", str(port),
                "--restart-window", str(window_s), "--no-metrics", *up_args, "--", *engine_args]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env={**os.environ, **env},
                                     start_new_session=True)
        self.lines: queue.Queue[tuple[float, str]] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put((time.monotonic(), line.rstrip()))

    def wait_for(self, pattern: re.Pattern | str, timeout_s: float) -> tuple[float, re.Match]:
        deadline = time.monotonic() + timeout_s
        rx = re.compile(re.escape(pattern)) if isinstance(pattern, str) else pattern
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                raise RuntimeError(f"no {rx.pattern!r} within {timeout_s} s; last lines:\n"
                                   + "\n".join(self.log[-30:]))
            try:
                at, line = self.lines.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            self.log.append(line)
            m = rx.search(line)
            if m:
                return at, m

    def completion_pid(self) -> int:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                cmd = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == self.proc.pid and b"completion-engine" in cmd:
                return int(entry.name)
        raise RuntimeError("no completion engine under baton up")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def run_mode(mode: str, args: argparse.Namespace, port: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="baton-restart-") as cache:
        engine_args = ["--no-load-cache"] if mode == "no-cache" else ["--load-cache-dir", cache]
        up_args = ["--warm-standby"] if mode == "standby" else []
        up = Up(port, args.window, up_args, engine_args, {})
        rows = []
        try:
            t0 = time.monotonic()
            up.wait_for("Baton is up", args.ready_timeout)
            first_up_s = time.monotonic() - t0
            pid = up.completion_pid()
            for k in range(args.kills):
                time.sleep(args.window + 1.0)  # out of the window: a first crash
                if mode == "standby":  # the spare (started after the last one was back) waits
                    up.wait_for("completion-0: warm standby ready", args.ready_timeout)
                load = os.getloadavg()[0]
                killed_at = time.monotonic()
                os.kill(pid, signal.SIGKILL)
                delay = float(up.wait_for(RESTARTING, 30)[1].group(1))
                pid = int(up.wait_for(RESTARTED, 60)[1].group(1))
                back_at, m = up.wait_for(BACK, args.ready_timeout)
                startup = next((s for s in reversed(up.log) if (sm := STARTUP.search(s))
                                and int(sm.group(3)) == pid), "")
                rows.append({"kill": k + 1, "kill_to_ready_s": back_at - killed_at,
                             "supervisor_gone_s": float(m.group(2)), "backoff_s": delay,
                             "load_1m": load, "engine_startup": STARTUP.search(startup).group(0)
                             if startup else ""})
                print(f"  {mode:<8} kill {k + 1}: {back_at - killed_at:5.1f} s  "
                      f"(backoff {delay:g} s, load {load:.1f})  {rows[-1]['engine_startup']}",
                      flush=True)
        finally:
            up.stop()
    times = [r["kill_to_ready_s"] for r in rows]
    return {"mode": mode, "first_up_s": first_up_s, "kills": rows,
            "median_kill_to_ready_s": statistics.median(times),
            "median_load_1m": statistics.median(r["load_1m"] for r in rows)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--modes", default="no-cache,cache,standby")
    p.add_argument("--window", type=float, default=15.0,
                   help="baton up --restart-window; kills come this + 1 s apart")
    p.add_argument("--port", type=int, default=18123)
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--out", default=str(HERE / "results" / "restart_time.json"))
    args = p.parse_args()
    results = []
    for mode in args.modes.split(","):
        print(f"{mode}: baton up, then {args.kills} kills of completion-0", flush=True)
        results.append(run_mode(mode, args, args.port))
    print(f"\n{'mode':<9} {'first up s':>10} {'median kill-to-ready s':>23} {'min':>6} "
          f"{'max':>6} {'load (1m)':>10}")
    for r in results:
        times = [k["kill_to_ready_s"] for k in r["kills"]]
        print(f"{r['mode']:<9} {r['first_up_s']:>10.1f} {r['median_kill_to_ready_s']:>23.1f} "
              f"{min(times):>6.1f} {max(times):>6.1f} {r['median_load_1m']:>10.1f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "host": {"cpus": os.cpu_count(), "machine": platform.machine()},
        "command": " ".join(["bench/restart_time.py", *sys.argv[1:]]),
        "window_s": args.window, "results": results}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
