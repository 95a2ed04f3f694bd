"""The simulator routes with the router's own selection policy (router/selection.py), over a
cache view of the keys each simulated engine's KV events reported."""

from __future__ import annotations

from pathlib import Path

import pytest

from baton.perf.profile import load
from baton.workload.synthetic import RequestSpec
from router.selection import KeySets, LeastLoaded, OverlapMinusLoad
from simulator.fleet import FleetConfig, Simulation
from simulator.run import SimConfig

PROFILE = load(Path(__file__).resolve().parents[1] / "data" / "profile_test.json")


def _sim(cfg: SimConfig) -> tuple[Simulation, list[str]]:
    routed: list[str] = []
    sim = Simulation(PROFILE, cfg.fleet, cfg.make_policy)
    choose = sim._choose

    def spy(role, flight):  # which engine each request's first leg went to
        engine = choose(role, flight)
        routed.append(engine.name)
        return engine

    sim._choose = spy
    return sim, routed


def _spec(idx: int) -> RequestSpec:
    return RequestSpec(idx=idx, kind="fixed", prompt="", num_prompt_words=0, max_tokens=4)


def test_the_simulator_runs_the_routers_policy_over_its_engines_keys():
    sim, routed = _sim(SimConfig(fleet=FleetConfig(num_normal=3)))
    assert type(sim.policy) is OverlapMinusLoad and isinstance(sim.policy.cache, KeySets)
    bs = PROFILE.model.block_size
    shared = list(range(10, 10 + 4 * bs))
    sim.submit(_spec(0), shared + [7], 0.0)
    sim.run()  # done: normal-0 holds the prefix, as its KV events said
    assert routed == ["normal-0"]
    assert sim.cache.keys["normal-0"] and not sim.cache.keys["normal-1"]
    # cost = new blocks + active blocks, ties to the least loaded, then the first listed:
    sim.submit(_spec(1), list(range(500, 500 + bs)), 1.0)  # 1 everywhere: normal-0
    sim.submit(_spec(2), shared + [8, 9], 1.0)  # 1 + 1 on normal-0 (its cache), 5 elsewhere
    sim.submit(_spec(3), list(range(900, 900 + 3 * bs)), 1.0)  # 3 + 6 there, 3 on normal-1
    sim.run()
    assert routed[1:] == ["normal-0", "normal-0", "normal-1"]
    sim.check_drained()


def test_least_loaded_ignores_the_caches():
    sim, routed = _sim(SimConfig(fleet=FleetConfig(num_normal=2), routing="least-loaded"))
    assert type(sim.policy) is LeastLoaded
    prompt = list(range(10, 200))
    sim.submit(_spec(0), prompt, 0.0)
    sim.submit(_spec(1), prompt, 0.0)
    sim.run()
    assert routed == ["normal-0", "normal-1"]  # the second to the idle one, cache or not
    sim.check_drained()


def test_bad_routing_is_refused():
    with pytest.raises(ValueError, match="routing"):
        SimConfig(routing="random")
    with pytest.raises(ValueError, match="kv_overlap_weight"):
        SimConfig(kv_overlap_weight=-1)
