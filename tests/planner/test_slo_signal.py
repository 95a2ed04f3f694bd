"""The planner's SLO signal (planner/signals.py `slo_report`): the outcomes of the requests that
ended, summed as the planner reads them, and the live loop's check of it between decisions.
The router's report of them (`GET /planner/observations`): tests/router/test_path_choice.py;
the simulator's and the planner's rules on it: tests/sim/test_planner.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from baton.perf.profile import load
from planner.core import Planner, PlannerConfig, Split
from planner.loop import PlannerLoop
from planner.signals import Outcome, SloReport, slo_report

SLOS = {"ttft": 200.0, "tpot": 50.0}
PROFILE = load(Path(__file__).resolve().parents[1] / "data" / "profile_test.json")


def test_slo_report_counts_failed_requests_outside_and_reads_the_window():
    outcomes = [Outcome(10.0 + i, 0.05 * (i + 1), 0.01 * (i + 1), True) for i in range(10)]
    outcomes += [Outcome(15.5, 0.0, 0.0, False), Outcome(2.0, 9.0, 9.0, False)]
    report = slo_report(outcomes, SLOS, since_s=5.0)  # the failure at 2 s is out of the window
    # within: TTFT <= 200 ms and TPOT <= 50 ms: the first 4 of the 10 finished; of 11 ended
    assert report == SloReport(11, pytest.approx(4 / 11), pytest.approx(250.0),
                               pytest.approx(450.0), pytest.approx(50.0), pytest.approx(90.0))
    assert report.describe() == ("36% of 11 within the SLOs (TTFT p50/p90 250/450 ms, TPOT "
                                 "50/90 ms)")
    assert slo_report([], SLOS, 0.0) == SloReport(0, 1.0, 0.0, 0.0, 0.0, 0.0)
    # one SLO given: only it is judged
    assert slo_report(outcomes, {"ttft": 200.0}, 5.0).attainment == pytest.approx(4 / 11)
    assert slo_report(outcomes, {"tpot": 100.0}, 5.0).attainment == pytest.approx(10 / 11)


def test_the_loop_decides_between_intervals_only_when_a_miss_begins():
    """`PlannerLoop.tick(only_if_due=True)`, the SLO check between decisions: nothing while the
    SLO is met; a decision, urgent, once it is missed (planner/core.py `due`)."""

    class Table(Planner):  # predictions given: the decision rules alone
        def predict(self, split, specs):
            return {"8P:8D": 5.0, "10P:6D": 6.0}.get(split.name, 0.0)  # 20%: two sightings

    class Fleet:
        def __init__(self) -> None:
            self.applied: list[Split] = []

        def current_split(self) -> Split:
            return Split(8, 8)

        def apply(self, target: Split) -> None:
            self.applied.append(target)

    outcomes = [Outcome(20.0 + i / 10, 0.1, 0.02, True) for i in range(30)]
    arrivals = [(float(t), 100, 50) for t in range(30)]
    planner = Table(PROFILE, PlannerConfig(slos_ms=SLOS, interval_s=20, window_s=40,
                                           min_observations=5, max_reuses=0))
    fleet = Fleet()
    loop = PlannerLoop(planner, fleet, lambda: (30.0, arrivals, list(outcomes)), None, 20.0)
    assert loop.check_s == planner.config.slo_check_s
    first = loop.tick()  # the interval's decision: a 20% gain waits for a second sighting
    assert first["action"] == "wait" and first["slo"].startswith("100% of 30 within")
    assert loop.tick(only_if_due=True) is None  # met: nothing to decide between intervals
    outcomes += [Outcome(29.0, 0.0, 0.0, False)] * 10  # ten failed: 75% within
    second = loop.tick(only_if_due=True)
    assert second["action"] == "change" and "the SLO is missed" in second["reason"]
    assert second["slo"].startswith("75% of 40 within") and fleet.applied == [Split(10, 6)]
