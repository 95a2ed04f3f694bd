"""What the engines say about their load, beside what the planner predicts from the arrivals.

The planner's prediction (planner/core.py) replays the window's arrivals through the simulator;
the engines' own counters say how the fleet copes now. Both places hand the planner the same
type, `EngineStats` (baton/protocol.py): a live fleet the structs its engines answer a stats
probe with (the values behind their `/metrics`: `baton_num_requests_running`,
`baton_num_requests_waiting`, `baton_kv_cache_usage_perc`, `baton_engine_busy_seconds_total`),
or the registry's records where only those reach the planner (no busy time); `baton sim` the
same struct filled from its simulated engines. `LoadMeter` turns successive readings into a
`RoleLoad` per role: requests queued per engine, KV usage, and the busy fraction (seconds in
engine steps over the time between two readings; at an engine's first reading, over its
uptime when the stats carry one).

`evidence` reads the loads as the planner uses them:
  - a role that is saturated (its queue per engine at `queue_high` or more; a prompt engine
    also when its busy fraction is `busy_high` or more, a completion engine when its KV usage
    is `kv_high` or more) while the other idles (busy under `busy_low`, nothing queued) wants
    engines moved to the saturated role: a predicted move that way needs no second
    confirmation, and a small predicted move the other way waits (the prediction and the
    engines disagree: a burst, or a window that no longer says what runs);
  - completion engines whose KV is nearly full (`kv_high`) hold decodes that a shrink would
    have to fit elsewhere: a small predicted move of engines from completion to prompt waits.
Urgent predictions (the current split failing its SLOs) act whatever the engines say. A
completion engine's busy fraction is no sign of saturation: it steps while any sequence
decodes, at any load; its queue and its KV are.

What the requests met: each request that ended (finished, failed or refused) as an `Outcome`
(router/metrics.py: when it ended, its TTFT and TPOT, whether it finished), from the router
live (`GET /planner/observations`' `outcomes`) and from the simulated requests in `baton sim`.
`slo_report` sums those of the window into an `SloReport`: TTFT and TPOT p50/p90 and the share
of requests within every SLO, where a failed or refused request is outside it (planner/core.py
makes a predicted move urgent while that share is under its target).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

from baton.protocol import COMPLETION, PROMPT, EngineStats
from router.metrics import Outcome

__all__ = ["Evidence", "LoadMeter", "Outcome", "RoleLoad", "SloReport", "evidence",
           "slo_report"]


class RoleLoad(NamedTuple):
    num_engines: int
    num_waiting: float  # requests queued per engine (a completion engine's: for blocks too)
    kv_usage: float  # mean share of KV blocks in use (cached-free ones count as free)
    busy_fraction: float | None  # mean share of time in engine steps; None: not known yet


class Evidence(NamedTuple):
    direction: int  # +1: engines to prompt, -1: to completion, 0: no sign either way
    kv_full: bool  # completion engines' KV nearly full: do not shrink them
    reason: str  # what the engines said, for the decision's reason


class LoadMeter:
    """Per role loads from successive readings of the engines' stats (busy fractions from the
    busy-seconds counters' deltas; a counter that went down, a restarted engine, from zero)."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[float, float]] = {}  # engine id -> (time, busy seconds)

    def read(self, now_s: float, stats: Iterable[EngineStats]) -> dict[str, RoleLoad]:
        by_role: dict[str, list[tuple[EngineStats, float | None]]] = {}
        seen: dict[str, tuple[float, float]] = {}
        for s in stats:
            if s.draining:
                continue  # leaving its role: what it runs says nothing of the role's load
            busy_s = s.extra.get("busy_s")
            fraction = None
            if busy_s is not None:
                seen[s.engine_id] = (now_s, busy_s)
                last = self._last.get(s.engine_id)
                if last is None and s.extra.get("uptime_s", 0.0) > 0:  # first: since its start
                    last = (now_s - s.extra["uptime_s"], 0.0)
                if last is not None and now_s > last[0]:
                    moved = busy_s - last[1] if busy_s >= last[1] else busy_s
                    fraction = min(1.0, moved / (now_s - last[0]))
            by_role.setdefault(s.role, []).append((s, fraction))
        self._last = seen
        return {role: _role_load(samples) for role, samples in by_role.items()}


def _role_load(samples: list[tuple[EngineStats, float | None]]) -> RoleLoad:
    n = len(samples)
    fractions = [f for _, f in samples if f is not None]
    return RoleLoad(n, sum(s.num_waiting for s, _ in samples) / n,
                    sum((s.num_total_blocks - s.num_free_blocks) / s.num_total_blocks
                        for s, _ in samples if s.num_total_blocks) / n,
                    sum(fractions) / len(fractions) if fractions else None)


def evidence(loads: dict[str, RoleLoad], busy_high: float, busy_low: float, queue_high: float,
             kv_high: float) -> Evidence:
    """What the loads say about moving engines (the module docstring's rules)."""
    prompt, completion = loads.get(PROMPT), loads.get(COMPLETION)
    if prompt is None or completion is None:
        return Evidence(0, False, "")

    def idle(load: RoleLoad) -> bool:
        return (load.busy_fraction is not None and load.busy_fraction < busy_low
                and load.num_waiting < 1)

    prompt_saturated = prompt.num_waiting >= queue_high or (
        prompt.busy_fraction is not None and prompt.busy_fraction >= busy_high)
    completion_saturated = (completion.num_waiting >= queue_high
                            or completion.kv_usage >= kv_high)
    direction = (1 if prompt_saturated and idle(completion)
                 else -1 if completion_saturated and idle(prompt) else 0)
    return Evidence(direction, completion.kv_usage >= kv_high,
                    f"prompt {describe(prompt)}; completion {describe(completion)}")


def describe(load: RoleLoad) -> str:
    busy = "?" if load.busy_fraction is None else f"{100 * load.busy_fraction:.0f}%"
    return (f"busy {busy}, {load.num_waiting:.1f} queued/engine, "
            f"KV {100 * load.kv_usage:.0f}%")


class SloReport(NamedTuple):
    num_requests: int  # requests that ended in the window, failed and refused ones included
    attainment: float  # the share of them within every SLO (failed and refused: outside)
    ttft_p50_ms: float  # over the finished ones (0: none)
    ttft_p90_ms: float
    tpot_p50_ms: float
    tpot_p90_ms: float

    def describe(self) -> str:
        return (f"{100 * self.attainment:.0f}% of {self.num_requests} within the SLOs "
                f"(TTFT p50/p90 {self.ttft_p50_ms:.0f}/{self.ttft_p90_ms:.0f} ms, TPOT "
                f"{self.tpot_p50_ms:.0f}/{self.tpot_p90_ms:.0f} ms)")


def slo_report(outcomes: Iterable[Outcome], slos_ms: dict[str, float],
               since_s: float) -> SloReport:
    """The requests that ended at `since_s` or later against `slos_ms` ("ttft", "tpot" in
    ms; "e2e" is not in an outcome and is not judged here)."""
    ended = [o for o in outcomes if o[0] >= since_s]
    done = [o for o in ended if o[3]]
    limits = (slos_ms.get("ttft", math.inf) / 1e3, slos_ms.get("tpot", math.inf) / 1e3)
    num_within = sum(o[1] <= limits[0] and o[2] <= limits[1] for o in done)
    ttft = sorted(o[1] for o in done)
    tpot = sorted(o[2] for o in done if o[2] > 0)
    return SloReport(len(ended), num_within / len(ended) if ended else 1.0,
                     _quantile_ms(ttft, 0.5), _quantile_ms(ttft, 0.9),
                     _quantile_ms(tpot, 0.5), _quantile_ms(tpot, 0.9))


def _quantile_ms(ordered: list[float], q: float) -> float:
    """The nearest-rank quantile of sorted seconds, in ms (0 for none)."""
    if not ordered:
        return 0.0
    return 1e3 * ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
