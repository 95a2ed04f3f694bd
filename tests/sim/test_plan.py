"""`baton plan`: every fleet shape of the budget simulated on one workload, ranked by goodput;
an SLO no shape meets gets a plan that says so and names the nearest feasible SLO."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from baton.perf.profile import load
from baton.workload.synthetic import WorkloadConfig
from baton_cli.main import main as baton_main
from simulator.plan import Shape, plan, shapes
from simulator.run import SimConfig

DATA = Path(__file__).resolve().parents[1] / "data"
PROFILE = load(DATA / "profile_test.json")
WORKLOAD = WorkloadConfig(dataset="mix", seed=5)


def _plan(slos: dict, engines: int = 3) -> dict:
    base = SimConfig(request_rate=6.0, num_requests=40, slos_ms=slos)
    return plan(PROFILE, engines, base, WORKLOAD, None)


def test_the_sweep_tries_all_normal_every_split_and_a_coarse_mixed_grid():
    assert shapes(3) == [Shape(3, 0, 0), Shape(0, 1, 2), Shape(0, 2, 1), Shape(1, 1, 1)]
    assert shapes(1) == [Shape(1, 0, 0)]
    assert shapes(2) == [Shape(2, 0, 0), Shape(0, 1, 1)]  # no room for all three roles
    sixteen = shapes(16)
    mixed = [s for s in sixteen if s.num_normal and s.num_prompt]
    assert len(sixteen) == 1 + 15 + len(mixed) and len(set(sixteen)) == len(sixteen)
    assert {s.num_normal for s in mixed} == {4, 8, 12}  # a quarter, half, three quarters
    assert all(s.num_completion >= 1 and sum((s.num_normal, s.num_prompt, s.num_completion))
               == 16 for s in mixed)
    assert [(s.name, s.path_policy) for s in (Shape(16, 0, 0), Shape(0, 3, 13), mixed[0])] == [
        ("16 normal", "co-located"), ("3P:13D", "disaggregated"),
        ("4 normal + 3P:9D", "per request")]
    with pytest.raises(ValueError, match="--engines must be >= 1"):
        shapes(0)


def test_a_loose_slo_is_feasible_and_shapes_are_ranked_by_goodput():
    record = _plan({"ttft": 60_000.0, "tpot": 5_000.0})
    assert record["feasible"] and "nearest_feasible_slos_ms" not in record
    assert {s["name"] for s in record["shapes"]} == {"3 normal", "1P:2D", "2P:1D",
                                                     "1 normal + 1P:1D"}
    goodputs = [s["goodput"] for s in record["shapes"]]
    assert goodputs == sorted(goodputs, reverse=True) and goodputs[0] > 0
    assert record["best"]["name"] == record["shapes"][0]["name"]
    assert all(s["num_failed"] == 0 for s in record["shapes"])
    assert record == _plan({"ttft": 60_000.0, "tpot": 5_000.0})  # deterministic


def test_an_slo_no_shape_meets_names_the_nearest_feasible_one():
    record = _plan({"ttft": 1.0, "tpot": 0.5})
    assert not record["feasible"]
    near = record["nearest_feasible_slos_ms"]
    assert set(near) == {"shape", "ttft", "tpot"} and near["ttft"] > 1 and near["tpot"] > 0.5
    # The named SLO is feasible for the shape it came from, at its p90s.
    shape = next(s for s in record["shapes"] if s["name"] == near["shape"])
    assert near["ttft"] >= shape["ttft_p90_ms"] and near["tpot"] >= shape["tpot_p90_ms"]


def test_baton_plan_cli(tmp_path, capsys):
    out = tmp_path / "plan.json"
    profile = str(DATA / "profile_test.json")
    common = ["--profile", profile, "--engines", "2", "--dataset", "mix", "--request-rate", "4",
              "--num-requests", "20"]
    assert baton_main(["plan", *common, "--goodput", "ttft:60000", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "best:" in text and json.loads(out.read_text())["engines"] == 2
    assert baton_main(["plan", *common[:3], "3", *common[4:], "--goodput", "ttft:60000"]) == 0
    text = capsys.readouterr().out  # the mixed shape, with its path policy, in the table
    assert re.search(r"^1 normal \+ 1P:1D\s+per request\s+\d", text, re.MULTILINE), text
    assert baton_main(["plan", *common, "--goodput", "ttft:1"]) == 1
    assert "nearest feasible SLO: --goodput ttft:" in capsys.readouterr().out
    assert baton_main(["plan", *common, "--goodput", "ttft:x"]) == 2
    assert "bad --goodput item" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n'
                   "not json\n")
    assert baton_main(["plan", str(bad), "--profile", profile, "--engines", "2",
                       "--goodput", "ttft:1000"]) == 2
    assert "bad.jsonl:2: not JSON" in capsys.readouterr().err
