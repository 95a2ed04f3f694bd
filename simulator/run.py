"""One simulated run: the workload in, the result record of `baton bench` (plus `fleet`) out."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

from baton.perf.profile import Profile
from baton.workload.args import build_specs, unit_arrivals, workload_record
from baton.workload.results import RequestResult, summarize
from baton.workload.synthetic import RequestSpec, WorkloadConfig
from baton.workload.trace import TraceConfig
from baton.workload.words import WordTokenizer
from router.path import PathPolicy, build_path_policy
from router.selection import KeySets, LeastLoaded, OverlapMinusLoad, SelectionPolicy
from simulator.fleet import FleetConfig, Flight, Simulation

ROUTING_POLICIES = ("cache-aware", "least-loaded")  # the router's --routing choices


@dataclass
class SimConfig:
    fleet: FleetConfig = field(default_factory=FleetConfig)
    request_rate: float = math.inf  # requests/s, Poisson (synthetic workloads)
    num_requests: int = 40  # synthetic: requests (multi-turn: conversations)
    slos_ms: dict[str, float] = field(default_factory=dict)
    kv_overlap_weight: float = 1.0  # the policy's weight of a missing prompt block
    label: str = "sim"
    routing: str = "cache-aware"  # the router's --routing: which router/selection.py policy
    # A mixed fleet's path policy (router/path.py), as the router's flags: a static threshold
    # of uncached prompt tokens (None: the profile's predicted costs) and the prediction's
    # fixed cost of the disaggregated path.
    pd_threshold_tokens: int | None = None
    pd_handoff_ms: float | None = None  # None: the profile's path.handoff_ms, as the router

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (inf for all at once), got "
                             f"{self.request_rate}")
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {ROUTING_POLICIES}, got {self.routing!r}")
        if not 0 <= self.kv_overlap_weight < math.inf:
            raise ValueError(f"kv_overlap_weight must be >= 0 and finite, got "
                             f"{self.kv_overlap_weight}")
        if not self.fleet.is_mixed and (self.pd_threshold_tokens is not None
                                        or self.pd_handoff_ms is not None):
            raise ValueError("pd_threshold_tokens and pd_handoff_ms choose a mixed fleet's "
                             "path: give normal engines beside prompt and completion engines")
        if self.pd_threshold_tokens is not None and self.pd_threshold_tokens < 0:
            raise ValueError(f"pd_threshold_tokens must be >= 0, got {self.pd_threshold_tokens}")
        if self.pd_handoff_ms is not None and not 0 <= self.pd_handoff_ms < math.inf:
            raise ValueError(f"pd_handoff_ms must be >= 0 and finite, got {self.pd_handoff_ms}")

    def make_policy(self, cache: KeySets) -> SelectionPolicy:
        """The policy the router builds for this `--routing` (router/engine_pool.py)."""
        if self.routing == "least-loaded":
            return LeastLoaded()
        return OverlapMinusLoad(cache, self.kv_overlap_weight)

    def make_path_policy(self, profile: Profile) -> PathPolicy:
        """The path policy the router builds for these flags, with `--profile` the profile the
        fleet runs on (router/engine_pool.py `make_path_policy`)."""
        return build_path_policy(profile, self.pd_threshold_tokens, self.pd_handoff_ms)


def simulate(profile: Profile, cfg: SimConfig, workload: WorkloadConfig | None,
             trace: TraceConfig | None = None, specs: list[RequestSpec] | None = None,
             planner=None) -> dict:
    """Run the workload over the fleet in virtual time; the result record. `specs` (with their
    arrivals) replace the workload and the trace; `planner` (planner/core.py) re-roles engines
    as the run goes (the fleet record then has `roles_over_time`)."""
    wall0 = time.perf_counter()
    if specs is None:
        specs = build_specs(workload, trace, cfg.num_requests)
    tok = WordTokenizer(profile.model.vocab_size)
    units: dict[int, list[RequestSpec]] = {}
    for spec in specs:
        units.setdefault(spec.conversation if spec.conversation >= 0 else -1 - spec.idx,
                         []).append(spec)
    unit_list = list(units.values())
    results = {}
    next_turn = {u[i].idx: u[i + 1] for u in unit_list for i in range(len(u) - 1)}

    def on_done(flight: Flight) -> None:
        results[flight.spec.idx] = flight.result
        nxt = next_turn.get(flight.spec.idx)
        if nxt is not None and flight.result.ok:  # the conversation so far, then the new turn
            history = flight.token_ids + flight.output_ids + tok.encode(nxt.prompt)
            sim.submit(nxt, history, sim.now)

    sim = Simulation(profile, cfg.fleet, cfg.make_policy, on_done, planner=planner,
                     path_policy=cfg.make_path_policy(profile))
    seed = workload.seed if workload is not None else 0
    for unit, t in zip(unit_list, unit_arrivals(unit_list, cfg.request_rate, seed),
                       strict=True):
        sim.submit(unit[0], tok.encode(unit[0].text), t)
    sim.run()
    sim.check_drained()
    ordered = [results[s.idx] for s in specs if s.idx in results]
    summary = summarize(ordered, sim.now, cfg.slos_ms)
    summary["ignore_eos"] = True
    bench = {"endpoint": "sim", "request_rate": "inf" if math.isinf(cfg.request_rate)
             else cfg.request_rate, "num_requests": len(specs), "slos_ms": cfg.slos_ms,
             "label": cfg.label, "kv_overlap_weight": cfg.kv_overlap_weight,
             "routing": cfg.routing, "pd_threshold_tokens": cfg.pd_threshold_tokens,
             # What a mixed fleet's predicted path charged a hand-off (the profile's measured
             # one unless given); None where no path was predicted.
             "pd_handoff_ms": getattr(sim.path_policy, "handoff_ms", None)
             if cfg.fleet.is_mixed else None,
             "fleet": asdict(cfg.fleet), "profile": profile.model.fingerprint}
    return {"label": cfg.label, "model": f"mock/{profile.model.name}",
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "bench": bench,
            "workload": workload_record(workload, trace) if workload is not None
            else {"dataset": "given", "num_requests": len(specs)}, "summary": summary,
            "requests": [_result_dict(r) for r in ordered], "fleet": sim.fleet_record(),
            "sim_wall_s": time.perf_counter() - wall0}


def _result_dict(r: RequestResult) -> dict:
    """`asdict` without its deep copy of every ITL float (seconds of a 10,000-request run)."""
    return {**vars(r), "itl_s": list(r.itl_s)}
