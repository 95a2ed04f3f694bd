"""The planner's decision, one function of what it observed: the same code in the simulator's
virtual time (`baton sim --planner`) and, later, beside a live fleet.

Every `interval_s` the planner takes the requests that arrived in the last `window_s` (arrival
time, prompt tokens, output tokens), replays them through the simulator (simulator/run.py: the
real scheduler over the profile's step times) on each candidate prompt:completion split of the
budget, and keeps the split with the most goodput (requests meeting every SLO per second).
It acts only when
  - it saw at least `min_observations` requests (a quiet window says nothing),
  - the best split beats the current one's predicted goodput by `margin` (hysteresis: two
    splits within the noise of the prediction never flip-flop),
  - the same split won `confirmations` decisions in a row (a burst is not a shift), and
  - `cooldown_s` passed since its last change (a change costs a drain).
The prediction sees lengths and arrival times, not prompt contents: prefix-cache hits are not
in it (it predicts as if every prompt were new).
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass, field
from typing import NamedTuple

from baton.perf.profile import Profile
from baton.workload.synthetic import RequestSpec
from baton.workload.words import WORDS

logger = logging.getLogger(__name__)


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

    def __post_init__(self) -> None:
        if not self.slos_ms:
            raise ValueError("the planner needs SLOs (--goodput ttft:MS tpot:MS)")
        for name in ("interval_s", "window_s", "cooldown_s"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be > 0 and finite, got {getattr(self, name)}")
        if self.margin < 0 or self.confirmations < 1 or self.max_candidates < 2:
            raise ValueError("margin >= 0, confirmations >= 1 and max_candidates >= 2 needed")


@dataclass
class Decision:
    action: str  # "hold" | "wait" | "advise" (would change) | "change"
    target: Split
    reason: str
    predicted: dict[str, float] = field(default_factory=dict)  # split name -> goodput


def candidates(current: Split, budget: int, limit: int) -> list[Split]:
    """The current split, the two extremes (one engine of a role: a big shift is reached in
    one change, not in several cooldowns), then moves of 1, 2, 4, ... engines either way,
    nearest first; at most `limit`, every split with at least one engine of each role."""
    out = [current]

    def add(p: int) -> None:
        if 1 <= p <= budget - 1 and Split(p, budget - p) not in out and len(out) < limit:
            out.append(Split(p, budget - p))

    add(1)
    add(budget - 1)
    step = 1
    while len(out) < limit and step < budget:
        add(current.num_prompt + step)
        add(current.num_prompt - step)
        step *= 2
    return out


def observations_to_specs(observations: list[Observation], seed: int = 0) -> list[RequestSpec]:
    """The window as a replayable workload: arrivals from its first, prompts of random words
    (one token each for the mock runner's tokenizer) of the observed lengths."""
    rng = random.Random(seed)
    t0 = observations[0].arrival_s
    return [RequestSpec(i, "observed", " ".join(rng.choices(WORDS, k=o.prompt_tokens)),
                        o.prompt_tokens, max(1, o.output_tokens), arrival_s=o.arrival_s - t0)
            for i, o in enumerate(observations)]


class Planner:
    def __init__(self, profile: Profile, config: PlannerConfig, fleet_base=None) -> None:
        from simulator.fleet import FleetConfig

        self.profile, self.config = profile, config
        self.fleet_base = fleet_base or FleetConfig()
        self._pending: Split | None = None
        self._pending_count = 0
        self._last_change_s = -math.inf

    def predict(self, split: Split, specs: list[RequestSpec]) -> float:
        from dataclasses import replace

        from simulator.run import SimConfig, simulate

        fleet = replace(self.fleet_base, num_normal=0, num_prompt=split.num_prompt,
                        num_completion=split.num_completion)
        cfg = SimConfig(fleet=fleet, slos_ms=self.config.slos_ms, label=split.name)
        record = simulate(self.profile, cfg, None, None, specs=specs)
        return record["summary"]["goodput"]

    def decide(self, now_s: float, current: Split, observations: list[Observation]) -> Decision:
        cfg = self.config
        current = Split(*current)
        window = [Observation(*o) for o in observations if o[0] >= now_s - cfg.window_s]
        if len(window) < cfg.min_observations:
            return Decision("hold", current, f"{len(window)} requests in the window "
                                             f"(< {cfg.min_observations})")
        specs = observations_to_specs(window)
        budget = current.num_prompt + current.num_completion
        predicted = {s.name: self.predict(s, specs)
                     for s in candidates(current, budget, cfg.max_candidates)}
        best_name = max(predicted, key=lambda n: (predicted[n], n == current.name))
        best = next(s for s in candidates(current, budget, cfg.max_candidates)
                    if s.name == best_name)
        now_good = predicted[current.name]
        if best == current or predicted[best_name] <= now_good * (1 + cfg.margin):
            self._pending, self._pending_count = None, 0
            return Decision("hold", current, f"{current.name} is within {100 * cfg.margin:.0f}% "
                            f"of the best predicted goodput", predicted)
        if best == self._pending:
            self._pending_count += 1
        else:
            self._pending, self._pending_count = best, 1
        if self._pending_count < cfg.confirmations:
            return Decision("wait", best, f"{best.name} predicted {predicted[best_name]:.2f} vs "
                            f"{now_good:.2f} req/s ({self._pending_count} of "
                            f"{cfg.confirmations} confirmations)", predicted)
        if now_s - self._last_change_s < cfg.cooldown_s:
            return Decision("wait", best, f"cooldown: {cfg.cooldown_s - (now_s - self._last_change_s):.0f} s "
                            "left", predicted)
        self._pending, self._pending_count = None, 0
        if not cfg.apply:
            return Decision("advise", best, f"would change to {best.name}: predicted "
                            f"{predicted[best_name]:.2f} vs {now_good:.2f} req/s", predicted)
        self._last_change_s = now_s
        return Decision("change", best, f"{best.name} predicted {predicted[best_name]:.2f} vs "
                        f"{current.name} {now_good:.2f} req/s of goodput", predicted)
