"""`baton up --planner advise|apply`: the planner (planner/core.py) beside a live fleet.

A thread of the launcher, every `--planner-interval` seconds:
1. reads the requests the router finished in the last `--planner-window` seconds
   (`GET /planner/observations`: arrival, prompt tokens, output tokens; no content);
2. lets the planner decide on the fleet's current prompt:completion split, with the same code
   and the same hysteresis as in the simulator (`baton sim --planner`);
3. publishes the decision in the registry (signed with the cluster key, like engine records),
   where every router serves it (`GET /planner`, `baton_router_planner_recommended_engines`);
4. apply: moves the engines a change needs (the least busy of the role that gives them up)
   with `ChangeRole` (docs/scheduler.md S41), and remembers their new role, so that a restart
   by the supervisor starts them in it. Advise only logs and publishes.
A change still draining holds further decisions. The planner's errors (a router or Redis
outage) are logged, never fatal: the fleet serves on as it is.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.request

from baton.protocol import COMPLETION, PROMPT

logger = logging.getLogger(__name__)


class LivePlanner:
    def __init__(self, launcher, planner, interval_s: float, window_s: float) -> None:
        self.launcher = launcher
        self.planner = planner  # planner.core.Planner
        self.interval_s, self.window_s = interval_s, window_s
        self.decisions: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="planner", daemon=True)
        self._registry = None

    def start(self) -> LivePlanner:
        from baton.ops.registry import RegistryConfig, make_registry, record_signing_key

        launcher = self.launcher
        self._registry = make_registry(RegistryConfig(
            url=launcher.redis_url, password_file=launcher.redis_password_file(),
            signing_key=record_signing_key(launcher.keys)))
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        if self._registry is not None:
            self._registry.close()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
            except Exception as exc:  # noqa: BLE001 - a planner outage never stops serving
                logger.warning("planner: this decision skipped: %s", exc)

    # ------------------------------------------------------------------ one decision
    def _observations(self) -> tuple[float, list[tuple[float, int, int]]]:
        cfg = self.launcher.config
        url = (f"http://{cfg.host}:{cfg.router_port}/planner/observations"
               f"?window_s={self.window_s:g}")
        key = cfg.launcher_key()
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                    timeout=10) as resp:
            body = json.load(resp)
        return float(body["now"]), [(float(t), int(p), int(o)) for t, p, o in
                                    body["observations"]]

    def tick(self) -> dict | None:
        from baton.service.client import probe_engine

        launcher = self.launcher
        roles = launcher.engine_roles
        stats = {eid: probe_engine(launcher.engine_addresses[eid], 2.0, launcher.keys)
                 for eid in roles}
        if any(s is not None and s.draining for s in stats.values()):
            return None  # a change still drains: decide on the fleet it makes
        current = (sum(r == PROMPT for r in roles.values()),
                   sum(r == COMPLETION for r in roles.values()))
        now, observations = self._observations()
        decision = self.planner.decide(now, current, observations)
        record = {"t": now, "action": decision.action, "target": decision.target.name,
                  "reason": decision.reason, "current": f"{current[0]}P:{current[1]}D",
                  "recommended": {PROMPT: decision.target.num_prompt,
                                  COMPLETION: decision.target.num_completion},
                  "predicted": decision.predicted, "observations": len(observations)}
        self.decisions.append(record)
        self._registry.publish_plan(record, ttl_s=3 * self.interval_s)
        if decision.action in ("change", "advise"):
            logger.info("planner %s: %s -> %s (%s)", decision.action, record["current"],
                        record["target"], decision.reason)
        if decision.action == "change":
            self._apply(decision.target.num_prompt - current[0], stats)
        return record

    def _apply(self, move: int, stats: dict) -> None:
        """Move |move| engines: completion -> prompt when positive, else prompt -> completion;
        the least busy first."""
        from baton.service.client import EngineClient

        launcher = self.launcher
        src, dst = (COMPLETION, PROMPT) if move > 0 else (PROMPT, COMPLETION)

        def busy(eid: str) -> int:
            s = stats.get(eid)
            return s.num_running + s.num_waiting if s is not None else 1 << 30

        chosen = sorted((eid for eid, r in launcher.engine_roles.items() if r == src),
                        key=busy)[:abs(move)]
        for eid in chosen:
            with EngineClient(launcher.engine_addresses[eid], keys=launcher.keys) as client:
                reply = client.change_role(dst)
            logger.info("planner: %s %s -> %s: %s", eid, src, dst, reply.message)
            if reply.ok:
                launcher.set_engine_role(eid, dst)
