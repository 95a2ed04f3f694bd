"""A mixed fleet in `baton sim` (normal engines beside prompt and completion engines): each
request's path is chosen by the router's own path policy (router/path.py), counted as the
router counts it (`baton_router_path_total{path,reason}`). Determinism and which way the
counts go; never timings."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from baton.perf.profile import PathCost, load
from baton.workload.synthetic import WorkloadConfig
from baton_cli.main import main as baton_main
from router.path import DEFAULT_HANDOFF_MS, PredictedPath, ThresholdPath
from simulator.fleet import FleetConfig, Simulation
from simulator.run import SimConfig, simulate

DATA = Path(__file__).resolve().parents[1] / "data"
PROFILE = load(DATA / "profile_test.json")
MIXED = FleetConfig(num_normal=1, num_prompt=1, num_completion=1)


def _run(threshold: int | None = None, fleet: FleetConfig = MIXED, seed: int = 5) -> dict:
    # Chat prompts of ~64 tokens with 30% documents of ~1500 at 3 req/s: the normal engine
    # decodes most of the time, so a document's prefill there would stall every stream.
    cfg = SimConfig(fleet=fleet, request_rate=3.0, num_requests=60,
                    slos_ms={"ttft": 1500.0, "tpot": 60.0}, pd_threshold_tokens=threshold)
    return simulate(PROFILE, cfg, WorkloadConfig(dataset="mix", long_fraction=0.3, seed=seed))


def _paths(record: dict) -> dict[tuple[str, str], int]:
    return {(p["path"], p["reason"]): p["count"] for p in record["fleet"]["path_total"]}


def _drained(record: dict) -> None:
    for e in record["fleet"]["engines"]:
        assert e["num_free_blocks"] == e["num_total_blocks"], e


def test_the_router_policy_chooses_short_colocated_long_disaggregated():
    rec = _run()
    s = rec["summary"]
    assert s["num_completed"] == s["num_issued"] == 60 and s["num_failed"] == 0
    paths = _paths(rec)
    assert set(paths) == {("colocated", "predicted"), ("disaggregated", "predicted")}
    assert sum(paths.values()) == 60
    by_kind = rec["fleet"]["path_by_kind"]
    short, long = by_kind["short"], by_kind["long"]
    # Most chat prompts stay on the normal engine; most documents go to the prompt engine.
    assert short.get("colocated", 0) > 2 * short.get("disaggregated", 0)
    assert long.get("disaggregated", 0) > 2 * long.get("colocated", 0)
    roles = {e["role"] for e in rec["fleet"]["engines"]}
    assert roles == {"normal", "prompt", "completion"}
    assert rec["fleet"]["pulled_kv_bytes"] > 0  # the disaggregated ones moved their KV
    # The test profile measured no serving path: the router's estimate of a hand-off.
    assert rec["bench"]["pd_handoff_ms"] == DEFAULT_HANDOFF_MS
    _drained(rec)
    again = _run()
    assert {k: again[k] for k in ("summary", "requests", "fleet")} == \
        {k: rec[k] for k in ("summary", "requests", "fleet")}  # same seed, same record


@pytest.mark.parametrize(("threshold", "path"), [(0, "disaggregated"), (10**6, "colocated")])
def test_the_threshold_flag_gives_one_path(threshold, path):
    rec = _run(threshold)
    assert _paths(rec) == {(path, "threshold"): 60}
    assert rec["summary"]["num_completed"] == 60
    by_role = {e["role"]: e for e in rec["fleet"]["engines"]}
    unused = "normal" if path == "disaggregated" else "prompt"
    assert by_role[unused]["num_steps"] == 0  # no request went the other way
    _drained(rec)


def test_a_fleet_of_one_kind_counts_its_only_path():
    assert _paths(_run(fleet=FleetConfig(num_normal=2))) == {("colocated", "only_path"): 60}
    pd = FleetConfig(num_normal=0, num_prompt=1, num_completion=1)
    assert _paths(_run(fleet=pd)) == {("disaggregated", "only_path"): 60}


def test_the_simulation_runs_the_routers_policy_class():
    sim = Simulation(PROFILE, MIXED, SimConfig(fleet=MIXED).make_policy)
    assert type(sim.path_policy) is PredictedPath
    # A profile with its serving path measured: a hand-off costs what it measured, unless given.
    measured = dataclasses.replace(PROFILE, path=PathCost(6.0, 1.9, 18))
    assert SimConfig(fleet=MIXED).make_path_policy(measured).handoff_ms == 1.9
    assert SimConfig(fleet=MIXED, pd_handoff_ms=4.0).make_path_policy(measured).handoff_ms == 4.0
    cfg = SimConfig(fleet=MIXED, pd_threshold_tokens=256)
    assert type(cfg.make_path_policy(PROFILE)) is ThresholdPath


def test_path_flags_need_a_mixed_fleet_and_sane_values():
    with pytest.raises(ValueError, match="mixed fleet"):
        SimConfig(fleet=FleetConfig(num_normal=1), pd_threshold_tokens=100)
    with pytest.raises(ValueError, match="pd_threshold_tokens"):
        SimConfig(fleet=MIXED, pd_threshold_tokens=-1)
    with pytest.raises(ValueError, match="pd_handoff_ms"):
        SimConfig(fleet=MIXED, pd_handoff_ms=-1.0)


def test_baton_sim_mixed_fleet_flags(tmp_path, capsys):
    prof = str(DATA / "profile_test.json")
    rc = baton_main(["sim", "--profile", prof, "--normal-engines", "1", "--prompt-engines", "1",
                     "--completion-engines", "1", "--pd-threshold-tokens", "0",
                     "--num-requests", "8", "--request-rate", "4", "--label", "mixed",
                     "--results-dir", str(tmp_path)])
    assert rc == 0
    assert "paths: disaggregated (threshold) 8" in capsys.readouterr().out
    (path,) = tmp_path.glob("serve_mixed_*.json")
    rec = json.loads(path.read_text())
    assert rec["fleet"]["path_total"] == [{"path": "disaggregated", "reason": "threshold",
                                           "count": 8}]
    assert rec["bench"]["pd_threshold_tokens"] == 0
    assert baton_main(["sim", "--profile", prof, "--normal-engines", "2",
                       "--pd-threshold-tokens", "0"]) == 2
    assert "mixed fleet" in capsys.readouterr().err
