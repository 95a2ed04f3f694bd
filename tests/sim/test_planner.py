"""The planner (planner/core.py) in the simulator's virtual time: it moves engines toward the
split a shifted workload needs, holds on a steady one, never loses a request to a role change
(S41: an engine switches only once empty), and refuses what makes no sense."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import random
import re
from pathlib import Path

import pytest

from baton.perf.profile import load
from baton.protocol import EngineStats
from baton.workload.synthetic import RequestSpec
from baton.workload.words import WORDS
from baton_cli.main import main as baton_main
from planner.core import Decision, Planner, PlannerConfig, Split, candidates
from planner.signals import LoadMeter, RoleLoad, evidence
from simulator.fleet import FleetConfig
from simulator.run import SimConfig, simulate

DATA = Path(__file__).resolve().parents[1] / "data"
PROFILE = load(DATA / "profile_test.json")
SLOS = {"ttft": 2000.0, "tpot": 100.0}
KINDS = {"chat": ((50, 200), (40, 120)), "retrieval": ((1500, 3000), (10, 40))}


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


@functools.cache
def _run(phases: tuple[str, ...], start: tuple[int, int], apply: bool = True,
         until_s: float = math.inf) -> dict:
    """One planner run (deterministic: the tests that read the same run share it; none
    changes the record), of the requests that arrive before `until_s`."""
    planner = Planner(PROFILE, PlannerConfig(slos_ms=SLOS, interval_s=8, window_s=12,
                                             min_observations=8, cooldown_s=20,
                                             max_candidates=3, apply=apply))
    fleet = FleetConfig(num_normal=0, num_prompt=start[0], num_completion=start[1])
    specs = [s for s in _specs(list(phases)) if s.arrival_s < until_s]
    return simulate(PROFILE, SimConfig(fleet=fleet, slos_ms=SLOS), None, specs=specs,
                    planner=planner)


class _Scripted(Planner):
    """A planner whose predictions are given (split name -> goodput, per decision): the
    decision rules alone, no simulation."""

    def __init__(self, script: list[dict[str, float]], **overrides) -> None:
        base = dict(slos_ms=SLOS, interval_s=20, window_s=40, min_observations=1,
                    cooldown_s=300, max_candidates=8, max_reuses=0)
        super().__init__(PROFILE, PlannerConfig(**base | overrides))
        self.script = iter(script)
        self.table: dict[str, float] = {}
        self.num_predictions = 0

    def decide(self, now_s, current, prompt_tokens=10, engines=None, outcomes=None):
        self.table = next(self.script)
        arrivals = [(float(t), prompt_tokens, 10) for t in range(int(now_s))]  # 1 req/s
        return super().decide(now_s, current, arrivals, engines, outcomes)

    def predict(self, split, specs):
        self.num_predictions += 1
        return self.table.get(split.name, 0.0)


def _actions(planner: _Scripted, start: Split, n: int) -> list[tuple[float, str, str]]:
    out, current = [], start
    for i in range(n):
        d = planner.decide(20.0 * (i + 1), current)
        out.append((20.0 * (i + 1), d.action, d.target.name))
        if d.action == "change":
            current = d.target
    return out


def test_an_urgent_gain_acts_on_its_first_sighting():
    p = _Scripted([{"8P:8D": 2.0, "12P:4D": 6.0, "15P:1D": 6.0}])
    assert _actions(p, Split(8, 8), 1) == [(20.0, "change", "12P:4D")]


def test_a_small_gain_needs_confirmations_in_one_direction():
    # 20% more: two decisions in a row must want engines moved the same way; the target may
    # differ between them (the second names it)
    script = [{"8P:8D": 5.0, "9P:7D": 6.0}, {"8P:8D": 5.0, "10P:6D": 6.0}]
    assert _actions(_Scripted(script), Split(8, 8), 2) == [
        (20.0, "wait", "9P:7D"), (40.0, "change", "10P:6D")]
    # a reversal between them starts the count again: no change
    script = [{"8P:8D": 5.0, "9P:7D": 6.0}, {"8P:8D": 5.0, "7P:9D": 6.0},
              {"8P:8D": 5.0, "9P:7D": 6.0}]
    assert [a for _, a, _ in _actions(_Scripted(script), Split(8, 8), 3)] == ["wait"] * 3


def test_within_the_margin_it_holds_and_forgets_a_pending_move():
    script = [{"8P:8D": 5.0, "9P:7D": 6.0}, {"8P:8D": 5.0, "9P:7D": 5.4},
              {"8P:8D": 5.0, "9P:7D": 6.0}]
    assert [a for _, a, _ in _actions(_Scripted(script), Split(8, 8), 3)] == [
        "wait", "hold", "wait"]


def test_cooldowns_small_gains_wait_the_full_one_urgent_ones_the_short_one():
    # an urgent change at 20 s; then a 20% gain waits the 300 s cooldown...
    script = [{"8P:8D": 1.0, "12P:4D": 6.0}] + [{"12P:4D": 5.0, "13P:3D": 6.0}] * 15
    acts = _actions(_Scripted(script), Split(8, 8), 16)
    assert [t for t, a, _ in acts if a == "change"] == [20.0, 320.0]
    # ... and an urgent gain the 60 s one
    script = [{"8P:8D": 1.0, "12P:4D": 6.0}] + [{"12P:4D": 2.0, "8P:8D": 6.0}] * 4
    acts = _actions(_Scripted(script), Split(8, 8), 5)
    assert [(t, n) for t, a, n in acts if a == "change"] == [(20.0, "12P:4D"), (80.0, "8P:8D")]


def test_the_nearest_of_the_splits_tied_with_the_best_wins():
    # 15P:1D is 1% better than 10P:6D: within the tie, so the move of 2 engines, not 7
    p = _Scripted([{"8P:8D": 1.0, "10P:6D": 5.95, "15P:1D": 6.0, "12P:4D": 5.0}])
    assert _actions(p, Split(8, 8), 1) == [(20.0, "change", "10P:6D")]
    p = _Scripted([{"8P:8D": 1.0, "10P:6D": 5.95, "15P:1D": 6.0}], tie=0.0)
    assert _actions(p, Split(8, 8), 1) == [(20.0, "change", "15P:1D")]


def test_steady_noisy_predictions_make_at_most_one_change_per_cooldown():
    # 10 simulated minutes of predictions wandering around equal goodput on a steady load
    names = [s.name for s in candidates(Split(8, 8), 16, 8)]

    def changes(noise: float, **overrides) -> list:
        rng = random.Random(5)
        script = [{n: 5.0 * (1 + rng.uniform(-noise, noise)) for n in names}
                  for _ in range(30)]
        acts = _actions(_Scripted(script, **overrides), Split(8, 8), 30)
        return [a for a in acts if a[1] == "change"]

    assert changes(0.04) == []  # +-4%: never past the 10% margin
    assert len(changes(0.08, cooldown_s=600)) <= 1  # noise past the margin: the cooldown


def test_a_steady_load_is_not_replayed_every_interval():
    p = _Scripted([{"8P:8D": 5.0}] * 6, max_reuses=2)
    actions = [p.decide(20.0 * (i + 1), Split(8, 8)).action for i in range(4)]
    assert actions == ["hold"] * 4 and p.num_predictions == 2 * 8  # replays at 20 and 80 s
    p.decide(100.0, Split(8, 8), prompt_tokens=12)  # 20% more prompt tokens: replayed
    assert p.num_predictions == 3 * 8


def _engines(now_s: float, prompt_busy: float, completion_busy: float, prompt_queue: int = 0,
             completion_kv: float = 0.2, completion_queue: int = 0) -> list[EngineStats]:
    """Two engines of each role whose busy seconds grew at these fractions since t = 0."""
    def one(name, role, busy, queue, kv):
        return EngineStats(name, role, num_total_blocks=100, num_free_blocks=round(100 * (1 - kv)),
                           num_running=4, num_waiting=queue, extra={"busy_s": busy * now_s})

    return [one(f"p{i}", "prompt", prompt_busy, prompt_queue, 0.3) for i in range(2)] + [
        one(f"c{i}", "completion", completion_busy, completion_queue, completion_kv)
        for i in range(2)]


def test_the_load_meter_reads_busy_fractions_queues_and_kv_per_role():
    meter = LoadMeter()
    first = meter.read(10.0, _engines(10.0, 0.95, 0.3, prompt_queue=6, completion_kv=0.5))
    assert first["prompt"] == RoleLoad(2, 6.0, 0.3, None)  # one reading: no busy fraction yet
    loads = meter.read(30.0, _engines(30.0, 0.95, 0.3, prompt_queue=6, completion_kv=0.5))
    assert loads["prompt"].busy_fraction == pytest.approx(0.95)
    assert loads["completion"] == pytest.approx(RoleLoad(2, 0.0, 0.5, 0.3))
    # a draining engine is left out; a counter that went down (a restart) counts from zero
    again = _engines(40.0, 0.95, 0.3)
    again[0].draining = True
    again[2].extra["busy_s"] = 2.0
    loads = meter.read(40.0, again)
    assert loads["prompt"].num_engines == 1
    assert loads["completion"].busy_fraction == pytest.approx((0.2 + 0.3) / 2)


def test_evidence_a_saturated_role_beside_an_idle_one():
    def ev(prompt: RoleLoad, completion: RoleLoad):
        return evidence({"prompt": prompt, "completion": completion}, 0.9, 0.5, 4.0, 0.9)

    idle, busy = RoleLoad(2, 0.0, 0.2, 0.3), RoleLoad(2, 0.0, 0.2, 0.97)
    assert ev(busy, idle).direction == 1  # prompt engines busy, completion idle
    assert ev(RoleLoad(2, 5.0, 0.2, 0.7), idle).direction == 1  # ... or queued
    assert ev(idle, RoleLoad(2, 6.0, 0.5, 1.0)).direction == -1  # completion queued
    assert ev(idle, RoleLoad(2, 0.0, 0.95, 1.0)) [:2] == (-1, True)  # completion KV full
    # a busy completion engine is not saturated (it steps while anything decodes)
    assert ev(idle, RoleLoad(2, 0.0, 0.5, 1.0)).direction == 0
    assert ev(busy, busy).direction == 0  # both saturated: no role to take engines from
    assert ev(busy, RoleLoad(2, 0.0, 0.2, None)).direction == 0  # busy time not known
    assert evidence({}, 0.9, 0.5, 4.0, 0.9).direction == 0  # no engines read


def test_the_engines_load_confirms_vetoes_and_guards_kv():
    small = {"8P:8D": 5.0, "10P:6D": 6.0}  # 20%: normally two confirmations
    prompt_saturated = dict(prompt_busy=0.97, completion_busy=0.3)
    # it agrees: one sighting is enough (the first reading sets the meter, the second decides)
    p = _Scripted([{"8P:8D": 5.0}, small])
    p.decide(20.0, Split(8, 8), engines=_engines(20.0, **prompt_saturated))
    d = p.decide(40.0, Split(8, 8), engines=_engines(40.0, **prompt_saturated))
    assert (d.action, d.target.name) == ("change", "10P:6D") and "agrees" in d.reason
    assert d.engines.startswith("prompt busy 97%")
    # it disagrees (completion queued, prompt idle): the small move waits, an urgent one acts
    p = _Scripted([{"8P:8D": 5.0}, small, small, {"8P:8D": 2.0, "10P:6D": 6.0}])
    against = dict(prompt_busy=0.2, completion_busy=1.0, completion_queue=8)
    actions = [p.decide(20.0 * i, Split(8, 8), engines=_engines(20.0 * i, **against)).action
               for i in (1, 2, 3, 4)]
    assert actions == ["hold", "wait", "wait", "change"]
    # completion KV nearly full: a small shrink of the completion engines waits
    p = _Scripted([small] * 3)
    full = dict(prompt_busy=0.7, completion_busy=1.0, completion_kv=0.95)
    d = [p.decide(20.0 * i, Split(8, 8), engines=_engines(20.0 * i, **full)) for i in (1, 2, 3)]
    assert [x.action for x in d] == ["wait"] * 3 and "KV nearly full" in d[-1].reason
    # without the engines' load: the two confirmations of before
    p = _Scripted([small] * 2)
    assert [p.decide(20.0 * i, Split(8, 8)).action for i in (1, 2)] == ["wait", "change"]


def test_a_held_load_is_replayed_when_the_engines_say_a_role_saturates():
    p = _Scripted([{"8P:8D": 5.0}] * 4, max_reuses=5)
    calm = dict(prompt_busy=0.7, completion_busy=0.3)
    p.decide(20.0, Split(8, 8), engines=_engines(20.0, **calm))
    p.decide(40.0, Split(8, 8), engines=_engines(40.0, **calm))
    assert p.num_predictions == 8  # held on an unmoved load: one replay
    p.decide(60.0, Split(8, 8), engines=_engines(60.0, **calm, prompt_queue=6))
    assert p.num_predictions == 2 * 8


def _outcomes(now_s: float, num: int, num_slow: int = 0, num_failed: int = 0) -> list:
    """Requests that ended in the second before `now_s`: TTFT 100 ms, TPOT 20 ms, `num_slow`
    of them at a TPOT of 500 ms (past the 100 ms SLO), then `num_failed` failed ones."""
    ended = [(now_s - 1 + i / (num + num_failed), 0.1, 0.5 if i < num_slow else 0.02, True)
             for i in range(num)]
    return ended + [(now_s - 0.01 * (i + 1), 0.0, 0.0, False) for i in range(num_failed)]


def test_a_missed_slo_makes_a_predicted_move_urgent():
    small = {"8P:8D": 5.0, "10P:6D": 6.0}  # 20%: normally two confirmations
    p = _Scripted([small])
    d = p.decide(20.0, Split(8, 8), outcomes=_outcomes(20.0, 30, num_slow=10))
    assert (d.action, d.target.name) == ("change", "10P:6D") and "SLO is missed" in d.reason
    assert d.slo == "67% of 30 within the SLOs (TTFT p50/p90 100/100 ms, TPOT 20/500 ms)"
    # failed requests are outside the SLO (25 of 30 within: 83%, under the 95% target)
    p = _Scripted([small])
    d = p.decide(20.0, Split(8, 8), outcomes=_outcomes(20.0, 25, num_failed=5))
    assert d.action == "change" and d.slo.startswith("83% of 30")
    # met (29 of 30 within), or too few ended to say (min_observations): two confirmations
    for outcomes, overrides in ((_outcomes(20.0, 30, num_slow=1), {}),
                                (_outcomes(20.0, 5, num_failed=5), {"min_observations": 15})):
        p = _Scripted([small] * 2, **overrides)
        assert [p.decide(20.0 * i, Split(8, 8), outcomes=outcomes).action
                for i in (1, 2)] == ["wait", "change"]
    # missed, but no split predicted past the margin: it holds (a miss alone moves nothing)
    p = _Scripted([{"8P:8D": 5.0, "10P:6D": 5.3}])
    assert p.decide(20.0, Split(8, 8), outcomes=_outcomes(20.0, 30, 10)).action == "hold"
    # missed, the engines' load says the other way: the small move still waits
    p = _Scripted([{"8P:8D": 5.0}, small])
    against = dict(prompt_busy=0.2, completion_busy=1.0, completion_queue=8)
    p.decide(20.0, Split(8, 8), engines=_engines(20.0, **against))
    d = p.decide(40.0, Split(8, 8), engines=_engines(40.0, **against),
                 outcomes=_outcomes(40.0, 30, 10))
    assert d.action == "wait" and "other way" in d.reason
    # a missed SLO waits only the urgent cooldown (60 s) after a change, not the full one
    script = [{"8P:8D": 1.0, "12P:4D": 6.0}] + [{"12P:4D": 5.0, "13P:3D": 6.0}] * 3
    p, current, acts = _Scripted(script), Split(8, 8), []
    for t in (20.0, 40.0, 60.0, 80.0):
        d = p.decide(t, current, outcomes=_outcomes(t, 30, 10))
        current = d.target if d.action == "change" else current
        acts.append((t, d.action))
    assert acts == [(20.0, "change"), (40.0, "wait"), (60.0, "wait"), (80.0, "change")]


def test_a_miss_that_begins_between_decisions_brings_one_forward():
    p = _Scripted([{"8P:8D": 5.0}] * 3, max_reuses=5)
    p.decide(20.0, Split(8, 8), outcomes=_outcomes(20.0, 30))
    assert not p.due(25.0, _outcomes(25.0, 30))  # met: the next decision at 40 s
    assert p.due(25.0, _outcomes(25.0, 30, num_failed=10))  # a miss began: decide now
    p.decide(25.0, Split(8, 8), outcomes=_outcomes(25.0, 30, num_failed=10))
    assert p.num_predictions == 2 * 8  # a missed SLO replays a held load at once
    assert not p.due(30.0, _outcomes(30.0, 30, num_failed=10))  # the same miss: once
    p.decide(40.0, Split(8, 8), outcomes=_outcomes(40.0, 30))
    assert p.due(45.0, _outcomes(45.0, 30, num_slow=5))  # met at 40 s: a new miss


def test_the_simulator_gives_the_planner_outcomes_and_checks_the_slo_between_decisions():
    class Probe(Planner):
        def __init__(self) -> None:
            super().__init__(PROFILE, PlannerConfig(slos_ms=SLOS, interval_s=10,
                                                    slo_check_s=2.5))
            self.checks, self.seen = [], []

        def due(self, now_s, outcomes):
            self.checks.append(now_s)
            return now_s == 12.5

        def decide(self, now_s, current, observations, engines=None, outcomes=None):
            self.seen.append((now_s, list(outcomes)))
            return Decision("hold", Split(*current), "test")

    planner = Probe()
    specs = _specs(["chat"], rate=2.0, phase_s=25.0)
    fleet = FleetConfig(num_normal=0, num_prompt=1, num_completion=3)
    rec = simulate(PROFILE, SimConfig(fleet=fleet, slos_ms=SLOS), None, specs=specs,
                   planner=planner)
    assert [t for t, _ in planner.seen][:3] == [10.0, 12.5, 20.0]
    assert planner.checks[:4] == [2.5, 5.0, 7.5, 12.5]  # none at a decision's own time
    ended = {r["idx"]: r for r in rec["requests"]}
    t, outcomes = planner.seen[2]
    assert outcomes and all(o.done_s <= t and o.ok for o in outcomes)
    finished = sorted(r["start_s"] + r["e2e_s"] for r in ended.values()
                      if r["start_s"] + r["e2e_s"] <= t)
    assert [o.done_s for o in outcomes] == pytest.approx(finished)
    assert [o.ttft_s for o in outcomes][:1] == pytest.approx(
        [min(ended.values(), key=lambda r: r["start_s"] + r["e2e_s"])["ttft_s"]])


def test_advise_never_records_a_change():
    p = _Scripted([{"8P:8D": 1.0, "12P:4D": 6.0}] * 3, apply=False)
    acts = _actions(p, Split(8, 8), 3)
    assert [a for _, a, _ in acts] == ["advise"] * 3  # it never changed, so it keeps advising


def test_candidates_are_the_current_split_and_its_neighbours():
    assert candidates(Split(4, 4), 8, 5) == [(4, 4), (5, 3), (3, 5), (6, 2), (2, 6)]
    assert candidates(Split(1, 3), 4, 8) == [(1, 3), (2, 2), (3, 1)]
    # moves of 1, 2, 4, 8: one past an end is the extreme split (a big shift in one change)
    assert candidates(Split(2, 14), 16, 8) == [(2, 14), (3, 13), (1, 15), (4, 12), (6, 10),
                                               (10, 6), (15, 1)]
    assert candidates(Split(8, 8), 16, 9)[-2:] == [(15, 1), (1, 15)]


def test_a_shift_to_long_prompts_moves_engines_to_the_prompt_role():
    rec = _run(("chat", "retrieval"), (1, 3))
    s, fleet = rec["summary"], rec["fleet"]
    # the simulated engines' load reached the planner (planner/signals.py), as a live one's
    read = [d["engines"] for d in fleet["planner_decisions"][1:]]
    assert read and all(re.match(r"prompt busy \d+%, [\d.]+ queued/engine, KV \d+%; "
                                 r"completion busy \d+%", e) for e in read), read
    assert s["num_failed"] == 0 and s["num_completed"] == s["num_issued"]  # none lost
    changes = [d for d in fleet["planner_decisions"] if d["action"] == "change"]
    assert changes and all(d["t"] > 40 for d in changes), fleet["planner_decisions"]
    last = fleet["roles_over_time"][-1]
    assert last["prompt"] >= 2 and last["prompt"] + last["completion"] == 4
    assert last["draining"] == 0
    # every engine drained at the end (simulate checks free == total on each)



def test_advise_decides_but_changes_nothing():
    applied = _run(("chat", "retrieval"), (1, 3))["fleet"]["planner_decisions"]
    first_change = next(d for d in applied if d["action"] == "change")
    # the same arrivals up to the first change (what came after cannot touch the decisions
    # before): the run is shorter
    fleet = _run(("chat", "retrieval"), (1, 3), apply=False,
                 until_s=first_change["t"] + 1)["fleet"]
    assert any(d["action"] == "advise" for d in fleet["planner_decisions"])
    assert {(r["prompt"], r["completion"]) for r in fleet["roles_over_time"]} == {(1, 3)}
    # deterministic: advise saw what apply acted on, at the same times
    first_advice = next(d for d in fleet["planner_decisions"] if d["action"] == "advise")
    assert (first_advice["t"], first_advice["target"]) == (first_change["t"],
                                                           first_change["target"])


def test_a_steady_workload_on_a_fitting_split_holds():
    fleet = _run(("chat", "chat"), (1, 3))["fleet"]
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
    with pytest.raises(ValueError, match="urgent_margin"):
        PlannerConfig(slos_ms=SLOS, margin=0.2, urgent_margin=0.1)
    with pytest.raises(ValueError, match="urgent_cooldown_s"):
        PlannerConfig(slos_ms=SLOS, urgent_cooldown_s=-1)
    # `baton up --planner`: its tuning is checked before anything starts
    from baton_cli.launch_config import LaunchConfig

    up = dict(planner="apply", planner_profile=str(DATA / "profile_test.json"), slos_ms=SLOS)
    assert LaunchConfig(**up, planner_min_requests=4).planner_config().min_observations == 4
    with pytest.raises(ValueError, match="slo_target"):
        LaunchConfig(**up, planner_slo_target=1.5)


def test_baton_ups_planner_simulates_the_engines_it_runs():
    """The fleet `baton up --planner` simulates has the engines' limits from the flags after
    `--` (their defaults without any): a planner predicting other engines than it runs is
    wrong by however much they differ."""
    from baton.engine.config import SERVE_MAX_NUM_BATCHED_TOKENS
    from baton.perf.profile import load
    from baton_cli.launch_config import LaunchConfig

    profile = load(DATA / "profile_test.json")
    up = dict(planner="apply", planner_profile=str(DATA / "profile_test.json"), slos_ms=SLOS)
    plain = LaunchConfig(**up).planner_fleet(profile)
    assert (plain.num_prompt, plain.num_completion, plain.num_normal) == (1, 1, 0)
    assert (plain.max_num_seqs, plain.max_num_batched_tokens, plain.num_blocks) == \
        (64, SERVE_MAX_NUM_BATCHED_TOKENS, 0)
    fleet = LaunchConfig(**up, engine_args=[
        "--max-num-seqs", "16", "--max-num-batched-tokens=512", "--kv-cache-gb", "0.5",
        "--no-enable-prefix-caching", "--kv-timeout", "9"]).planner_fleet(profile)
    assert (fleet.max_num_seqs, fleet.max_num_batched_tokens, fleet.enable_prefix_caching) == \
        (16, 512, False)
    assert fleet.num_blocks == round(profile.model.num_blocks / 2)
    assert LaunchConfig(**up, engine_args=["--num-blocks", "300"]).planner_fleet(
        profile).num_blocks == 300


def test_baton_sim_planner_is_built_by_the_composition_root(tmp_path, capsys):
    """`baton sim --planner` (baton_cli/sim.py builds the planner, so the simulator imports no
    planner code); the simulator's own `run` without that factory refuses the flag."""
    import argparse

    from simulator import cli as sim_cli

    argv = ["sim", "--profile", str(DATA / "profile_test.json"), "--num-requests", "12",
            "--request-rate", "2", "--planner", "advise", "--engines", "2",
            "--goodput", "ttft:2000", "tpot:100", "--label", "adv",
            "--results-dir", str(tmp_path)]
    tuning = ["--planner-interval", "2", "--planner-min-requests", "13",
              "--planner-slo-target", "0.9", "--planner-slo-check", "0"]
    assert baton_main(argv + tuning) == 0
    assert "planner (advise)" in capsys.readouterr().out
    (path,) = tmp_path.glob("serve_adv_*.json")
    decisions = json.loads(path.read_text())["fleet"]["planner_decisions"]
    # the tuning flags reach the planner: every 2 s, and 12 requests are under 13 (it holds)
    assert [d["t"] for d in decisions][:3] == [2.0, 4.0, 6.0]
    assert {d["action"] for d in decisions} == {"hold"}
    assert all(d["reason"].endswith("(< 13)") for d in decisions)
    for flag, bad, name in (("--planner-slo-target", "1.5", "slo_target"),
                            ("--planner-min-requests", "x", "--planner-min-requests")):
        with pytest.raises(SystemExit) if bad == "x" else contextlib.nullcontext():
            assert baton_main(argv + [flag, bad]) == 2
        assert name in capsys.readouterr().err
    parser = argparse.ArgumentParser()
    sim_cli.add_parser(parser.add_subparsers())
    assert sim_cli.run(parser.parse_args(argv)) == 2
    assert "--planner needs the planner" in capsys.readouterr().err


def test_a_planner_that_holds_scores_what_its_fixed_split_scores():
    # its periodic tick after the last request must not stretch the run's duration
    specs = _specs(["chat"])
    fleet = FleetConfig(num_normal=0, num_prompt=1, num_completion=3)
    holder = Planner(PROFILE, PlannerConfig(slos_ms=SLOS, interval_s=7, min_observations=10**6))
    fixed, held = (simulate(PROFILE, SimConfig(fleet=fleet, slos_ms=SLOS), None, specs=specs,
                            planner=p)["summary"] for p in (None, holder))
    assert (held["duration_s"], held["goodput"]) == (fixed["duration_s"], fixed["goodput"])


def test_every_engine_of_a_change_switches_once_it_is_empty():
    # A change under a decode-heavy load: an engine whose last request ends just before a step
    # that runs nothing switches then too (it waited for an event that never came, and the
    # planner, which holds while a change drains, never decided again).
    class Forced(Planner):
        def decide(self, now_s, current, observations, engines=None, outcomes=None):
            target = Split(4, 4) if now_s == 10.0 else Split(*current)
            return Decision("change" if target != Split(*current) else "hold", target, "test")

    rng, specs, t = random.Random(1), [], 0.0
    while (t := t + rng.expovariate(6.0)) < 20.0:
        n = rng.randint(100, 400)
        specs.append(RequestSpec(len(specs), "chat", " ".join(rng.choices(WORDS, k=n)), n,
                                 rng.randint(200, 800), arrival_s=t))
    fleet = FleetConfig(num_normal=0, num_prompt=2, num_completion=6)
    planner = Forced(PROFILE, PlannerConfig(slos_ms=SLOS, interval_s=10))
    rec = simulate(PROFILE, SimConfig(fleet=fleet, slos_ms=SLOS), None, specs=specs,
                   planner=planner)
    last = rec["fleet"]["roles_over_time"][-1]
    assert (last["prompt"], last["completion"], last["draining"]) == (4, 4, 0)
    assert rec["summary"]["num_completed"] == len(specs)
