"""bench/sim_validate.py's speeds and report from canned records (no engine, no simulation):
the factors of each run's probes, the runs' own speed per role, the README's table."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import sim_validate as sv  # noqa: E402


def test_each_runs_probes_give_a_prompt_and_a_decode_factor():
    assert sv.probe_factors({"factor": 1.1}) == (1.1, 1.1)  # run 7: one phase, one factor
    assert sv.probe_factors({"factor": 1.1, "prefill_factor": 1.2, "decode_factor": 0.9}) \
        == (1.2, 0.9)
    # Run 9 solved three factors (a decode step's fixed part apart from its part per row):
    # refitted with two, relative to each phase, as speed_probe fits now.
    pre, fixed, rows = [1.8, 0.1, 0.4], [0.03, 0.8, 0.6], [0.01, 0.2, 0.9]
    real = [1.8 * 1.1 + 0.04 * 0.9, 0.11 + 1.0 * 0.9, 0.44 + 1.5 * 0.9]  # x1.1 / x0.9, exact
    fp, fd = sv.probe_factors({"factor": 1.0, "prefill_factor": 9.0, "decode_factor": 9.0,
                               "decode_row_factor": 9.0, "real_busy_s": real,
                               "predicted_prefill_s": pre, "predicted_decode_s": fixed,
                               "predicted_decode_row_s": rows})
    assert (fp, fd) == pytest.approx((1.1, 0.9))


def _fleet(**busy: float) -> dict:
    return {"engines": [{"role": role, "busy_s": s, "num_steps": 1} for role, s in busy.items()]}


def test_the_runs_own_speed_is_their_busy_time_over_the_simulators(monkeypatch):
    monkeypatch.setattr(sv, "at_speed", lambda profile, point, args, fp, fd: (fp, fd))
    pd = {"predicted_fleet": _fleet(prompt=10.0, completion=20.0),
          "runs_fleet": [_fleet(prompt=9.0, completion=24.0), _fleet(prompt=8.0, completion=22.0),
                         _fleet(prompt=12.0, completion=26.0)]}
    assert sv.at_run_speed(None, pd, None) == pytest.approx((0.9, 1.2))  # medians, per role
    colo = {"predicted_fleet": _fleet(normal=10.0), "runs_fleet": [_fleet(normal=11.0)]}
    assert sv.at_run_speed(None, colo, None) == pytest.approx((1.1, 1.1))
    # Engines that split their busy time by kind of step: a factor per kind, any setup.
    def split(prompt: float, decode: float, role: str = "normal") -> dict:
        return {"engines": [{"role": role, "busy_s": prompt + decode, "prefill_busy_s": prompt,
                             "num_steps": 1}]}

    colo = {"predicted_fleet": split(4.0, 10.0),
            "runs_fleet": [split(5.0, 9.0), split(4.4, 8.0), split(6.0, 11.0)]}
    assert sv.at_run_speed(None, colo, None) == pytest.approx((1.25, 0.9))
    # Runs whose /metrics were not read have no speed of their own.
    assert sv.at_run_speed(None, {"predicted_fleet": _fleet(normal=10.0),
                                  "runs_fleet": [None, {"engines": []}]}, None) is None


def _compare(error: float, within: bool) -> dict:
    c = {"predicted": 100 * (1 + error), "median": 100.0, "min": 90.0, "max": 110.0,
         "error": error, "spread": 0.1, "within": within}
    return {k: c for k in ("ttft_p50", "ttft_p90", "tpot_p50", "e2e_mean")} \
        | {"goodput": {**c, "predicted": 1.0, "median": 1.0}}


def test_the_table_counts_each_speed_apart():
    point = {"workload": "trace", "setup": "pd", "level": "light", "rate": 0.25,
             "compare": _compare(0.3, False),
             "at_probe": {"prefill_factor": 0.9, "decode_factor": 0.8,
                          "compare": _compare(0.05, True)},
             "at_run_speed": {"prefill_factor": 0.95, "decode_factor": 0.85,
                              "compare": _compare(-0.02, True)}}
    old = {**point, "at_probe": None, "at_run_speed": None}  # a record before the probes
    record = {"points": [point, old]}
    assert [sv.num_within(record, side) for side in ("", "at_probe", "at_run_speed")] \
        == [0, 3, 3]
    table = sv.markdown(record)
    assert "| trace | 1P + 1C | light | 0.25 | 130 / 100 [90-110] (+30%!)" in table
    assert "x0.90/x0.80 | 105 / 100 [90-110] (+5%)" in table
    assert "x0.95/x0.85 | 98 / 100 [90-110] (-2%)" in table
    assert table.splitlines()[3].endswith("| - | - | - | - | - | - | - | - |")
    assert table.endswith("within target: 0 of 6 (TTFT p50, TPOT p50, mean E2E); at the "
                          "probes' speed: 3 of 6; at the runs' own speed: 3 of 6")


def test_mock_runs_the_points_on_mock_engines_of_the_profile(monkeypatch, capsys):
    """--mock: `baton up --mock PROFILE` of the same shape and limits, no thread count (a mock
    engine refuses one); without --profile it is refused (the mock engines sleep its prices)."""
    import argparse

    with pytest.raises(SystemExit):
        sv.main(["--mock"])
    assert "--mock needs --profile" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a profile given is not fitted: --quick-profile says nothing
        sv.main(["--mock", "--profile", "P.json", "--quick-profile"])
    assert "--quick-profile" in capsys.readouterr().err
    started = []

    class Started(Exception):
        pass

    def start(flags, **kw):
        started.append(list(flags))
        raise Started

    monkeypatch.setattr(sv.UpProcess, "start", start)
    args = argparse.Namespace(mock=True, profile="P.json", num_blocks=512, max_num_seqs=16,
                              max_num_batched_tokens=1024, engine_args="", ready_timeout=60.0)
    for mock in (True, False):
        with pytest.raises(Started):
            sv.RealFleet("pd", argparse.Namespace(**{**vars(args), "mock": mock})).__enter__()
    assert started[0] == ["--mock", "P.json", "--prompt-engines", "1", "--completion-engines",
                          "1", "--", "--num-blocks", "512", "--max-num-seqs", "16",
                          "--max-num-batched-tokens", "1024"]
    assert started[1][:4] == ["--prompt-engines", "1", "--completion-engines", "1"]
    assert started[1][5:7] == ["--num-threads", "1"]


def test_a_points_rate_is_a_fraction_of_the_capacity_at_the_speed_probed_now(monkeypatch,
                                                                             capsys):
    """--rate-from probe (the default): the capacity of the profile scaled by a probe run just
    before the point; the raw profile's if that probe fails (said), or with --rate-from
    profile (no probe); --rate-from probe beside --no-probe is refused."""
    import argparse

    with pytest.raises(SystemExit):
        sv.main(["--no-probe", "--rate-from", "probe", "--profile", "P.json"])
    assert "--rate-from probe needs the speed probe" in capsys.readouterr().err

    class Profile:
        def __init__(self, speed=(1.0, 1.0)):
            self.speed = speed

        def scaled(self, fp, fd):
            return Profile((fp, fd))

    found = {"prefill_factor": 1.25, "decode_factor": 2.0, "factor": 1.6}
    monkeypatch.setattr(sv, "probe", lambda fleet, profile, setup, args: dict(found))
    # A profile twice as slow at decoding completes half as many requests a second.
    monkeypatch.setattr(sv, "capacity", lambda profile, kind, setup, args:
                        4.0 / profile.speed[1])
    args = argparse.Namespace(rate_from="probe")
    assert sv.rate_basis(None, Profile(), "trace", "pd", args) == (2.0, found)
    assert sv.rate_basis(None, Profile(), "trace", "pd",
                         argparse.Namespace(rate_from="profile")) == (4.0, None)
    monkeypatch.setattr(sv, "probe", lambda *a: {"error": "no engine"})
    assert sv.rate_basis(None, Profile(), "trace", "pd", args) == (4.0, {"error": "no engine"})
    assert "rate from the raw profile's capacity" in capsys.readouterr().err


def test_the_probes_factors_are_each_kind_of_steps_real_seconds_over_the_simulators():
    """speed_factors: from engines that split their busy time by kind of step, no fit: prompt
    steps' real seconds over the simulator's, decode steps' likewise, all phases together;
    misfit, how far a phase's whole busy time is from the two factors' prediction."""
    from simulator.calibrate import speed_factors

    pre, dec = [1.0, 0.1, 0.2], [0.1, 1.0, 2.0]
    real_pre = [1.2, 0.12, 0.24]  # prompt steps x1.2
    real = [p + 0.9 * d for p, d in zip(real_pre, dec, strict=True)]  # decode steps x0.9
    fp, fd, misfit = speed_factors(pre, dec, real, real_pre)
    assert (fp, fd) == pytest.approx((1.2, 0.9)) and misfit == pytest.approx(0.0, abs=1e-12)
    real[1] *= 1.1  # the solo stream ran its decode steps slower than the batch
    fp, fd, misfit = speed_factors(pre, dec, real, real_pre)
    assert fp == pytest.approx(1.2) and 0.9 < fd < 0.9 * 1.1 and misfit > 0.02
    # A probe record carries its split: sim_validate reads the factors it found.
    assert sv.probe_factors({"factor": 1.0, "prefill_factor": fp, "decode_factor": fd,
                             "real_prefill_s": real_pre}) == (fp, fd)


def test_the_host_noise_table_gives_each_points_probes_by_kind_of_step():
    """host_noise: per point, its probes' prompt-step, one-row and eight-row decode factors
    (real over the simulator's, each phase's decode steps apart), median [min-max]; a failed
    probe and one without the split are left out, a point with none is no row."""
    def probe(pre: float, solo: float, burst: float) -> dict:
        predicted_pre, predicted_dec = [1.0, 0.1, 0.2], [0.1, 1.0, 2.0]
        real_pre = [pre * p for p in predicted_pre]
        return {"real_prefill_s": real_pre, "predicted_prefill_s": predicted_pre,
                "predicted_decode_s": predicted_dec,
                "real_busy_s": [real_pre[0] + 0.1, real_pre[1] + solo * 1.0,
                                real_pre[2] + burst * 2.0]}

    assert sv.step_factors(probe(1.1, 0.8, 1.0)) == pytest.approx((1.1, 0.8, 1.0))
    assert sv.step_factors({"error": "x"}) is None and sv.step_factors(None) is None
    point = {"workload": "trace", "setup": "pd", "level": "knee",
             "rate_probe": probe(1.0, 0.8, 1.0),
             "probes": [probe(1.1, 1.2, 1.0), {"error": "timeout"}, probe(1.2, 1.0, 1.0),
                        {"factor": 1.0}],
             "at_run_speed": {"prefill_factor": 1.05, "decode_factor": 1.1}}
    table = sv.host_noise({"points": [point, {**point, "rate_probe": None, "probes": []}]})
    assert "| trace | pd | knee | 3 | x1.10 [1.00-1.20] | x1.00 [0.80-1.20] | " \
           "x1.00 [1.00-1.00] | x1.05/x1.10 |" in table
    assert len(table.splitlines()) == 5  # the head, its rule, one point, a blank, the line
    assert table.endswith("prompt steps x1.20 (at most x1.20), one-row decode steps x1.50 "
                          "(at most x1.50), eight-row decode steps x1.00 (at most x1.00) "
                          "(median over the points)")
    assert sv.host_noise({"points": [{**point, "rate_probe": None, "probes": []}]}) == ""
