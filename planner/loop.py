"""The planner's control loop beside a live fleet: one code for `baton up --planner` (the
launcher's thread, engines re-roled in place) and `baton planner` (its own process, e.g. on
Kubernetes, where it changes the per-role Deployments' replica counts).

Every `interval_s` seconds, `PlannerLoop.tick`:
1. asks the actuator for the fleet's current prompt:completion split; an actuator whose last
   change is still under way (an engine draining, a Deployment rolling) raises `Unsettled` and
   the loop holds: it decides on the fleet that change makes, not on one half-made;
2. reads the requests the router finished in the last `window_s` seconds
   (`GET /planner/observations`: arrival, prompt tokens, output tokens; no content; and the
   outcome of every request that ended, failed and refused ones too: when, its TTFT and TPOT,
   whether it finished: the SLO signal of planner/signals.py), and the
   engines' load where an `observe_engines` is given (their `EngineStats`: queues, KV usage,
   busy seconds; planner/signals.py): `baton up`'s probes of its engines, `baton planner`'s
   registry records (queues and KV, no busy time). A failure to read them is logged and the
   planner decides on the requests alone;
3. lets the planner decide (planner/core.py: the same code and hysteresis as in the simulator);
4. publishes the decision in the registry (signed with the cluster key, like engine records),
   where every router serves it (`GET /planner`, `baton_router_planner_recommended_engines`);
5. on a "change" (apply mode), hands the target split to the actuator. Advise only logs and
   publishes.
Between decisions, every `slo_check_s` of the planner's config, `tick(only_if_due=True)` reads
the router's outcomes and decides at once when the planner says a miss of the SLO began since
its last decision (planner/core.py `due`); otherwise it publishes nothing.
Every error (a router, Redis or API server outage) is logged and that decision skipped: a
planner outage never stops serving, the fleet serves on as it is.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.request
from collections import Counter, deque
from collections.abc import Callable
from typing import Protocol

from baton.protocol import COMPLETION, PROMPT, EngineStats
from planner.core import Planner, Split
from planner.signals import Outcome

logger = logging.getLogger(__name__)


class Unsettled(Exception):  # noqa: N818 - a state, not a failure
    """The last change is still under way (the reason in the message): hold."""


class Actuator(Protocol):
    """Where the planner reads the fleet's split and carries out a change."""

    def current_split(self) -> Split: ...  # Unsettled while a change is under way
    def apply(self, target: Split) -> None: ...  # make the fleet `target` (same budget)


class RouterObservations:
    """The router's finished requests: `GET {router_url}/planner/observations?window_s=W`,
    with the router's API key as a Bearer header when it has keys (an admin path): its clock,
    the arrivals (arrival, prompt tokens, output tokens) and the outcomes (`Outcome`s)."""

    def __init__(self, router_url: str, window_s: float, api_key: str = "",
                 timeout_s: float = 10.0) -> None:
        self.url = f"{router_url.rstrip('/')}/planner/observations?window_s={window_s:g}"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s

    def __call__(self) -> tuple[float, list[tuple[float, int, int]], list[Outcome]]:
        request = urllib.request.Request(self.url, headers=self.headers)
        with urllib.request.urlopen(request, timeout=self.timeout_s) as resp:
            body = json.load(resp)
        return float(body["now"]), [(float(t), int(p), int(o)) for t, p, o in
                                    body["observations"]], [
            Outcome(float(t), float(ttft), float(tpot), bool(ok))
            for t, ttft, tpot, ok in body.get("outcomes", [])]


class RegistryLoads:
    """The engines' load as their registry records carry it (requests running and queued, KV
    blocks free of total; no busy time): what `baton planner` reads beside a fleet whose
    engines it may not probe (on Kubernetes its egress reaches the registry, not the engines)."""

    def __init__(self, registry) -> None:
        self.registry = registry

    def __call__(self) -> list[EngineStats]:
        return [EngineStats(r.engine_id, r.role, num_free_blocks=r.num_free_blocks,
                            num_total_blocks=r.num_total_blocks, num_running=r.num_running,
                            num_waiting=r.num_waiting, draining=r.draining)
                for role in (PROMPT, COMPLETION) for r in self.registry.list(role)]


class PlannerLoop:
    """`tick()` every `interval_s` on a thread (`start`/`stop`) or in the caller's
    (`run_forever`), and an SLO check between; `decisions` keeps the latest published records.
    `observe` returns (now, arrivals, outcomes), as `RouterObservations`."""

    def __init__(self, planner: Planner, actuator: Actuator,
                 observe: Callable[[], tuple[float, list, list[Outcome]]], registry,
                 interval_s: float,
                 observe_engines: Callable[[], list[EngineStats]] | None = None) -> None:
        self.planner, self.actuator, self.observe = planner, actuator, observe
        self.observe_engines = observe_engines
        self.registry = registry  # baton.ops.registry.RedisRegistry (publish_plan), or None
        self.interval_s = interval_s
        # Between decisions, an SLO check this often (a planner without a config, a test's
        # scripted one, checks only at its decisions).
        self.check_s = getattr(getattr(planner, "config", None), "slo_check_s", 0.0)
        self.decisions: deque[dict] = deque(maxlen=1000)  # the latest published records
        self.actions: Counter[str] = Counter()  # decisions by action, since the start
        # time.monotonic() when the loop last came round (a tick that raised too: a router
        # outage is no reason to restart the planner), for a liveness probe.
        self.last_tick_s = 0.0
        self.num_errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ running
    def start(self) -> PlannerLoop:
        self._thread = threading.Thread(target=self.run_forever, name="planner", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(10)

    def run_forever(self) -> None:
        """Until stop(): a decision every interval, its errors logged and skipped."""
        self.last_tick_s = time.monotonic()
        next_decision_s = self.last_tick_s + self.interval_s
        while not self._stop.wait(self._until_next(next_decision_s)):
            is_periodic = time.monotonic() >= next_decision_s - 1e-3
            if is_periodic:
                next_decision_s = time.monotonic() + self.interval_s
            try:
                self.tick(only_if_due=not is_periodic)
            except Exception as exc:  # noqa: BLE001 - a planner outage never stops serving
                self.num_errors += 1
                logger.warning("planner: this decision skipped: %s", exc)
            self.last_tick_s = time.monotonic()

    def _until_next(self, next_decision_s: float) -> float:
        """Seconds to the next decision, or sooner to the next SLO check."""
        wait_s = max(0.0, next_decision_s - time.monotonic())
        return min(wait_s, self.check_s) if self.check_s else wait_s

    # ------------------------------------------------------------------ one decision
    def tick(self, only_if_due: bool = False) -> dict | None:
        """One decision, published (and carried out in apply mode); None while a change is
        still under way, or, `only_if_due` (an SLO check between decisions), when the planner
        sees no miss of the SLO that began since its last decision."""
        try:
            current = Split(*self.actuator.current_split())
        except Unsettled as exc:
            if not only_if_due:
                logger.info("planner: holding: %s", exc)
            return None
        now, observations, outcomes = self.observe()
        if only_if_due and not self.planner.due(now, outcomes):
            return None
        decision = self.planner.decide(now, current, observations, self._engines(), outcomes)
        record = {"t": now, "action": decision.action, "target": decision.target.name,
                  "reason": decision.reason, "engines": decision.engines,
                  "slo": decision.slo, "current": current.name,
                  "recommended": {PROMPT: decision.target.num_prompt,
                                  COMPLETION: decision.target.num_completion},
                  "predicted": decision.predicted, "observations": len(observations)}
        self.decisions.append(record)
        self.actions[decision.action] += 1
        if self.registry is not None:
            self.registry.publish_plan(record, ttl_s=3 * self.interval_s)
        if decision.action in ("change", "advise"):
            logger.info("planner %s: %s -> %s (%s)", decision.action, record["current"],
                        record["target"], decision.reason)
        if decision.action == "change":
            self.actuator.apply(decision.target)
        return record

    def _engines(self) -> list[EngineStats] | None:
        if self.observe_engines is None:
            return None
        try:
            return self.observe_engines()
        except Exception as exc:  # noqa: BLE001 - decide on the requests alone
            logger.warning("planner: the engines' load not read: %s", exc)
            return None
