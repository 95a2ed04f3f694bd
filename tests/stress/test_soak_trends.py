"""The soak's growth verdict (bench/soak.py) on recorded series, no deployment: a one-time heap
step is not a leak, wherever it falls in the window; a steady leak is, with or without a step."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import soak  # noqa: E402 - bench/soak.py, a script, not a package

# prompt-1 of a clean-clone CI run (11:12 UTC, 2026-12-06) from its judged start (10 s) on: flat,
# a 38 MiB rise over the samples at 27, 30 and 35 s (the first batch bigger than any
# before), flat again. Theil-Sen alone read 56.7 MiB/min: half its pairs straddle the step.
STEP_IN_THE_MIDDLE = [(11, 1039.41), (14, 1039.41), (16, 1039.41), (20, 1039.42), (25, 1039.44),
                      (27, 1039.45), (30, 1074.95), (35, 1077.42), (39, 1077.43), (42, 1077.43),
                      (44, 1077.43), (49, 1077.59), (54, 1077.6), (54, 1077.6)]


def test_a_step_in_the_middle_is_not_a_leak() -> None:
    assert soak.robust_slope_per_min(STEP_IN_THE_MIDDLE) > 50  # what the verdict used to read
    stepless, step = soak.without_largest_step(STEP_IN_THE_MIDDLE)
    assert 37.9 < step < 38.2  # over three intervals: 25 or 27 -> 30 -> 35 -> 39 s
    assert soak.robust_slope_per_min(stepless) < 1.0


def test_a_steady_leak_is_caught_with_or_without_a_step() -> None:
    leak = [(t, 1000 + 2.0 * t / 60) for t in range(10, 56, 2)]  # 2 MiB/min, sampled every 2 s
    assert abs(soak.robust_slope_per_min(soak.without_largest_step(leak)[0]) - 2.0) < 0.2
    stepped = [(t, v + (30 if t >= 30 else 0)) for t, v in leak]
    assert abs(soak.robust_slope_per_min(soak.without_largest_step(stepped)[0]) - 2.0) < 0.2
    flat = [(t, 1000.0) for t in range(10, 56, 2)]
    assert soak.without_largest_step(flat) == (flat, 0.0)


def test_trends_judges_the_stepless_slope() -> None:
    samples = [{"t": t, "name": "prompt-1", "pid": 7, "rss_mib": v, "anon_mib": v - 900,
                "fds": 41, "threads": 8} for t, v in [(0, 1034.3), *STEP_IN_THE_MIDDLE]]
    pools = [{"t": 0, "engine": "prompt-1", "written": 10, "total": 10}]
    cfg = soak.SoakConfig(warmup_s=10)
    (row,) = soak.trends(samples, cfg, [0.0], pools)
    assert row["judged_from_s"] == 10 and row["rss_slope_mib_min"] < 1.0
    assert row["rss_step_mib"] > 35 and row["anon_slope_mib_min"] < 1.0
