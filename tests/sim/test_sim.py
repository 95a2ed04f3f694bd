"""`baton sim`: real engines (the compiled scheduler in its mode) over the mock runner in virtual
time. Determinism, the result schema `baton bench` writes, and every engine drained at the end;
never timings."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from baton.perf.profile import PREPARE_FEATURES, LinearCost, load
from baton.workload.synthetic import WorkloadConfig
from baton.workload.trace import TraceConfig
from baton_cli.main import main as baton_main
from simulator.fleet import FleetConfig
from simulator.run import SimConfig, simulate

DATA = Path(__file__).resolve().parents[1] / "data"
PROFILE = load(DATA / "profile_test.json")
WINDOW = DATA / "mooncake_conversation_window.jsonl"
SUMMARY_KEYS = {"num_issued", "num_completed", "num_failed", "errors", "duration_s",
                "total_prompt_tokens", "total_output_tokens", "total_cached_tokens",
                "request_throughput", "output_throughput", "goodput", "num_good", "slos_ms",
                "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "by_kind"}


def _run(fleet: FleetConfig, **kw) -> dict:
    cfg = SimConfig(fleet=fleet, request_rate=kw.pop("rate", 4.0),
                    num_requests=kw.pop("num_requests", 40),
                    slos_ms={"ttft": 500.0, "tpot": 60.0})
    return simulate(PROFILE, cfg, WorkloadConfig(dataset=kw.pop("dataset", "mix"), seed=3),
                    kw.pop("trace", None))


def _stable(record: dict) -> dict:
    return {k: record[k] for k in ("summary", "requests", "fleet", "workload")}


def _drained(record: dict) -> None:
    for e in record["fleet"]["engines"]:
        assert e["num_free_blocks"] == e["num_total_blocks"], e


@pytest.mark.parametrize("fleet", [FleetConfig(num_normal=1),
                                   FleetConfig(num_normal=0, num_prompt=1, num_completion=1)],
                         ids=["normal", "pd-1+1"])
def test_a_small_run_completes_drains_and_repeats(fleet):
    a = _run(fleet)
    s = a["summary"]
    assert SUMMARY_KEYS <= set(s)
    assert s["num_completed"] == s["num_issued"] == 40 and s["num_failed"] == 0
    assert s["total_output_tokens"] == sum(r["expected_output_tokens"] for r in a["requests"])
    assert s["ttft_ms"]["median"] > 0 and s["tpot_ms"]["median"] > 0
    _drained(a)
    assert _stable(_run(fleet)) == _stable(a)  # same seed, same record
    if fleet.num_prompt:
        assert {e["role"] for e in a["fleet"]["engines"]} == {"prompt", "completion"}
        assert a["fleet"]["pulled_kv_bytes"] > 0


def test_trace_replay_reuses_prefixes_on_a_pd_fleet():
    trace = TraceConfig(str(WINDOW), num_requests=30, time_scale=2.0, length_scale=1 / 32)
    rec = _run(FleetConfig(num_normal=0, num_prompt=2, num_completion=2), trace=trace)
    assert rec["summary"]["num_completed"] == 30
    assert rec["summary"]["total_cached_tokens"] > 0  # equal hash ids hit the prefix cache
    assert rec["workload"]["dataset"] == "trace"
    _drained(rec)


def test_multi_turn_sends_each_turn_after_the_last():
    rec = _run(FleetConfig(num_normal=2), dataset="multi-turn", num_requests=8)
    reqs = rec["requests"]
    assert rec["summary"]["num_completed"] == len(reqs) == 8 * 6
    assert rec["summary"]["total_cached_tokens"] > 0
    _drained(rec)


def test_baton_sim_writes_the_bench_record(tmp_path, capsys):
    rc = baton_main(["sim", "--profile", str(DATA / "profile_test.json"),
                     "--prompt-engines", "1", "--completion-engines", "1",
                     "--num-requests", "10", "--request-rate", "2", "--goodput", "ttft:800",
                     "--label", "t", "--results-dir", str(tmp_path)])
    assert rc == 0
    (path,) = tmp_path.glob("serve_t_*.json")
    rec = json.loads(path.read_text())
    assert {"label", "model", "bench", "workload", "summary", "requests", "fleet"} <= set(rec)
    assert rec["summary"]["slos_ms"] == {"ttft": 800.0}
    assert "TTFT" in capsys.readouterr().out


def test_bad_flags_are_refused(tmp_path, capsys):
    prof = str(DATA / "profile_test.json")
    assert baton_main(["sim", "--profile", prof, "--prompt-engines", "1"]) == 2
    assert "completion" in capsys.readouterr().err
    # Engines sharing a host slow each other by the profile's contention: this one has none.
    assert baton_main(["sim", "--profile", prof, "--engines-per-host", "2"]) == 2
    assert "contention" in capsys.readouterr().err
    assert baton_main(["sim", "--profile", prof, "--engines-per-host", "0"]) == 2
    assert "engines_per_host" in capsys.readouterr().err
    assert baton_main(["sim", "--profile", prof, "--trace", str(WINDOW),
                       "--request-rate", "3"]) == 2
    assert "exclude" in capsys.readouterr().err


def test_an_engine_steps_again_after_a_step_that_ran_nothing():
    """The engine loop steps while it has work: after the last running request finishes, one
    step may schedule nothing and the next the waiting prompt (here a 341-block chunked prompt
    on an engine of 4 that stalled before, leaving it unfinished)."""
    trace = TraceConfig(str(WINDOW), num_requests=40, time_scale=0.5, length_scale=1 / 16)
    cfg = SimConfig(fleet=FleetConfig(num_normal=4, num_blocks=1024,
                                      max_num_batched_tokens=1024), num_requests=40)
    rec = simulate(PROFILE, cfg, WorkloadConfig(), trace)
    assert rec["summary"]["num_completed"] == 40
    _drained(rec)


def test_structured_requests_cost_their_grammar_rows():
    """--structured-fraction 1: every sampled row is charged the profile's grammar_row_ms (0.4
    ms in the test profile), one request alone at a time, so each output token after the first
    takes exactly that much longer; the same requests, prompts and lengths otherwise."""
    def run(fraction: float) -> dict:
        cfg = SimConfig(fleet=FleetConfig(num_normal=1), request_rate=0.2, num_requests=6)
        return simulate(PROFILE, cfg, WorkloadConfig(dataset="fixed", input_len=64,
                                                     output_len=32, seed=3,
                                                     structured_fraction=fraction))

    plain, structured = run(0.0), run(1.0)
    assert structured["workload"]["structured_fraction"] == 1.0
    tpot = [s["summary"]["tpot_ms"]["median"] for s in (plain, structured)]
    assert tpot[1] - tpot[0] == pytest.approx(PROFILE.grammar_row_ms, rel=1e-6)
    assert [r["prompt_tokens"] for r in structured["requests"]] == \
        [r["prompt_tokens"] for r in plain["requests"]]


def test_the_routers_prepare_delays_each_request_in_the_routers_order():
    """With the router's prepare in the profile, the engines see a request once the router has
    prepared it: a burst's short prompts (on the router's event loop, one after another) before
    its long one (on a prepare worker: its body is over 8 KiB), as live; TTFT counts from the
    arrival at the router. Without it nothing is delayed."""
    from baton.workload.synthetic import RequestSpec
    from baton.workload.words import WORDS

    plain = load(DATA / "profile_test.json")
    slow = dataclasses.replace(plain, prepare=LinearCost(PREPARE_FEATURES, (50.0, 0.5)))
    words = [w for w in WORDS if len(w) >= 4]
    specs = [RequestSpec(0, "doc", " ".join(words[j % len(words)] for j in range(3000)), 3000,
                         4, arrival_s=0.0)]
    specs += [RequestSpec(i, "chat", " ".join(words[(7 * i + j) % len(words)]
                                              for j in range(20)), 20, 4, arrival_s=0.0)
              for i in (1, 2, 3)]
    fleet = FleetConfig(num_normal=1)

    def ttft(profile) -> dict[int, float]:
        rec = simulate(profile, SimConfig(fleet=fleet), None, specs=specs)
        return {r["idx"]: r["ttft_s"] for r in rec["requests"]}

    before, after = ttft(plain), ttft(slow)
    assert max(before[i] for i in (1, 2, 3)) >= before[0]  # one burst: the long one first
    # prepared: the short ones at 60, 120 and 180 ms, the long one at 1550 ms
    assert max(after[i] for i in (1, 2, 3)) < after[0]
    assert after[1] > 0.060 and after[3] > 0.180 and after[0] > 1.550
    assert ttft(dataclasses.replace(slow, prepare=None)) == before
    # no prepare workers (the router's --prepare-workers 0): everything on the event loop
    fleet = FleetConfig(num_normal=1, num_prepare_workers=0)
    assert min(ttft(slow)[i] for i in (1, 2, 3)) > 1.550 + 0.060  # behind the long one
    assert baton_main(["sim", "--profile", str(DATA / "profile_test.json"),
                       "--prepare-workers", "-1"]) == 2


def _lone_requests(n: int, gap_s: float = 30.0):
    from baton.workload.synthetic import RequestSpec
    from baton.workload.words import WORDS

    return [RequestSpec(i, "chat", " ".join(WORDS[(11 * i + j) % len(WORDS)] for j in range(100)),
                        100, 6, arrival_s=gap_s * i) for i in range(n)]


def test_the_serving_path_delays_first_tokens_and_hand_offs():
    """A profile's measured `path` (simulator/calibrate.py): each request reaches its engine
    `request_ms` later (TTFT that much longer on an idle fleet), each hand-off lands
    `handoff_ms` after its pull (the first gap that much longer); none: as before."""
    from baton.perf.profile import PathCost

    specs = _lone_requests(3)
    pd = FleetConfig(num_normal=0, num_prompt=1, num_completion=1)
    with_path = dataclasses.replace(PROFILE, path=PathCost(request_ms=7.0, handoff_ms=3.0))
    for fleet, gap_ms in ((FleetConfig(num_normal=1), 0.0), (pd, 3.0)):
        before, after = (simulate(p, SimConfig(fleet=fleet), None, specs=specs)["requests"]
                         for p in (PROFILE, with_path))
        for b, a in zip(before, after, strict=True):
            assert a["ttft_s"] - b["ttft_s"] == pytest.approx(0.007)
            assert a["itl_s"][0] - b["itl_s"][0] == pytest.approx(gap_ms / 1e3)
            assert a["itl_s"][1:] == pytest.approx(b["itl_s"][1:])


def test_the_engine_loops_own_work_comes_between_steps():
    """The profile's `path.step_gap_ms`: an engine steps that long after its last step ended
    (the loop's own work between steps; an idle engine given work steps at once), so each token
    after the first of a lone stream comes that much later, and its busy time is the steps'
    alone."""
    from baton.perf.profile import PathCost

    specs = _lone_requests(2)
    gap = dataclasses.replace(PROFILE, path=PathCost(step_gap_ms=0.5))
    # Disaggregated, the first gap is the hand-off's: the completion engine, idle, steps as
    # soon as the pull lands.
    for fleet, first in ((FleetConfig(num_normal=1), 0.0005),
                         (FleetConfig(num_normal=0, num_prompt=1, num_completion=1), 0.0)):
        before, after = (simulate(p, SimConfig(fleet=fleet), None, specs=specs)
                         for p in (PROFILE, gap))
        for b, a in zip(before["requests"], after["requests"], strict=True):
            assert a["ttft_s"] == pytest.approx(b["ttft_s"])
            assert [x - y for x, y in zip(a["itl_s"], b["itl_s"], strict=True)] == \
                pytest.approx([first] + [0.0005] * (len(b["itl_s"]) - 1))
        assert [e["busy_s"] for e in after["fleet"]["engines"]] == \
            pytest.approx([e["busy_s"] for e in before["fleet"]["engines"]])


def test_a_pulled_requests_first_decode_step_costs_the_profiles_new_row():
    """The profile's `admit`: a completion engine's first step of a pulled request (its decode
    row gathered from the pool) costs admit_ms(its context) more: its first gap that much
    longer, the later ones as before, the completion engine that much busier a request. A
    co-located request's row comes out of its own prompt step and stays while other prompts'
    steps run between its decode steps (requests 50 ms apart): nothing changes there."""
    admit = dataclasses.replace(PROFILE, admit=LinearCost(("const", "tokens"), (2.0, 0.01)))
    pd = FleetConfig(num_normal=0, num_prompt=1, num_completion=1)
    for fleet, specs in ((FleetConfig(num_normal=1), _lone_requests(4, gap_s=0.05)),
                         (pd, _lone_requests(3))):
        before, after = (simulate(p, SimConfig(fleet=fleet), None, specs=specs)
                         for p in (PROFILE, admit))
        extra = []
        for b, a in zip(before["requests"], after["requests"], strict=True):
            assert a["ttft_s"] == pytest.approx(b["ttft_s"])
            assert a["itl_s"][1:] == pytest.approx(b["itl_s"][1:])
            extra.append(a["itl_s"][0] - b["itl_s"][0])
            if fleet is pd:  # the context of its first decode step: the prompt and a token
                assert extra[-1] == pytest.approx(
                    admit.admit_ms(b["prompt_tokens"] + 1) / 1e3, abs=0.02e-3)
        _drained(after)
        busy = [a["busy_s"] - b["busy_s"] for a, b in zip(
            after["fleet"]["engines"], before["fleet"]["engines"], strict=True)]
        if fleet is pd:
            assert busy == pytest.approx([0.0, sum(extra)])
        else:
            assert extra == pytest.approx([0.0] * 4) and busy == pytest.approx([0.0])


def test_a_hand_off_waits_for_the_completion_engines_step_to_end(monkeypatch):
    """A live completion engine reads its socket between steps: a hand-off that reaches it
    mid-step is admitted (its pull begins) when the step ends, never during it."""
    from simulator.fleet import Simulation

    pulls = []
    retry = Simulation.retry_admissions

    def watched(self, comp):
        if comp.admissions:
            pulls.append(comp.busy)
        retry(self, comp)

    monkeypatch.setattr(Simulation, "retry_admissions", watched)
    # Requests 50 ms apart: each one's prompt step ends while the last one decodes.
    rec = simulate(PROFILE, SimConfig(fleet=FleetConfig(num_normal=0, num_prompt=1,
                                                        num_completion=1)),
                   None, specs=_lone_requests(6, gap_s=0.05))
    assert rec["summary"]["num_completed"] == 6
    assert pulls and not any(pulls)



def test_pulls_into_one_completion_engine_land_one_after_another():
    """Prompts handed off by one prompt step are pulled one after another (one link: a real
    engine's importer verifies each landed pull in turn and its reads share the bandwidth):
    the second request's first gap holds both pulls, not its own alone."""
    pd = FleetConfig(num_normal=0, num_prompt=1, num_completion=1)
    specs = _lone_requests(2, gap_s=0.0)  # one prompt step for both, handed off together
    slow = dataclasses.replace(PROFILE, transfer_latency_ms=PROFILE.transfer_latency_ms + 50)
    gaps = {}
    for name, prof in (("fast", PROFILE), ("slow", slow)):
        rec = simulate(prof, SimConfig(fleet=pd), None, specs=specs)
        assert [r["ttft_s"] for r in rec["requests"]][0] == rec["requests"][1]["ttft_s"]
        gaps[name] = [r["itl_s"][0] for r in rec["requests"]]
    one_pull = PROFILE.transfer_ms(7) / 1e3  # 100 words, 7 blocks of 16 tokens each
    assert gaps["slow"][0] - gaps["fast"][0] == pytest.approx(0.050)
    # Behind the first pull (within a decode step: it joins at a step's end).
    assert gaps["slow"][1] - gaps["fast"][1] == pytest.approx(0.100, abs=0.02)
    assert gaps["slow"][1] - gaps["slow"][0] >= 0.050 + one_pull - 0.02


def test_engines_sharing_a_host_slow_each_others_steps_by_the_profiles_contention():
    """Processor sharing in virtual time (simulator/fleet.py): a decode step runs at 1/factor
    of its speed while the prompt engine of its host runs a prompt step, and a prompt step at
    1/factor while the completion engine decodes; the busy time each engine reports holds what
    was added. Engines on hosts of their own, or factors of 1: the record as without."""
    from baton.perf.profile import Contention
    from baton.workload.synthetic import RequestSpec
    from baton.workload.words import WORDS

    def words(i: int, n: int) -> str:
        return " ".join(WORDS[(13 * i + j) % len(WORDS)] for j in range(n))

    # One request decoding 200 tokens, then a long prompt prefilled beside its decode.
    specs = [RequestSpec(0, "chat", words(0, 16), 16, 200, arrival_s=0.0),
             RequestSpec(1, "chat", words(1, 1000), 1000, 2, arrival_s=0.2)]
    pd = FleetConfig(num_normal=0, num_prompt=1, num_completion=1)
    shared = dataclasses.replace(pd, engines_per_host=2)

    def run(profile, fleet):
        rec = simulate(profile, SimConfig(fleet=fleet), None, specs=specs)
        _drained(rec)
        return rec

    base = run(PROFILE, pd)
    slow = Contention(decode_beside_prefill=1.5, batch_decode_beside_prefill=1.5,
                      prefill_beside_decode=1.25)
    none = Contention()
    assert _stable(run(dataclasses.replace(PROFILE, contention=slow), pd)) == _stable(base)
    assert _stable(run(dataclasses.replace(PROFILE, contention=none), shared)) == _stable(base)
    rec = run(dataclasses.replace(PROFILE, contention=slow), shared)
    assert _stable(run(dataclasses.replace(PROFILE, contention=slow), shared)) == _stable(rec)
    busy = {e["role"]: e for e in rec["fleet"]["engines"]}
    was = {e["role"]: e for e in base["fleet"]["engines"]}
    # The decode stream slowed while the long prompt prefilled: its gaps then were 1.5x.
    gaps, gaps0 = rec["requests"][0]["itl_s"], base["requests"][0]["itl_s"]
    assert max(g / g0 for g, g0 in zip(gaps, gaps0, strict=True)) == pytest.approx(1.5, rel=0.02)
    assert gaps[:4] == pytest.approx(gaps0[:4])  # before the long prompt arrived: alone
    extra = busy["completion"]["busy_s"] - was["completion"]["busy_s"]
    assert 0 < extra <= 0.5 * was["completion"]["busy_s"] + 1e-9
    # The prompt step beside the decode: slowed for the part of it the decode overlapped.
    assert was["prompt"]["prefill_busy_s"] < busy["prompt"]["prefill_busy_s"] \
        < 1.25 * was["prompt"]["prefill_busy_s"]
    assert busy["prompt"]["busy_s"] == pytest.approx(busy["prompt"]["prefill_busy_s"], abs=1e-3)
    with pytest.raises(ValueError, match="contention"):
        simulate(PROFILE, SimConfig(fleet=shared), None, specs=specs)


def test_the_router_and_clients_on_the_engines_cores_take_their_cpu_from_busy_steps():
    """FleetConfig.service_cores: the router's and the clients' CPU for each step's outputs (the
    profile's path.service_*_ms) runs on an idle core of the first host while it has one, else
    it lengthens the steps of the host's busy engines in equal parts (their busy time holds
    it). A core to spare: the record as without. A profile without the cost measured is
    refused by name (the flag would do nothing)."""
    from baton.perf.profile import Contention, PathCost
    from baton.workload.synthetic import RequestSpec
    from baton.workload.words import WORDS

    def words(i: int, n: int) -> str:
        return " ".join(WORDS[(7 * i + j) % len(WORDS)] for j in range(n))

    # One stream decoding, a long prompt arriving during it, then a short one.
    specs = [RequestSpec(0, "chat", words(0, 16), 16, 120, arrival_s=0.0),
             RequestSpec(1, "chat", words(1, 600), 600, 2, arrival_s=0.3),
             RequestSpec(2, "chat", words(2, 40), 40, 2, arrival_s=2.0)]
    path = PathCost(step_gap_ms=0.2, service_step_ms=1.0, service_token_ms=0.3)
    served = dataclasses.replace(PROFILE, path=path, contention=Contention())
    bare = dataclasses.replace(served, path=PathCost(step_gap_ms=0.2))
    pd = FleetConfig(num_normal=0, num_prompt=1, num_completion=1, engines_per_host=2)

    def run(profile, fleet):
        rec = simulate(profile, SimConfig(fleet=fleet), None, specs=specs)
        _drained(rec)
        return rec

    base = run(served, pd)  # service_cores 0: the router and the clients elsewhere
    assert _stable(run(served, dataclasses.replace(pd, service_cores=3))) == _stable(base)
    with pytest.raises(ValueError, match="service_cores"):
        run(bare, dataclasses.replace(pd, service_cores=2))
    colo = FleetConfig(num_normal=1)
    assert _stable(run(served, dataclasses.replace(colo, service_cores=2))) \
        == _stable(run(served, colo))
    rec = run(served, dataclasses.replace(pd, service_cores=2))
    assert _stable(run(served, dataclasses.replace(pd, service_cores=2))) == _stable(rec)
    busy = {e["role"]: e for e in rec["fleet"]["engines"]}
    was = {e["role"]: e for e in base["fleet"]["engines"]}
    # The long prompt's step, beside the stream's decode steps: their outputs' CPU, half of it
    # each (~1.3 ms a one-row step, ~0.65 each), lengthened it by a few percent.
    extra = busy["prompt"]["prefill_busy_s"] - was["prompt"]["prefill_busy_s"]
    assert 0.005 < extra < 0.1 * was["prompt"]["prefill_busy_s"]
    assert busy["completion"]["busy_s"] > was["completion"]["busy_s"]
    ttft = [r["ttft_s"] for r in rec["requests"]]
    ttft0 = [r["ttft_s"] for r in base["requests"]]
    assert ttft[0] == ttft0[0]  # alone on the host's cores: a core to spare
    assert ttft[1] > ttft0[1]
    with pytest.raises(ValueError, match="service_cores"):
        dataclasses.replace(pd, service_cores=1)  # two engines on the host: a core each
