"""The profile schema: fit on a grid, round trip, and load errors that name the field."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from baton.perf import profile as P

DATA = Path(__file__).resolve().parents[1] / "data"


def _good() -> dict:
    return json.loads((DATA / "profile_test.json").read_text())


def test_fit_recovers_a_linear_cost_and_reports_held_out_error():
    rows = [(1.0, t, t * (t + c) / 1e3) for t in (16, 64, 256, 512) for c in (0, 256, 1024)]
    ms = [5.0 + 0.4 * r[1] + 0.02 * r[2] for r in rows]
    cost = P.fit_linear(P.PREFILL_FEATURES_V1, rows, ms)
    assert np.allclose(cost.coef, (5.0, 0.4, 0.02))
    assert cost.fit.num_held_out == 3 and cost.fit.num_fit == 9
    assert cost.fit.max_rel_err < 1e-9


def test_round_trip_and_prediction(tmp_path):
    prof = P.from_dict(_good())
    P.save(prof, tmp_path / "p.json")
    again = P.load(tmp_path / "p.json")
    assert again == prof
    q, k = np.array([100, 20]), np.array([100, 50])
    want = 8.0 + 0.5 * 120 + 0.01 * (100 * 100 + 20 * 50) / 1e3 + 0.2 + 0.05 * 2
    assert again.step_ms(True, q, k, 2) == pytest.approx(want)
    assert again.step_ms(False, np.ones(3), np.array([10, 20, 30]), 3) == \
        pytest.approx(15.0 + 1.2 * 3 + 0.3 * 0.06 + 0.2 + 0.15)
    # A grammar row costs its grammar_row_ms on top of a plain row (the file's 0.4 ms).
    assert again.step_ms(False, np.ones(3), np.array([10, 20, 30]), 3, num_grammar=2) == \
        pytest.approx(15.0 + 1.2 * 3 + 0.3 * 0.06 + 0.2 + 0.15 + 0.4 * 2)
    assert again.transfer_ms(0) == 0.0
    assert again.transfer_ms(10) == pytest.approx(2.0 + 10 * 737280 / 1e6)
    link = again.with_link(100.0, 0.5)  # 100 Gbit/s = 12.5e6 bytes per ms
    assert link.transfer_ms(10) == pytest.approx(0.5 + 10 * 737280 / 12.5e6)


@pytest.mark.parametrize("edit, field", [
    (lambda d: d.pop("decode"), "decode"),
    (lambda d: d["model"].pop("block_size"), "model.block_size"),
    (lambda d: d["model"].update(num_blocks="many"), "model.num_blocks"),
    (lambda d: d["prefill"].update(coef=[1.0, -2.0, 0.0]), "prefill.coef"),
    (lambda d: d["decode"].update(features=["const", "batch"]), "decode.features"),
    (lambda d: d["transfer"].update(bytes_per_ms=0), "transfer.bytes_per_ms"),
    (lambda d: d["sampling"].update(row_ms=None), "sampling.row_ms"),
    (lambda d: d["sampling"].update(grammar_row_ms=-0.1), "sampling.grammar_row_ms"),
    (lambda d: d.update(engine_start_s=-1), "engine_start_s"),
    (lambda d: d.update(prepare={"features": ["const"], "coef": [1.0]}), "prepare.features"),
    (lambda d: d.update(path={"request_ms": -1.0, "handoff_ms": 0.0, "num_requests": 1}),
     "path.request_ms"),
    (lambda d: d.update(path={"request_ms": 1.0, "num_requests": 1}), "path.handoff_ms"),
])
def test_a_bad_field_is_named(edit, field):
    d = _good()
    edit(d)
    with pytest.raises(P.ProfileError, match=field.replace(".", r"\.")):
        P.from_dict(d)


def test_an_unknown_version_is_refused(tmp_path):
    d = _good()
    d["version"] = P.PROFILE_VERSION + 1
    (tmp_path / "p.json").write_text(json.dumps(d))
    with pytest.raises(P.ProfileError, match=f"version {P.PROFILE_VERSION + 1} is not supported"):
        P.load(tmp_path / "p.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(P.ProfileError, match="bad.json"):
        P.load(tmp_path / "bad.json")


def test_version_2_prefill_features_and_version_1_files_predict_as_written():
    """Version 2 prices a prompt step by its tokens, their square (the whole step's), each
    chunk's own pairs and its pairs with the cached context; a version-1 file keeps its one
    attention feature (sum q * k) and predicts what it always did."""
    q, k = np.array([100, 20]), np.array([100, 50])
    assert P.prefill_features(q, k) == pytest.approx(
        (1.0, 120, 120 * 120 / 1e3, (100 * 100 + 20 * 20) / 1e3, (0 + 20 * 30) / 1e3))
    d = _good()
    d["version"] = 2
    d["prefill"].update(features=list(P.PREFILL_FEATURES), coef=[8.0, 0.5, 0.1, 0.2, 0.3])
    prof = P.from_dict(d)
    want = 8.0 + 0.5 * 120 + 0.1 * 14.4 + 0.2 * 10.4 + 0.3 * 0.6 + 0.2 + 0.05 * 2
    assert prof.step_ms(True, q, k, 2) == pytest.approx(want)
    assert P.from_dict(P.to_dict(prof)) == prof
    d["prefill"].update(features=list(P.PREFILL_FEATURES_V1), coef=[8.0, 0.5, 0.01])
    with pytest.raises(P.ProfileError, match="prefill.features"):
        P.from_dict(d)  # a version-2 file with version 1's features is refused
    old = P.from_dict(_good())
    assert old.version == 1 and old.prefill.features == P.PREFILL_FEATURES_V1


def test_version_3_prices_a_lone_decode_row_apart_and_older_files_predict_as_written():
    """Version 3's decode features add `single_row` (1 for a step of one row: the CPU
    backend's kernel unpacks a weight block once for up to 8 rows, so one row pays what two
    do); versions 1 and 2 keep their three features and predict what they always did."""
    k1, k3 = np.array([64]), np.array([10, 20, 30])
    assert P.decode_features(k1) == (1.0, 1.0, 0.064, 1.0)
    assert P.decode_features(k3) == (1.0, 3.0, 0.06, 0.0)
    assert P.decode_features(k1, P.DECODE_FEATURES_V2) == (1.0, 1.0, 0.064)
    d = _good()
    d["version"] = 3
    d["prefill"].update(features=list(P.PREFILL_FEATURES), coef=[8.0, 0.5, 0.1, 0.2, 0.3])
    d["decode"].update(features=list(P.DECODE_FEATURES), coef=[15.0, 1.2, 0.3, 2.5])
    prof = P.from_dict(d)
    own = 0.2 + 0.05  # the engine's work: a step, one sampled row
    assert prof.step_ms(False, np.ones(1), k1, 1) == pytest.approx(15 + 1.2 + 0.3 * 0.064 + 2.5
                                                                   + own)
    assert prof.step_ms(False, np.ones(3), k3, 3) == pytest.approx(15 + 3.6 + 0.018 + 0.35)
    assert P.from_dict(P.to_dict(prof)) == prof
    d["decode"].update(features=list(P.DECODE_FEATURES_V2), coef=[15.0, 1.2, 0.3])
    with pytest.raises(P.ProfileError, match="decode.features"):
        P.from_dict(d)  # a version-3 file with version 2's features is refused
    d["version"] = 2
    assert P.from_dict(d).step_ms(False, np.ones(1), k1, 1) == pytest.approx(
        15 + 1.2 + 0.3 * 0.064 + own)


def _grid_profile(single_row_ms: float) -> dict:
    """A version-2 file whose grid's decode steps cost 4 + 2 a row + 8 a thousand tokens of
    context, and `single_row_ms` more for one row; prompt steps 50 + 2 a token."""
    d = _good()
    d["version"] = 2
    d["prefill"].update(features=list(P.PREFILL_FEATURES), coef=[1.0, 1.0, 0.0, 0.0, 0.0])
    decode = [[[c] * b, 4 + 2 * b + 8 * b * c / 1e3 + single_row_ms * (b == 1)]
              for b in (1, 2, 4, 8) for c in (64, 512, 1536)]
    prefill = [[[t], [t + c], 50 + 2 * t] for t in (16, 64, 256) for c in (0, 512)]
    d["machine"] = {"grid": {"prefill": prefill, "decode": decode}}
    return d


def test_refit_fits_this_versions_features_to_the_grid_a_file_keeps(tmp_path, capsys):
    """`baton profile --refit OLD --out NEW`: no measurement, the grid OLD keeps fitted
    again (here a one-row step 3 ms dearer than the line through the others: version 3's
    fit finds it, version 2's could not); the rest of OLD as measured. A file without its
    grid, and flags that would measure, are refused by name."""
    from baton_cli.main import main as baton_main

    old_path, new_path = tmp_path / "old.json", tmp_path / "new.json"
    old_path.write_text(json.dumps(_grid_profile(3.0)))
    assert baton_main(["profile", "--refit", str(old_path), "--out", str(new_path)]) == 0
    assert "decode: {'const': 4.0, 'batch': 2.0" in capsys.readouterr().out
    new, old = P.load(new_path), P.load(old_path)
    assert new.version == P.PROFILE_VERSION and new.machine["refitted"]["from_version"] == 2
    assert new.decode.features == P.DECODE_FEATURES
    assert new.decode.coef == pytest.approx((4.0, 2.0, 8.0, 3.0), abs=1e-6)
    assert new.prefill.coef == pytest.approx((50.0, 2.0, 0.0, 0.0, 0.0), abs=1e-6)
    assert new.decode.fit.max_rel_err == pytest.approx(0.0, abs=1e-9)
    assert (new.transfer_ms(4), new.sample_row_ms, new.path) == \
        (old.transfer_ms(4), old.sample_row_ms, old.path)
    # A grid without that step: single_row's coefficient is 0 (non-negative fit).
    assert P.refit(P.from_dict(_grid_profile(0.0))).decode.coef[3] == pytest.approx(0, abs=1e-9)
    with pytest.raises(P.ProfileError, match="keeps no grid"):
        P.refit(P.from_dict(_good()))
    bad = _grid_profile(0.0)
    bad["machine"]["grid"]["decode"][0] = [64]
    with pytest.raises(P.ProfileError, match="machine.grid"):
        P.refit(P.from_dict(bad))
    assert baton_main(["profile", "--refit", str(old_path), "--out", str(new_path),
                       "--quick"]) == 2
    assert "--refit measures nothing; --quick would do nothing" in capsys.readouterr().err
    assert baton_main(["profile", "--refit", str(old_path), "--out", str(new_path),
                       "--no-contention"]) == 2
    assert "--no-contention would do nothing" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one of --no-path, --router-only, --refit
        baton_main(["profile", "--refit", str(old_path), "--out", str(new_path),
                    "--router-only"])


def test_a_file_from_before_grammar_rows_reads_them_as_plain_rows():
    d = _good()
    del d["sampling"]["grammar_row_ms"]
    assert P.from_dict(d).grammar_row_ms == 0.0


def test_the_routers_prepare_is_optional_and_round_trips():
    prof = P.from_dict(_good())  # written before the prepare was measured: no delay
    assert prof.prepare is None and prof.prepare_ms(5000) == 0.0
    d = _good() | {"prepare": {"features": ["const", "tokens"], "coef": [1.0, 0.003]}}
    prof = P.from_dict(d)
    assert prof.prepare_ms(1000) == pytest.approx(4.0)
    assert P.from_dict(P.to_dict(prof)) == prof


def test_the_serving_path_is_optional_and_round_trips():
    prof = P.from_dict(_good())  # written before the path was measured: nothing added
    assert prof.path is None and prof.request_path_ms() == prof.handoff_path_ms() == 0.0
    prof = P.from_dict(_good() | {"path": {"request_ms": 6.5, "handoff_ms": 1.5,
                                           "num_requests": 18}})
    assert (prof.request_path_ms(), prof.handoff_path_ms()) == (6.5, 1.5)
    assert prof.step_gap_ms() == 0.0  # written before the loop's work was measured
    assert P.from_dict(P.to_dict(prof)) == prof
    d = _good() | {"path": {"request_ms": 6.5, "handoff_ms": 1.5, "num_requests": 18,
                            "step_gap_ms": 0.25}}
    assert P.from_dict(d).step_gap_ms() == 0.25
    assert P.from_dict(P.to_dict(P.from_dict(d))) == P.from_dict(d)
    d["path"]["step_gap_ms"] = -0.1
    with pytest.raises(P.ProfileError, match="path.step_gap_ms"):
        P.from_dict(d)
    # The router's and a client's CPU for the outputs: 0 where not measured (written before).
    assert prof.service_cpu_ms(3) == 0.0
    d["path"] |= {"step_gap_ms": 0.25, "service_step_ms": 0.9, "service_token_ms": 0.3}
    served = P.from_dict(d)
    assert served.service_cpu_ms(4) == pytest.approx(0.9 + 4 * 0.3)
    assert served.service_cpu_ms(0) == 0.0  # a step that emitted nothing
    assert P.from_dict(P.to_dict(served)) == served
    d["path"]["service_token_ms"] = -1
    with pytest.raises(P.ProfileError, match="path.service_token_ms"):
        P.from_dict(d)


def test_contention_is_optional_checked_and_round_trips():
    prof = P.from_dict(_good())  # written before contention was measured: none
    assert prof.contention is None
    c = {"decode_beside_prefill": 1.12, "batch_decode_beside_prefill": 1.02,
         "prefill_beside_decode": 1.05}
    prof = P.from_dict(_good() | {"contention": c})
    assert prof.contention == P.Contention(**c)
    assert P.from_dict(P.to_dict(prof)) == prof
    assert prof.scaled(1.2).contention == prof.contention  # the host's speed apart
    for field, bad in (("decode_beside_prefill", 0.9), ("prefill_beside_decode", "x")):
        with pytest.raises(P.ProfileError, match=f"contention.{field}"):
            P.from_dict(_good() | {"contention": c | {field: bad}})
    with pytest.raises(P.ProfileError, match="contention.batch_decode_beside_prefill"):
        P.from_dict(_good() | {"contention": {"decode_beside_prefill": 1.1,
                                              "prefill_beside_decode": 1.0}})
    # A step beside steps of the other kind: each one's excess adds; of its own kind: none.
    slow = prof.contention
    assert slow.slowdown(False, 1, [True]) == pytest.approx(1.12)
    assert slow.slowdown(False, 4, [True, True]) == pytest.approx(1.04)
    assert slow.slowdown(True, 512, [False]) == pytest.approx(1.05)
    assert slow.slowdown(False, 1, [False]) == slow.slowdown(True, 8, [True]) == 1.0


def test_a_new_decode_rows_cost_is_optional_checked_scaled_and_round_trips():
    prof = P.from_dict(_good())  # written before it was measured: nothing
    assert prof.admit is None and prof.admit_ms(1000) == 0.0
    admit = {"features": ["const", "tokens"], "coef": [0.5, 0.007], "fit": {"num_fit": 3}}
    prof = P.from_dict(_good() | {"admit": admit})
    assert prof.admit_ms(0) == pytest.approx(0.5) and prof.admit_ms(1000) == pytest.approx(7.5)
    assert P.from_dict(P.to_dict(prof)) == prof
    assert prof.scaled(2.0, 1.5).admit_ms(1000) == pytest.approx(1.5 * 7.5)  # a decode step's
    for bad, field in (({**admit, "coef": [0.5, -1.0]}, "admit.coef"),
                       ({**admit, "features": ["const"]}, "admit.features")):
        with pytest.raises(P.ProfileError, match=field.replace(".", r"\.")):
            P.from_dict(_good() | {"admit": bad})


def test_a_scaled_profile_slows_the_engines_work_only():
    prof = P.from_dict(_good() | {"path": {"request_ms": 6.5, "handoff_ms": 1.5,
                                           "num_requests": 18}})
    slow = prof.scaled(1.25)
    q, k = np.array([128, 32]), np.array([640, 32])
    for prompt_run in (True, False):  # a prompt step and a decode step, the own work included
        assert slow.step_ms(prompt_run, q, k, 2, 1) == pytest.approx(
            1.25 * prof.step_ms(prompt_run, q, k, 2, 1))
    # The router's prepare, the path and a KV pull are not the engine's forward.
    assert slow.prepare_ms(512) == prof.prepare_ms(512)
    assert slow.path == prof.path and slow.transfer_ms(8) == prof.transfer_ms(8)
    assert P.from_dict(P.to_dict(slow)) == slow
    # Prompt steps and decode steps each their own factor.
    both = prof.scaled(1.5, 0.8)
    assert both.step_ms(True, q, k, 2) == pytest.approx(
        1.5 * prof.prefill.predict(P.prefill_features(q, k, prof.prefill.features))
        + 0.8 * prof.own_work_ms(2))
    assert both.step_ms(False, q, k, 2) == pytest.approx(0.8 * prof.step_ms(False, q, k, 2))
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(P.ProfileError, match="speed factor"):
            prof.scaled(bad)
        with pytest.raises(P.ProfileError, match="speed factor"):
            prof.scaled(1.0, bad)


def test_the_routers_prepare_is_measured_with_the_routers_tokenizer_alone():
    """`baton profile --router-only`'s prepare: the default model's tokenizer as the router
    loads it (no engine, no weights), timed at the grid's lengths; longer costs more."""
    from baton.load_cache import default_cache_dir
    from baton.perf.measure import Grid, prepare_cost
    from router.text import load_model_info

    tokenizer = load_model_info("", load_cache_dir=default_cache_dir()).tokenizer
    cost = prepare_cost(tokenizer, Grid(prepare_tokens=(64, 256, 2048)))
    assert cost.features == P.PREPARE_FEATURES and cost.coef[1] > 0
    assert cost.predict((1.0, 2048.0)) > cost.predict((1.0, 64.0))


def test_measure_on_a_tiny_grid_fits_every_cost_grammar_rows_included(tmp_path):
    """`baton profile`'s measurement end to end through the real loader and engine (a tiny
    random GGUF, a grid of a few points): every cost is fitted from real steps, and the grammar
    rows (JSON schema decode batches against plain ones) give a number >= 0 the file keeps."""
    from baton.perf.contention import ContentionGrid
    from baton.perf.measure import Grid, measure
    from tests.model.tiny_gguf import write_tiny_gguf
    from tests.threads import TEST_THREADS

    grid = Grid(prefill_tokens=(16, 64), prefill_cached=(0, 32), decode_batch=(1, 2),
                decode_context=(32, 128), decode_steps=2, transfer_blocks=(1, 4), repeats=2,
                grammar_batch=(1, 2), prefill_batches=((2, 16),),
                prepare_tokens=(16, 64, 256, 1024))
    prof = measure(str(write_tiny_gguf(tmp_path / "tiny.gguf")), "none", TEST_THREADS, grid,
                   load_cache_dir=str(tmp_path / "load-cache"),
                   contention=ContentionGrid(rounds=1, decode_steps=2, prefill_repeats=1))
    assert prof.decode.predict(P.decode_features([100])) > 0
    assert prof.step_ms(True, [64], [64], 1) > 0
    assert prof.version == P.PROFILE_VERSION and prof.prefill.features == P.PREFILL_FEATURES
    assert prof.decode.features == P.DECODE_FEATURES
    # Every grid point is kept: the lone prompts and the step of two prompts of 16 tokens; the
    # one-row decode points measured in three rounds (first, with the grid, last), the median
    # round's steps fitted and kept, as many as the two-row points' one round.
    assert [16, 16] in [q for q, _k, _ms in prof.machine["grid"]["prefill"]]
    # The prefill grid in two passes minutes apart (before the decode grid, after `admit`),
    # the same prompt steps each: both fitted, their ratio kept.
    passes = prof.machine["prefill_passes"]
    assert len(passes["total_ms"]) == 2 and min(passes["total_ms"]) > 0
    assert len(prof.machine["grid"]["prefill"]) % 2 == 0 and passes["drift"] > 0
    rows = [len(k) for k, _ms in prof.machine["grid"]["decode"]]
    assert rows.count(1) == rows.count(2) > 0
    rounds = prof.machine["one_row_rounds"]
    assert sorted(rounds) == ["128", "32"] and all(len(r) == 3 for r in rounds.values())
    for context, means in rounds.items():
        kept = [ms for k, ms in prof.machine["grid"]["decode"]
                if len(k) == 1 and int(context) < k[0] <= int(context) + 8]
        assert np.mean(kept) == pytest.approx(sorted(means)[1], abs=1e-3)
    assert prof.grammar_row_ms >= 0.0 and prof.sample_row_ms >= 0.0
    assert prof.prepare.features == P.PREPARE_FEATURES and prof.prepare_ms(1000) > 0
    assert prof.model.name == "tiny.gguf" and prof.engine_start_s > 0
    # A second engine process of the model beside it (started, told, gone): every factor
    # >= 1, from the medians the file keeps, alone and beside each kind of load.
    c = prof.contention
    assert min(c.decode_beside_prefill, c.batch_decode_beside_prefill,
               c.prefill_beside_decode) >= 1.0
    # Last, a completion-mode core over the same runner: the first decode step of a pulled
    # request against its later ones, per context (the tiny model's positions clip them).
    assert prof.admit is not None and min(prof.admit.coef) >= 0.0
    assert [n for n, _ in prof.machine["admit"]["first_step_extra_ms"]] == [64, 240, 240]
    medians = prof.machine["contention"]["median_ms"]
    assert set(medians) == {"alone", "beside_prefill", "beside_decode"}
    assert all(v > 0 for m in medians.values() for v in m.values())
    assert P.from_dict(P.to_dict(prof)) == prof


def test_a_grid_without_a_round_of_one_row_points_or_a_prefill_pass_is_refused():
    from baton.perf.measure import Grid

    with pytest.raises(ValueError, match="one_row_rounds"):
        Grid(one_row_rounds=0)
    with pytest.raises(ValueError, match="repeats"):
        Grid(repeats=0)


def test_pass_summary_is_the_median_step_ratio_of_the_last_pass_to_the_first():
    from baton.perf.measure import pass_summary

    assert pass_summary([[10.0, 20.0, 40.0]]) == {"total_ms": [70.0], "drift": 1.0}
    got = pass_summary([[10.0, 20.0, 40.0], [11.0, 30.0, 44.0]])
    assert got == {"total_ms": [70.0, 85.0], "drift": 1.1}


def test_no_contention_reaches_the_measurement(tmp_path, monkeypatch, capsys):
    """`baton profile --no-contention` measures without the second engine (the measurement
    itself is the tiny-grid test's; this one stands in for it): the flag reaches `measure` as no
    contention grid, --quick as the quick one, the default as the full one; the profile
    written has no `contention` (test_sim: `baton sim --engines-per-host 2` refuses it)."""
    from baton.perf import measure as M
    from baton.perf.contention import QUICK_CONTENTION, ContentionGrid
    from baton_cli.main import main as baton_main

    given = []

    def measured(model, quantization, threads, grid, contention=None):
        given.append((grid, contention))
        return P.from_dict(_good())  # tests/data's profile: it has no `contention`

    monkeypatch.setattr(M, "measure", measured)
    out = tmp_path / "p.json"
    for flags in (["--no-contention"], ["--quick"], []):
        assert baton_main(["profile", "--out", str(out), "--no-path", *flags]) == 0
    assert given == [(M.Grid(), None), (M.QUICK, QUICK_CONTENTION),
                     (M.Grid(), ContentionGrid())]
    assert "contention (a second engine" not in capsys.readouterr().out
    assert P.load(out).contention is None  # which `baton sim --engines-per-host 2` refuses


def test_the_profile_says_when_the_host_moved_between_the_prefill_passes(tmp_path,
                                                                       monkeypatch, capsys):
    """`baton profile` prints how far the prefill grid's last pass moved from its first and
    says so on stderr past 10% (the file is still written: both passes are fitted)."""
    from dataclasses import replace

    from baton.perf import measure as M
    from baton_cli.main import main as baton_main

    drift = [1.03]

    def measured(model, quantization, threads, grid, contention=None):
        prof = P.from_dict(_good())
        return replace(prof, machine={**prof.machine, "prefill_passes": {
            "total_ms": [1000.0, 1000.0 * drift[0]], "drift": drift[0]}})

    monkeypatch.setattr(M, "measure", measured)
    out = tmp_path / "p.json"
    assert baton_main(["profile", "--out", str(out), "--no-path", "--no-contention"]) == 0
    got = capsys.readouterr()
    assert "its last pass x1.030 its first" in got.out and "speed moved" not in got.err
    drift[0] = 1.2
    assert baton_main(["profile", "--out", str(out), "--no-path", "--no-contention"]) == 0
    assert "the host's speed moved under the measurement (x1.200" in capsys.readouterr().err
    assert P.load(out).machine["prefill_passes"]["drift"] == 1.2


def test_fit_drops_a_feature_that_would_run_backwards_and_weighs_relative_error():
    """A cost that falls with a feature gets that feature's coefficient 0 and the others refitted
    (not clipped after the fact), and every point counts by its relative error: a 10% miss on
    a short step weighs what a 10% miss on a long one does."""
    rows = [(1.0, t, t * (t + c) / 1e3) for t in (16, 64, 256, 512) for c in (0, 256, 1024)]
    ms = [50.0 + 1.0 * r[1] - 0.3 * r[2] for r in rows]
    cost = P.fit_linear(P.PREFILL_FEATURES_V1, rows, ms)
    assert cost.coef[2] == 0.0 and cost.coef[0] > 0 and cost.coef[1] > 0
    rel = [abs(cost.predict(r) - m) / m for r, m in zip(rows, ms, strict=True)]
    assert max(rel) < 0.3  # clipping the unconstrained fit's -0.3 to 0 misses by up to 72%
    # One feature, two points 10% off in opposite directions: the relative fit's optimum,
    # sum(1/y) / sum(1/y^2), not the mean of absolute least squares.
    x = [(1.0, 0.0, 0.0)] * 2 + [(0.0, 1.0, 0.0), (0.0, 0.0, 1.0)]
    cost = P.fit_linear(P.PREFILL_FEATURES_V1, x, [90.0, 110.0, 1.0, 1.0], hold_every=0)
    assert cost.coef[0] == pytest.approx((1 / 90 + 1 / 110) / (1 / 90**2 + 1 / 110**2))
    # relative=False (a cost measured as a difference of steps, `admit`): plain least squares,
    # the mean there; a point at or below 0 by noise weighs what the others do; a slope that
    # would run backwards is dropped as above.
    cost = P.fit_linear(P.PREFILL_FEATURES_V1, x, [90.0, 110.0, 1.0, 1.0], hold_every=0,
                        relative=False)
    assert cost.coef[0] == pytest.approx(100.0)
    line = P.fit_linear(P.ADMIT_FEATURES, [(1.0, 64.0), (1.0, 256.0), (1.0, 1024.0)],
                        [0.0, 2.0, 7.0], relative=False)
    assert line.coef[1] > 0 and line.predict((1.0, 1024.0)) == pytest.approx(7.0, abs=0.3)
    flat = P.fit_linear(P.ADMIT_FEATURES, [(1.0, 64.0), (1.0, 240.0)], [0.3, -0.1],
                        relative=False)
    assert flat.coef == pytest.approx((0.1, 0.0))


def test_step_check_groups_a_workloads_steps_by_kind():
    """`check_steps` (bench/sim_validate.py --step-check) over a mock runner: every step is
    recorded with its shape and the profile's prediction, and grouped by kind."""
    from baton.perf.check import check_steps, format_groups
    from baton.perf.mock_runner import MockRunner

    prof = P.from_dict(_good())
    runner = MockRunner(prof, 64, on_step=lambda s: None)
    prompts = [("time year people " * 10, 4), ("way day " * 30, 3), ("man", 5)]
    result = check_steps(prof, prompts, runner=runner, max_num_batched_tokens=64)
    steps = result["steps"]
    assert sum(s["num_tokens"] for s in steps if s["prompt_run"]) == 30 + 60 + 1
    assert sum(s["num_sampled"] for s in steps) == 4 + 3 + 5
    groups = result["groups"]
    assert "prefill xN" in groups and any(g.startswith("decode +new") for g in groups)
    assert result["total"]["num_steps"] == len(steps)
    assert result["total"]["predicted_ms"] == pytest.approx(sum(s["predicted_ms"] for s in steps))
    assert "prefill xN" in format_groups(result)
