"""`baton up --planner advise|apply`: the planner's loop (planner/loop.py) as a thread of the
launcher, acting in place.

Every `--planner-interval` seconds `PlannerLoop.tick` reads the router's finished requests of
the last `--planner-window` seconds and the engines' stats (`InPlaceActuator` probes every
engine for its role and draining state anyway: the same probe's queues, KV usage and busy
seconds are the planner's view of their load, planner/signals.py), lets the planner decide on
the fleet's current split,
publishes the decision in the registry (every router's `GET /planner` and
`baton_router_planner_recommended_engines`) and, in apply mode, hands a change to
`InPlaceActuator`: it moves the engines the change needs (the least busy of the role that gives
them up) with `ChangeRole` (docs/scheduler.md S41), and tells the launcher their new role, so
that a restart by the supervisor starts them in it. A change still draining holds further
decisions. (`baton planner` runs the same loop in its own process with the Kubernetes
actuator, planner/kubernetes.py.) The planner's errors (a router or Redis outage) are logged,
never fatal: the fleet serves on as it is.
"""

from __future__ import annotations

import logging

from baton.protocol import COMPLETION, PROMPT
from planner.core import Split
from planner.loop import PlannerLoop, RouterObservations, Unsettled

logger = logging.getLogger(__name__)


class InPlaceActuator:
    """The launcher's engines, re-roled in place (S41)."""

    def __init__(self, launcher) -> None:
        self.launcher = launcher
        self._stats: dict = {}  # engine id -> its EngineStats (or None) at current_split

    def current_split(self) -> Split:
        from baton.service.client import probe_engine

        launcher = self.launcher
        roles = launcher.engine_roles
        self._stats = {eid: probe_engine(launcher.engine_addresses[eid], 2.0, launcher.keys)
                       for eid in roles}
        draining = [eid for eid, s in self._stats.items() if s is not None and s.draining]
        if draining:
            raise Unsettled(f"{', '.join(sorted(draining))} still draining")
        return Split(sum(r == PROMPT for r in roles.values()),
                     sum(r == COMPLETION for r in roles.values()))

    def engine_stats(self) -> list:
        """The stats of the engines that answered the last `current_split`'s probe."""
        return [s for s in self._stats.values() if s is not None]

    def apply(self, target: Split) -> None:
        """Move engines to reach `target`: completion -> prompt when it has more prompt
        engines, else prompt -> completion; the least busy first."""
        from baton.service.client import EngineClient

        launcher = self.launcher
        num_prompt = sum(r == PROMPT for r in launcher.engine_roles.values())
        move = target.num_prompt - num_prompt
        src, dst = (COMPLETION, PROMPT) if move > 0 else (PROMPT, COMPLETION)

        def busy(eid: str) -> int:
            s = self._stats.get(eid)
            return s.num_running + s.num_waiting if s is not None else 1 << 30

        chosen = sorted((eid for eid, r in launcher.engine_roles.items() if r == src),
                        key=busy)[:abs(move)]
        for eid in chosen:
            with EngineClient(launcher.engine_addresses[eid], keys=launcher.keys) as client:
                reply = client.change_role(dst)
            logger.info("planner: %s %s -> %s: %s", eid, src, dst, reply.message)
            if reply.ok:
                launcher.set_engine_role(eid, dst)


class LivePlanner(PlannerLoop):
    def __init__(self, launcher, planner, interval_s: float, window_s: float) -> None:
        cfg = launcher.config
        observe = RouterObservations(f"http://{cfg.host}:{cfg.router_port}", window_s,
                                     cfg.launcher_key())
        actuator = InPlaceActuator(launcher)
        super().__init__(planner, actuator, observe, None, interval_s,
                         observe_engines=actuator.engine_stats)
        self.launcher = launcher
        self.window_s = window_s

    def start(self) -> LivePlanner:
        from baton.ops.registry import RegistryConfig, make_registry, record_signing_key

        launcher = self.launcher
        self.registry = make_registry(RegistryConfig(
            url=launcher.redis_url, password_file=launcher.redis_password_file(),
            signing_key=record_signing_key(launcher.keys)))
        super().start()
        return self

    def stop(self) -> None:
        super().stop()
        if self.registry is not None:
            self.registry.close()
