"""The engine's start-up breakdown (baton/ops/startup.py): the phases add up to the time since
the process started, and a real completion engine logs one line naming each phase and what the
load cache did."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

from baton.ops.startup import StartupClock, process_age_s
from tests.cluster import EngineProcess
from tests.model.tiny_gguf import write_tiny_gguf

LINE = re.compile(r"start-up ([\d.]+) s: imports ([\d.]+), weights ([\d.]+) \((\w+)\), "
                  r"kv pool \+ runner ([\d.]+), engine core ([\d.]+), transfer agent ([\d.]+), "
                  r"service ([\d.]+) \(since process start, pid (\d+)\)")


def test_clock_phases_add_up_to_the_process_age() -> None:
    age = process_age_s()
    assert age is not None and age > 0  # Linux: from /proc/self/stat
    clock = StartupClock()
    clock.mark("imports")
    time.sleep(0.05)
    assert clock.mark_split([("weights", 0.02)], "engine core") >= 0.02
    line = clock.summary()
    assert re.fullmatch(r"start-up [\d.]+ s: imports [\d.]+, weights 0\.0, engine core 0\.\d "
                        r"\(since process start, pid \d+\)", line), line
    assert abs(sum(s for _, s in clock.phases) - clock.total_s) < 1e-6
    assert clock.total_s >= age


def test_engine_help_documents_the_breakdown() -> None:
    out = subprocess.run([sys.executable, "-m", "baton_cli", "completion-engine", "--help"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    for phase in ("imports", "weights", "kv pool + runner", "engine core", "transfer agent",
                  "service", "--load-cache-dir", "--no-load-cache"):
        assert phase in out


def test_completion_engine_logs_its_breakdown(tmp_path: Path) -> None:
    """One real start (a cache hit: the test's own load wrote the cache; the miss is in
    tests/model/test_load_cache.py)."""
    from baton.model.load_cache import load_with_cache

    model = write_tiny_gguf(tmp_path / "tiny.gguf")
    assert load_with_cache(model, "float32", "cpu", "none", tmp_path / "c")[1] == "miss"
    args = ["--model", str(model), "--num-blocks", "16", "--load-cache-dir", str(tmp_path / "c")]
    engine = EngineProcess("completion-engine", "c0", tmp_path, args=args)
    try:
        engine.wait_ready(time.monotonic() + 120)
        deadline = time.monotonic() + 10
        while not LINE.search(engine.tail(20000)) and time.monotonic() < deadline:
            time.sleep(0.1)
        m = LINE.search(engine.tail(20000))
        assert m, engine.tail()
    finally:
        engine.stop()
    total, *phases = (float(m.group(i)) for i in (1, 2, 3, 5, 6, 7, 8))
    assert m.group(4) == "hit" and int(m.group(9)) == engine.proc.pid
    assert abs(sum(phases) - total) <= 0.1 * len(phases)  # each printed to 0.1 s
