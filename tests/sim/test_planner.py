"""The planner (planner/core.py) in the simulator's virtual time: it moves engines toward the
split a shifted workload needs, holds on a steady one, never loses a request to a role change
(S41: an engine switches only once empty), and refuses what makes no sense."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from baton.perf.profile import load
from baton.workload.synthetic import RequestSpec
from baton.workload.words import WORDS
from baton_cli.main import main as baton_main
from planner.core import Planner, PlannerConfig, Split, candidates
from simulator.fleet import FleetConfig
from simulator.run import SimConfig, simulate

DATA = Path(__file__).resolve().parents[1] / "data"
PROFILE = load(DATA / "profile_test.json")
SLOS = {"ttft": 2000.0, "tpot": 100.0}
KINDS = {"chat": ((50, 200), (100, 300)), "retrieval": ((1500, 3000), (10, 40))}


def _specs(phases: list[str], rate: float = 1.5, phase_s: float = 40.0) -> list[RequestSpec]:
    rng, specs, t = random.Random(3), [], 0.0
    for i, kind in enumerate(phases):
        (lo_in, hi_in), (lo_out, hi_out) = KINDS[kind]
        while (t := t + rng.expovariate(rate)) < (i + 1) * phase_s:
            n = rng.randint(lo_in, hi_in)
            specs.append(RequestSpec(len(specs), kind, " ".join(rng.choices(WORDS, k=n)), n,
                                     rng.randint(lo_out, hi_out), arrival_s=t))
        t = (i + 1) * phase_s
    return specs


def _run(phases: list[str], start: tuple[int, int], apply: bool = True) -> dict:
    planner = Planner(PROFILE, PlannerConfig(slos_ms=SLOS, interval_s=8, window_s=12,
                                             min_observations=8, cooldown_s=20,
                                             max_candidates=3, apply=apply))
    fleet = FleetConfig(num_normal=0, num_prompt=start[0], num_completion=start[1])
    return simulate(PROFILE, SimConfig(fleet=fleet, slos_ms=SLOS), None,
                    specs=_specs(phases), planner=planner)


def test_candidates_are_the_current_split_and_its_neighbours():
    assert candidates(Split(4, 4), 8, 5) == [(4, 4), (1, 7), (7, 1), (5, 3), (3, 5)]
    assert candidates(Split(1, 3), 4, 8) == [(1, 3), (3, 1), (2, 2)]


def test_a_shift_to_long_prompts_moves_engines_to_the_prompt_role():
    rec = _run(["chat", "retrieval"], (1, 3))
    s, fleet = rec["summary"], rec["fleet"]
    assert s["num_failed"] == 0 and s["num_completed"] == s["num_issued"]  # none lost
    changes = [d for d in fleet["planner_decisions"] if d["action"] == "change"]
    assert changes and all(d["t"] > 40 for d in changes), fleet["planner_decisions"]
    last = fleet["roles_over_time"][-1]
    assert last["prompt"] >= 2 and last["prompt"] + last["completion"] == 4
    assert last["draining"] == 0
    # every engine drained at the end (simulate checks free == total on each)



def test_advise_decides_but_changes_nothing():
    fleet = _run(["chat", "retrieval"], (1, 3), apply=False)["fleet"]
    assert any(d["action"] == "advise" for d in fleet["planner_decisions"])
    assert {(r["prompt"], r["completion"]) for r in fleet["roles_over_time"]} == {(1, 3)}
    # deterministic: advise saw what apply acted on, at the same times
    applied = _run(["chat", "retrieval"], (1, 3))["fleet"]["planner_decisions"]
    first_change = next(d for d in applied if d["action"] == "change")
    first_advice = next(d for d in fleet["planner_decisions"] if d["action"] == "advise")
    assert (first_advice["t"], first_advice["target"]) == (first_change["t"],
                                                           first_change["target"])


def test_a_steady_workload_on_a_fitting_split_holds():
    fleet = _run(["chat", "chat"], (1, 3))["fleet"]
    assert not [d for d in fleet["planner_decisions"] if d["action"] == "change"]


def test_planner_flags_are_checked(capsys):
    base = ["sim", "--profile", str(DATA / "profile_test.json"), "--num-requests", "5"]
    assert baton_main([*base, "--planner", "apply", "--goodput", "ttft:1000"]) == 2
    assert "--planner needs --engines" in capsys.readouterr().err
    assert baton_main([*base, "--planner", "apply", "--engines", "4"]) == 2
    assert "--planner needs --goodput" in capsys.readouterr().err
    assert baton_main([*base, "--engines", "4"]) == 2
    assert baton_main([*base, "--planner", "apply", "--engines", "4", "--prompt-engines", "1",
                       "--completion-engines", "1", "--goodput", "ttft:1000"]) == 2
    with pytest.raises(ValueError, match="needs SLOs"):
        PlannerConfig(slos_ms={})
