"""The planner's decision, one function of what it observed: the same code in the simulator's
virtual time (`baton sim --planner`) and beside a live fleet (`baton up --planner`).

Every `interval_s` the planner takes the requests that arrived in the last `window_s` (arrival
time, prompt tokens, output tokens), replays them through the simulator (simulator/run.py: the
real scheduler over the profile's step times) on each candidate prompt:completion split of the
budget, and keeps the split with the most goodput (requests meeting every SLO per second).
The replay runs the window twice in a row and scores the second copy (`warmup`): a fleet that
has served a load for a while holds the decodes of its last minute, and a replay from an empty
fleet would not (answers of a few hundred tokens outlive a 40-s window; from empty, a split
short of completion engines looks as good as the right one until its KV runs out).
It decides from its first interval on, once the window holds `min_observations` requests
(the window need not be full yet). It acts only when
  - it saw at least `min_observations` requests (a quiet window says nothing),
  - the best split beats the current one's predicted goodput by `margin` (hysteresis: two
    splits within the noise of the prediction never flip-flop),
  - `confirmations` decisions in a row wanted engines moved the same way (a burst is not a
    shift), and
  - `cooldown_s` passed since its last change (a change costs a drain).
Strong evidence shortens the wait: a predicted gain of `urgent_margin` or more (e.g. 1.5x the
goodput: the current split is failing its SLOs, not merely second best) acts on its first
sighting and after `urgent_cooldown_s`. Small gains keep the full hysteresis, so a steady load
makes at most one change per cooldown, and an oscillation needs a 10% predicted gain each way.
The target is the split nearest the current one among those within `tie` of the best predicted
goodput (fewer engines drained for the same gain, and no jump to an extreme split that the
prediction rates equal), and every engine of the move changes at once (one drain, not one per
cooldown).
The engines' own load (planner/signals.py: queues, KV usage, busy fractions per role, from the
same `EngineStats` a live engine answers a probe with and `baton sim` fills from its engines)
weighs in beside the prediction: a role saturated while the other idles confirms a predicted
move toward it at once, and turns a small predicted move the other way into a wait; nearly full
completion KV turns a small predicted shrink of the completion engines into a wait; and a role
saturated beside an idle one is replayed at once, not held on an unmoved load.
What the requests met weighs in too (planner/signals.py `slo_report`: the requests that ended
in the window, TTFT and TPOT p50/p90 and the share within every SLO, a failed or refused
request outside it; the router reports them live, `baton sim` from its requests), counting
only requests that ended since its last change (those before ran on a split the fleet no longer
has). The SLO is missed when that share is under `slo_target` (over at least
`min_observations` requests):
  - a missed SLO while the prediction wants engines moved past the margin makes the move
    urgent: it acts on its first sighting and after `urgent_cooldown_s` (the fleet is failing
    its SLOs in fact, not only in the replay); the engines' load saying the other way still
    makes it wait (only an urgent prediction overrides them);
  - a missed SLO replays a held load at once;
  - between decisions, every `slo_check_s`, a miss that began since the last decision brings
    the next decision forward (once per miss: `due`), so a fleet that starts failing requests
    2 s after a decision does not fail them for a whole interval.
A missed SLO alone never moves engines: with the prediction within the margin it holds (no
split predicts better: the load is past what the budget serves, or the misses come from
elsewhere).
The prediction sees lengths and arrival times, not prompt contents: prefix-cache hits are not
in it (it predicts as if every prompt were new).
A replay costs a simulation per candidate, so a steady load is not replayed every interval: when
the last full decision held and the window's load (prompt and output tokens per second) is
within `reuse_tolerance` of what that decision saw, the planner holds again without simulating,
at most `max_reuses` times in a row (the prediction is a function of the window's lengths and
arrivals; a load that did not move predicts what it predicted).
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass, field
from typing import NamedTuple

from baton.perf.profile import Profile
from baton.protocol import EngineStats
from baton.workload.synthetic import RequestSpec
from baton.workload.words import WORDS
from planner.signals import Evidence, LoadMeter, Outcome, RoleLoad, SloReport, evidence, slo_report

logger = logging.getLogger(__name__)

NO_EVIDENCE = Evidence(0, False, "")


class Observation(NamedTuple):
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


class Split(NamedTuple):
    num_prompt: int
    num_completion: int

    @property
    def name(self) -> str:
        return f"{self.num_prompt}P:{self.num_completion}D"


@dataclass
class PlannerConfig:
    slos_ms: dict[str, float]
    interval_s: float = 30.0  # how often it decides
    window_s: float = 120.0  # the requests it plans on
    min_observations: int = 20
    margin: float = 0.10  # the predicted goodput gain a change needs
    confirmations: int = 2  # decisions in a row naming the same better split
    cooldown_s: float = 300.0  # after a change, none for this long
    max_candidates: int = 8  # splits simulated per decision (the current one's neighbours)
    apply: bool = True  # False: advise (decide and report, never change the fleet)
    urgent_margin: float = 0.5  # a predicted gain this large acts at once (one confirmation)
    urgent_cooldown_s: float = 60.0  # ... and needs only this long (or cooldown_s if shorter)
    tie: float = 0.02  # splits within this of the best are equal: the nearest one wins
    reuse_tolerance: float = 0.10  # a held load moved less than this: hold without a replay
    max_reuses: int = 5  # ... at most this many decisions in a row (0: replay every time)
    warmup: bool = True  # replay the window twice, score the second copy (a steady fleet)
    # The engines' load (planner/signals.py): a prompt engine this busy, or a role with this
    # many requests queued per engine, or completion engines with this share of KV in use, is
    # saturated; a role less busy than busy_low with nothing queued idles.
    busy_high: float = 0.9
    busy_low: float = 0.5
    queue_high: float = 4.0
    kv_high: float = 0.9
    # What the requests met (planner/signals.py): under this share of the window's requests
    # within the SLOs, the SLO is missed; checked every slo_check_s between decisions (0: only
    # at decisions).
    slo_target: float = 0.95
    slo_check_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.slos_ms:
            raise ValueError("the planner needs SLOs (--goodput ttft:MS tpot:MS)")
        for name in ("interval_s", "window_s", "cooldown_s"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be > 0 and finite, got {getattr(self, name)}")
        if self.margin < 0 or self.confirmations < 1 or self.max_candidates < 2:
            raise ValueError("margin >= 0, confirmations >= 1 and max_candidates >= 2 needed")
        if not self.margin <= self.urgent_margin < math.inf:
            raise ValueError(f"urgent_margin must be >= margin ({self.margin}) and finite, got "
                             f"{self.urgent_margin}")
        if not 0 <= self.urgent_cooldown_s < math.inf:
            raise ValueError(f"urgent_cooldown_s must be >= 0 and finite, got "
                             f"{self.urgent_cooldown_s}")
        if self.reuse_tolerance < 0 or self.max_reuses < 0:
            raise ValueError(f"reuse_tolerance and max_reuses must be >= 0, got "
                             f"{self.reuse_tolerance}, {self.max_reuses}")
        if not 0 <= self.tie < 1:
            raise ValueError(f"tie must be in [0, 1), got {self.tie}")
        if not (0 <= self.busy_low <= self.busy_high <= 1 and 0 < self.kv_high <= 1
                and 0 < self.queue_high < math.inf):
            raise ValueError(f"0 <= busy_low <= busy_high <= 1, 0 < kv_high <= 1 and "
                             f"queue_high > 0 needed, got {self.busy_low}, {self.busy_high}, "
                             f"{self.kv_high}, {self.queue_high}")
        if not (0 < self.slo_target <= 1 and 0 <= self.slo_check_s < math.inf):
            raise ValueError(f"0 < slo_target <= 1 and slo_check_s >= 0 and finite needed, got "
                             f"{self.slo_target}, {self.slo_check_s}")


@dataclass
class Decision:
    action: str  # "hold" | "wait" | "advise" (would change) | "change"
    target: Split
    reason: str
    predicted: dict[str, float] = field(default_factory=dict)  # split name -> goodput
    engines: str = ""  # what the engines' load said (planner/signals.py), when it was read
    slo: str = ""  # what the requests met (planner/signals.py `SloReport`), when it was read


def candidates(current: Split, budget: int, limit: int) -> list[Split]:
    """The current split, then moves of 1, 2, 4, 8, ... engines either way (nearest first; a
    move past an end is the extreme split, one engine of a role: a big shift is reached in one
    change, not in several cooldowns); at most `limit`, every split with at least one engine
    of each role."""
    out = [current]

    def add(p: int) -> None:
        p = min(budget - 1, max(1, p))
        if Split(p, budget - p) not in out and len(out) < limit:
            out.append(Split(p, budget - p))

    step = 1
    while len(out) < limit and step < 2 * budget:
        add(current.num_prompt + step)
        add(current.num_prompt - step)
        step *= 2
    return out


def observations_to_specs(observations: list[Observation], seed: int = 0,
                          copies: int = 1) -> list[RequestSpec]:
    """The window as a replayable workload: arrivals from its first, prompts of random words
    (one token each for the mock runner's tokenizer) of the observed lengths; `copies` times
    in a row, each starting one mean gap after the last arrival of the one before (the
    copies before the last are of kind "warmup", the last one's "observed")."""
    rng = random.Random(seed)
    t0 = observations[0].arrival_s
    span = observations[-1].arrival_s - t0
    period = span + span / len(observations)
    return [RequestSpec(c * len(observations) + i, "observed" if c == copies - 1 else "warmup",
                        " ".join(rng.choices(WORDS, k=o.prompt_tokens)), o.prompt_tokens,
                        max(1, o.output_tokens), arrival_s=o.arrival_s - t0 + c * period)
            for c in range(copies) for i, o in enumerate(observations)]


class Planner:
    def __init__(self, profile: Profile, config: PlannerConfig, fleet_base=None) -> None:
        from simulator.fleet import FleetConfig

        self.profile, self.config = profile, config
        self.fleet_base = fleet_base or FleetConfig()
        self._pending = 0  # the direction of the pending move: +1 to prompt, -1 to completion
        self._pending_count = 0  # decisions in a row that wanted it
        self._last_change_s = -math.inf
        self._first_seen_s = math.inf  # the earliest arrival it was shown
        # The last full decision, when it held: the split, its load, its predictions.
        self._held: tuple[Split, tuple[float, float], dict[str, float]] | None = None
        self._num_reuses = 0
        self.meter = LoadMeter()
        self.loads: dict[str, RoleLoad] = {}  # per role, at the last decision that read them
        self.slo: SloReport | None = None  # at the last decision that was given outcomes
        self._was_missed = False  # whether the last decision saw the SLO missed

    def predict(self, split: Split, specs: list[RequestSpec]) -> float:
        """Goodput of `split` on the replay: of its last copy when it has several (`warmup`),
        over the time from that copy's first arrival to the end."""
        from dataclasses import replace

        from baton.workload.results import RequestResult, meets_slos
        from simulator.run import SimConfig, simulate

        fleet = replace(self.fleet_base, num_normal=0, num_prompt=split.num_prompt,
                        num_completion=split.num_completion)
        cfg = SimConfig(fleet=fleet, slos_ms=self.config.slos_ms, label=split.name)
        record = simulate(self.profile, cfg, None, None, specs=specs)
        first = next(i for i, spec in enumerate(specs) if spec.kind != "warmup")
        measured = [RequestResult(**r) for r in record["requests"] if r["idx"] >= first]
        num_good = sum(meets_slos(r, self.config.slos_ms) for r in measured)
        return num_good / max(1e-9, record["summary"]["duration_s"] - specs[first].arrival_s)

    def decide(self, now_s: float, current: Split, observations: list[Observation],
               engines: list[EngineStats] | None = None,
               outcomes: list[Outcome] | None = None) -> Decision:
        """The decision at `now_s` on the current split, from the arrivals observed and, when
        given, the engines' stats and the outcomes of the requests that ended
        (planner/signals.py)."""
        cfg = self.config
        current = Split(*current)
        if engines is not None:
            self.loads = self.meter.read(now_s, engines)
        ev = evidence(self.loads, cfg.busy_high, cfg.busy_low, cfg.queue_high, cfg.kv_high)
        missed = self._read_slo(now_s, outcomes)
        slo = self.slo.describe() if outcomes is not None else ""
        window = [Observation(*o) for o in observations if o[0] >= now_s - cfg.window_s]
        if len(window) < cfg.min_observations:
            return Decision("hold", current, f"{len(window)} requests in the window "
                                             f"(< {cfg.min_observations})", engines=ev.reason,
                            slo=slo)
        self._first_seen_s = min(self._first_seen_s, window[0].arrival_s)
        span = max(1e-9, min(cfg.window_s, now_s - self._first_seen_s))
        load = (sum(o.prompt_tokens for o in window) / span,
                sum(o.output_tokens for o in window) / span)
        if self._is_held(current, load) and not ev.direction and not missed:
            self._num_reuses += 1
            return Decision("hold", current, f"load within {100 * cfg.reuse_tolerance:.0f}% of "
                            "the last replay's, which held", self._held[2], ev.reason, slo)
        specs = observations_to_specs(window, copies=2 if cfg.warmup else 1)
        budget = current.num_prompt + current.num_completion
        splits = candidates(current, budget, cfg.max_candidates)
        predicted = {s.name: self.predict(s, specs) for s in splits}
        decision = self._judge(now_s, current, splits, predicted, ev, missed)
        decision.engines, decision.slo = ev.reason, slo
        self._held = (current, load, predicted) if decision.action == "hold" else None
        self._num_reuses = 0
        return decision

    def due(self, now_s: float, outcomes: list[Outcome]) -> bool:
        """Between decisions: whether the SLO is missed now and was not at the last decision
        (a miss that began since: decide now, not at the next interval)."""
        return not self._was_missed and self._is_missed(self._slo_report(now_s, outcomes))

    def _read_slo(self, now_s: float, outcomes: list[Outcome] | None) -> bool:
        """Whether the SLO is missed (never without outcomes)."""
        if outcomes is None:
            return False
        self.slo = self._slo_report(now_s, outcomes)
        self._was_missed = self._is_missed(self.slo)
        return self._was_missed

    def _slo_report(self, now_s: float, outcomes: list[Outcome]) -> SloReport:
        """The requests that ended in the window and since the last change (those before it
        ran on a split the fleet no longer has)."""
        since = max(now_s - self.config.window_s, self._last_change_s)
        return slo_report(outcomes, self.config.slos_ms, since)

    def _is_missed(self, report: SloReport) -> bool:
        return (report.num_requests >= self.config.min_observations
                and report.attainment < self.config.slo_target)

    def _is_held(self, current: Split, load: tuple[float, float]) -> bool:
        """The last replay held on this split, under a load within the tolerance of this one."""
        if self._held is None or self._held[0] != current or \
                self._num_reuses >= self.config.max_reuses:
            return False
        tol = self.config.reuse_tolerance
        return all(abs(a - b) <= tol * b for a, b in zip(load, self._held[1], strict=True))

    def _judge(self, now_s: float, current: Split, splits: list[Split],
               predicted: dict[str, float], ev: Evidence = NO_EVIDENCE,
               missed: bool = False) -> Decision:
        """The decision on these predictions (split name -> goodput), what the engines said
        and whether the SLO is missed: hysteresis, confirmations and cooldown, as the module
        docstring says."""
        cfg = self.config
        top = max(predicted.values())
        near = [s for s in splits if predicted[s.name] >= top * (1 - cfg.tie)]
        best = min(near, key=lambda s: (abs(s.num_prompt - current.num_prompt), s != current))
        now_good, best_good = predicted[current.name], predicted[best.name]
        if best == current or best_good <= now_good * (1 + cfg.margin):
            self._pending, self._pending_count = 0, 0
            return Decision("hold", current, f"{current.name} is within {100 * cfg.margin:.0f}% "
                            f"of the best predicted goodput", predicted)
        urgent = best_good > now_good * (1 + cfg.urgent_margin)
        direction = 1 if best.num_prompt > current.num_prompt else -1  # engines to prompt?
        gain = f"{best.name} predicted {best_good:.2f} vs {current.name} {now_good:.2f} req/s"
        if not urgent and (ev.direction == -direction or (direction > 0 and ev.kv_full)):
            self._pending, self._pending_count = 0, 0
            why = "completion KV nearly full" if ev.direction != -direction else \
                "the engines' load says the other way"
            return Decision("wait", best, f"{gain}; {why} ({ev.reason})", predicted)
        if direction == self._pending:
            self._pending_count += 1
        else:
            self._pending, self._pending_count = direction, 1
        confirmed = ev.direction == direction  # the engines' load says so too
        needed = 1 if urgent or missed or confirmed else cfg.confirmations
        if self._pending_count < needed:
            return Decision("wait", best, f"{gain} ({self._pending_count} of {needed} "
                            "confirmations)", predicted)
        cooldown = min(cfg.urgent_cooldown_s, cfg.cooldown_s) if urgent or missed else \
            cfg.cooldown_s
        if now_s - self._last_change_s < cooldown:
            return Decision("wait", best, f"{gain}; cooldown: "
                            f"{cooldown - (now_s - self._last_change_s):.0f} s left", predicted)
        self._pending, self._pending_count = 0, 0
        if not cfg.apply:
            return Decision("advise", best, f"would change: {gain}", predicted)
        self._last_change_s = now_s
        return Decision("change", best, f"{gain} of goodput" + (" (urgent)" if urgent else "")
                        + ("; the SLO is missed (urgent)" if missed and not urgent else "")
                        + (f"; the engines' load agrees ({ev.reason})" if confirmed else ""),
                        predicted)
