"""A mixed fleet's per-request path (router/path.py): the policies on plain data with the test
profile, the load they read (router/load.py), the flags that choose them (`baton router`,
`baton up`), and the router's dispatch over real ZMQ against scripted engines (no model).
The same choice on real engines: tests/router/test_path_choice_e2e.py. Here too, over the same
scripted engines: what the router reports to the planner of each request that ended
(`GET /planner/observations`' outcomes, planner/signals.py)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from baton.perf.profile import load as load_profile
from planner.loop import RouterObservations
from planner.signals import slo_report
from router.config import RouterConfig
from router.load import LegWork, LoadTracker
from router.path import (
    COLOCATED,
    DISAGGREGATED,
    PREDICTED,
    THRESHOLD,
    EngineView,
    PathRequest,
    PredictedPath,
    ThresholdPath,
)
from tests.router.conftest import serve_router

PROFILE = Path(__file__).resolve().parents[1] / "data" / "profile_test.json"
SHORT, LONG = 16, 1024  # prompt tokens
IDLE = EngineView()


@pytest.fixture(scope="module")
def predicted() -> PredictedPath:
    return PredictedPath(load_profile(PROFILE))


def test_an_idle_fleet_stays_colocated_whatever_the_length(predicted):
    """Same prefill either way, and the disaggregated path adds its handoff."""
    for num_tokens in (SHORT, LONG):
        choice = predicted.choose(PathRequest(num_tokens, 16), IDLE, IDLE, IDLE)
        assert (choice.path, choice.reason) == (COLOCATED, PREDICTED)
        assert choice.colocated_ms < choice.disaggregated_ms


def test_short_colocated_long_disaggregated_under_the_same_load(predicted):
    """The normal engine decodes one request and the prompt engine has one prompt queued: a
    short prompt's stall of that decode costs less than the queue and the handoff, a long
    one's costs more (the profile: 8 ms + 0.5 ms a token, and attention)."""
    normal = EngineView(num_running=1, num_context_tokens=300)
    prompt = EngineView(num_queued_prefills=1, num_queued_tokens=200)
    completion = EngineView(num_running=1, num_context_tokens=300)
    short = predicted.choose(PathRequest(SHORT, 16), normal, prompt, completion)
    long = predicted.choose(PathRequest(LONG, 16), normal, prompt, completion)
    assert short.path == COLOCATED and long.path == DISAGGREGATED
    # The long prompt's stall of the running decode alone (~530 ms) outweighs the queue.
    assert long.colocated_ms - long.disaggregated_ms > 300
    assert "co-located" in long.describe() and "disaggregated" in long.describe()


def test_a_decoding_normal_engine_sends_a_long_prompt_away(predicted):
    """Nothing queued anywhere; the normal engine decodes: the stall decides."""
    normal = EngineView(num_running=2, num_context_tokens=400)
    assert predicted.choose(PathRequest(LONG, 16), normal, IDLE, IDLE).path == DISAGGREGATED


def test_the_prompt_engines_cached_prefix_tips_a_long_prompt(predicted):
    """An idle fleet, but the prompt and completion engines hold 60 of the prompt's 64 blocks
    and the normal engine none: prefilling 64 tokens and pulling 4 blocks beats 1024 tokens."""
    held = EngineView(num_overlap_blocks=60)
    choice = predicted.choose(PathRequest(LONG, 16), IDLE, held, held)
    assert choice.path == DISAGGREGATED
    cold = predicted.choose(PathRequest(LONG, 16), held, IDLE, IDLE)
    assert cold.path == COLOCATED  # the same blocks on the normal engine: stay there


def test_the_handoff_cost_moves_the_break_even(predicted):
    normal = EngineView(num_running=1, num_context_tokens=100)
    cheap = predicted.choose(PathRequest(64, 16), normal, IDLE, IDLE)
    dear = PredictedPath(predicted.profile, handoff_ms=10_000).choose(
        PathRequest(64, 16), normal, IDLE, IDLE)
    assert (cheap.path, dear.path) == (DISAGGREGATED, COLOCATED)
    with pytest.raises(ValueError, match="handoff_ms"):
        PredictedPath(predicted.profile, handoff_ms=-1)


def test_the_handoff_cost_defaults_to_the_profiles_measured_one(predicted):
    """`--pd-handoff-ms` unset: the profile's `path.handoff_ms` (baton profile measures it on
    mock engines), else the estimate DEFAULT_HANDOFF_MS for a profile without one."""
    import dataclasses

    from baton.perf.profile import PathCost
    from router.path import DEFAULT_HANDOFF_MS, build_path_policy

    assert predicted.profile.path is None and predicted.handoff_ms == DEFAULT_HANDOFF_MS
    measured = dataclasses.replace(predicted.profile, path=PathCost(6.0, 1.9, 18))
    assert PredictedPath(measured).handoff_ms == 1.9
    assert build_path_policy(measured).handoff_ms == 1.9
    assert build_path_policy(measured, handoff_ms=25.0).handoff_ms == 25.0


def test_static_threshold_counts_the_normal_engines_uncached_tokens():
    policy = ThresholdPath(256)
    assert policy.choose(PathRequest(200), IDLE, IDLE, IDLE) == \
        policy.choose(PathRequest(256), IDLE, IDLE, IDLE)
    assert policy.choose(PathRequest(200), IDLE, IDLE, IDLE).path == COLOCATED
    long = policy.choose(PathRequest(300), IDLE, IDLE, IDLE)
    assert (long.path, long.reason) == (DISAGGREGATED, THRESHOLD)
    # 4 cached blocks of 16 on the normal engine: 236 tokens left to prefill there
    assert policy.choose(PathRequest(300), EngineView(num_overlap_blocks=4), IDLE,
                         IDLE).path == COLOCATED
    with pytest.raises(ValueError, match="threshold_tokens"):
        ThresholdPath(-1)


def test_load_tracker_counts_prefill_queue_and_context():
    load = LoadTracker(failure_cooldown_s=5.0)
    first, second = LegWork(100, 100), LegWork(40, 300)
    load.acquire("a", 7, first)
    load.acquire("a", 2, second)
    work = load.work("a")
    assert (work.num_prefilling, work.num_prefill_tokens, work.num_context_tokens) == \
        (2, 140, 400)
    load.prefilled("a", first)
    load.prefilled("a", first)  # once only: the leg's prefill is zeroed
    work = load.work("a")
    assert (work.num_prefilling, work.num_prefill_tokens) == (1, 40)
    load.release("a", 2, second)  # ended before its first token: leaves the queue too
    load.release("a", 7, first)
    work = load.work("a")
    assert (work.num_prefilling, work.num_prefill_tokens, work.num_context_tokens) == (0, 0, 0)
    assert load.num_requests("a") == 0 and load.num_blocks("a") == 0


def test_router_config_checks_the_path_flags(tmp_path):
    bad = tmp_path / "bad.json"
    data = json.loads(PROFILE.read_text())
    del data["decode"]["coef"]
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"bad\.json: missing field decode\.coef"):
        RouterConfig(insecure=True, profile_path=str(bad))
    with pytest.raises(ValueError, match="not both"):
        RouterConfig(insecure=True, profile_path=str(PROFILE), pd_threshold_tokens=10)
    with pytest.raises(ValueError, match="pd_threshold_tokens must be an int >= 0"):
        RouterConfig(insecure=True, pd_threshold_tokens=-3)
    with pytest.raises(ValueError, match="pd_handoff_ms"):
        RouterConfig(insecure=True, pd_handoff_ms=float("nan"))


def test_baton_router_and_up_refuse_a_bad_profile_by_its_field(tmp_path, capsys):
    from baton_cli.main import main as baton_main

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**json.loads(PROFILE.read_text()), "version": 99}))
    for command in (["router", "--insecure"], ["up", "--normal-engines", "1",
                                                "--prompt-engines", "1",
                                                "--completion-engines", "1"]):
        assert baton_main([*command, "--profile", str(bad)]) == 2
        err = capsys.readouterr().err
        assert f"baton {command[0]}: {bad}: profile version 99 is not supported" in err


def test_baton_up_hands_the_path_flags_to_the_router():
    from baton_cli.launcher import LaunchConfig, Launcher

    mixed = dict(num_prompt_engines=1, num_completion_engines=1, num_normal_engines=1)
    argv = Launcher(LaunchConfig(**mixed, profile=str(PROFILE))).router_argv()
    assert argv[argv.index("--profile") + 1] == str(PROFILE)
    assert "--pd-handoff-ms" not in argv
    argv = Launcher(LaunchConfig(**mixed, profile=str(PROFILE), pd_handoff_ms=25)).router_argv()
    assert argv[argv.index("--pd-handoff-ms") + 1] == "25"
    with pytest.raises(ValueError, match="--pd-handoff-ms .* needs --profile"):
        LaunchConfig(**mixed, pd_handoff_ms=25)
    argv = Launcher(LaunchConfig(**mixed, pd_threshold_tokens=64)).router_argv()
    assert argv[argv.index("--pd-threshold-tokens") + 1] == "64"
    assert "--profile" not in Launcher(LaunchConfig(**mixed)).router_argv()
    with pytest.raises(ValueError, match="not both"):
        LaunchConfig(**mixed, profile=str(PROFILE), pd_threshold_tokens=64)


def _path_counts(url: str) -> dict[tuple[str, str], float]:
    counts = {}
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith("baton_router_path_total{"):
            labels, value = line[len("baton_router_path_total{"):].split("} ")
            parts = dict(p.split("=") for p in labels.split(","))
            counts[(parts["path"].strip('"'), parts["reason"].strip('"'))] = float(value)
    return counts


def test_a_mixed_fleet_routes_each_request_on_its_path(engines, model_info, caplog):
    """Scripted NORMAL, PROMPT and COMPLETION engines behind one router with a static
    threshold: the short prompt is served by the normal engine alone, the long one prompted
    and completed; each path on the request's log line and in the path metric."""
    tokens = model_info.tokenizer.encode(" one two three four five six seven eight")
    normal, prompt, completion = (engines(role, tokens) for role in
                                  ("normal", "prompt", "completion"))
    config = RouterConfig(engines=[f"{e.role}={e.address}" for e in (normal, prompt, completion)],
                          num_prepare_workers=0, pd_threshold_tokens=20)
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 5, "temperature": 0}
    with serve_router(config, model_info) as url, caplog.at_level("INFO", "router.dispatch"):
        short = httpx.post(f"{url}/v1/completions", json={**body, "prompt": "one two"}, timeout=30)
        long = httpx.post(f"{url}/v1/completions", json={**body, "prompt": " six" * 40},
                          timeout=30)
        assert short.status_code == long.status_code == 200, (short.text, long.text)
        assert short.json()["choices"][0]["text"] == long.json()["choices"][0]["text"]
        assert [len(r.prompt_token_ids) for r in normal.generates] == [2]
        assert [len(r.prompt_token_ids) for r in prompt.generates] == [40]
        assert [len(r.prompt_token_ids) for r in completion.generates] == [40]
        assert _path_counts(url) == {(COLOCATED, THRESHOLD): 1, (DISAGGREGATED, THRESHOLD): 1}
    lines = [r.getMessage() for r in caplog.records if "path" in r.getMessage()]
    assert any("2 prompt tokens, path colocated (threshold)" in line for line in lines), lines
    assert any("40 prompt tokens, path disaggregated (threshold)" in line for line in lines)


def test_a_fleet_of_one_kind_has_one_path(engines, model_info):
    tokens = model_info.tokenizer.encode(" one two three")
    normal = engines("normal", tokens)
    config = RouterConfig(engines=[f"normal={normal.address}"], num_prepare_workers=0,
                          profile_path=str(PROFILE))
    with serve_router(config, model_info) as url:
        done = httpx.post(f"{url}/v1/completions", timeout=30, json={
            "model": "SmolLM2-135M-Instruct", "prompt": " six" * 40, "max_tokens": 3})
        assert done.status_code == 200, done.text
        assert _path_counts(url) == {(COLOCATED, "only_path"): 1}


def test_a_path_that_fails_before_any_token_falls_back_to_the_other(engines, model_info):
    """The normal engine fails every request: a short prompt chosen co-located is served
    down the disaggregated path instead of a 503, and counted as a fallback."""
    tokens = model_info.tokenizer.encode(" one two three four five six seven eight")
    normal = engines("normal", tokens, mode="error")
    prompt, completion = engines("prompt", tokens), engines("completion", tokens)
    config = RouterConfig(engines=[f"{e.role}={e.address}" for e in (normal, prompt, completion)],
                          num_prepare_workers=0, pd_threshold_tokens=20)
    with serve_router(config, model_info) as url:
        done = httpx.post(f"{url}/v1/completions", timeout=30, json={
            "model": "SmolLM2-135M-Instruct", "prompt": "one two", "max_tokens": 5})
        assert done.status_code == 200, done.text
        assert done.json()["usage"]["completion_tokens"] == 5
        assert done.json()["choices"][0]["text"] == model_info.tokenizer.decode(tokens[:5])
        assert len(normal.generates) == 1 and len(prompt.generates) == 1
        assert _path_counts(url) == {(COLOCATED, THRESHOLD): 1, (DISAGGREGATED, "fallback"): 1}


def test_the_router_reports_each_ended_requests_latencies_and_failures(engines, model_info,
                                                                      make_client):
    tokens = model_info.tokenizer.encode(" one two three four five six seven eight")
    normal = engines("normal", tokens, delay_s=0.02, fail_after=5)  # a request of 6+ fails
    config = RouterConfig(engines=[f"normal={normal.address}"], num_prepare_workers=0,
                          migration_limit=0)
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "Count:", "temperature": 0}
    with serve_router(config, model_info) as url:
        done = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 4}, timeout=30)
        assert done.status_code == 200, done.text
        failed = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 8}, timeout=30)
        assert failed.status_code == 502, failed.text
        now, arrivals, outcomes = RouterObservations(url, window_s=60)()
        raw = httpx.get(f"{url}/planner/observations", params={"window_s": 60}).json()
    assert len(arrivals) == 1 and arrivals[0][2] == 4  # arrivals: finished requests only
    assert [o.ok for o in outcomes] == [True, False]
    first, second = outcomes
    assert all(now - 30 < o.done_s <= now for o in outcomes)
    # the first token at once, then one every 20 ms: a TPOT of about that
    assert 0 < first.ttft_s < 5 and 0.015 <= first.tpot_s < 1
    assert second.ttft_s > 0 and second.tpot_s == 0.0  # it failed after its first token
    assert [row[3] for row in raw["outcomes"]] == [1, 0]
    report = slo_report(outcomes, {"ttft": 5000.0, "tpot": 1000.0}, now - 60)
    assert (report.num_requests, report.attainment) == (2, 0.5)  # the failure misses
    # refused (no engine: a 503 at once): outside the SLO too, with no token
    client = make_client()
    assert client.post("/v1/completions", json={**body, "max_tokens": 4}).status_code == 503
    (refused,) = client.get("/planner/observations").json()["outcomes"]
    assert refused[1:] == [0.0, 0.0, 0]
