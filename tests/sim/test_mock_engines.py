"""Mock engines as processes (`--mock PROFILE.json`): the real engine loop, scheduler, ZMQ,
registry, router and KV transfer (NIXL moves the mock pool's bytes), with only the model
replaced by the profile's step times; no torch imported, no weights loaded."""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from baton.ops.up_process import UpProcess, start_up
from baton.service.client import probe_engine
from baton.workload.words import WORDS
from tests.cluster import KEYS, is_whole

PROFILE = str(Path(__file__).resolve().parents[1] / "data" / "profile_test.json")
ENGINE_FLAGS = ["--num-blocks", "96", "--max-num-seqs", "8"]
NUM_REQUESTS, MAX_TOKENS = 12, 8


def test_a_mock_engine_process_imports_no_torch():
    code = f"""
import sys
from baton_cli.main import build_parser
from baton_cli.engine_main import build_worker
from baton.ops.dp import DPConfig, DPGroup
args = build_parser().parse_args(["prompt-engine", "--mock", {PROFILE!r}, "--num-blocks", "32",
                                  "--insecure"])
args.cluster_keys = None
worker = build_worker(args, "prompt", DPGroup(DPConfig()), "p0")
assert type(worker.engine.kv_cache).__module__ == "numpy", type(worker.engine.kv_cache)
loaded = [m for m in ("torch", "baton.model.runner", "baton.model.loader") if m in sys.modules]
assert not loaded, loaded
print("ok", worker.handoff.side_channel)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and "ok tcp://" in done.stdout, done.stderr[-3000:]


def test_a_structured_request_to_a_mock_engine_is_refused_by_name():
    """Mock tokens follow no grammar (the simulator charges grammar rows instead): the engine
    core refuses a structured request at admission with a reason, and holds nothing of it."""
    import llguidance

    from baton.engine import EngineConfig, LLMEngine
    from baton.perf.mock_runner import MockRunner
    from baton.perf.profile import load
    from baton.sampling.params import SamplingParams
    from baton.workload.synthetic import STRUCTURED_SCHEMA

    engine = LLMEngine(EngineConfig(num_blocks=64),
                       runner=MockRunner(load(PROFILE), 64, on_step=lambda s: None))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(STRUCTURED_SCHEMA)
    with pytest.raises(ValueError, match="structured output needs the model's tokenizer"):
        engine.add_request(None, "time year people", SamplingParams(max_tokens=4, grammar=grammar))
    assert not engine.has_unfinished() and engine.num_free_blocks() == engine.num_total_blocks()


def test_mock_flags_that_mean_nothing_are_refused():
    from baton_cli.main import main as baton_main

    assert baton_main(["engine", "--mock", PROFILE, "--num-threads", "2"]) == 1
    assert baton_main(["engine", "--mock", PROFILE, "--block-size", "32"]) == 1
    assert baton_main(["up", "--mock", PROFILE, "--model", "x.gguf"]) == 2


def _start(flags: list[str], profile: str = PROFILE,
           engine_flags: list[str] = ENGINE_FLAGS) -> UpProcess:
    """`baton up --mock` with these flags (the fleet's shape, the launcher's own), up."""
    return start_up(["--mock", profile, "--no-cpu-pinning", *flags, "--", *engine_flags],
                    ready_timeout_s=60)


def _ask(port: int, i: int) -> tuple[str, str, int]:
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0,
                    timeout=30)
    words = " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(20 + 5 * i))
    # Every other request repeats one prompt: the second one is a prefix-cache hit.
    content = words if i % 2 else "time year people way day man thing woman life child"
    resp = client.chat.completions.create(
        model=client.models.list().data[0].id, max_tokens=MAX_TOKENS, temperature=0,
        messages=[{"role": "user", "content": content}])
    return resp.choices[0].message.content, resp.choices[0].finish_reason, \
        resp.usage.completion_tokens


def test_a_baton_up_that_fails_to_start_is_reported_with_its_words(tmp_path):
    """baton/ops/up_process.py: a launcher that exits before its banner raises UpError with
    the tail of its log (here its refusal of a flag, before it starts anything)."""
    from baton.ops.up_process import UpError

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(UpError, match=r"exited with 2 before it was up[\s\S]*--no-such-flag"):
        start_up(["--no-such-flag", str(tmp_path)], ready_timeout_s=60)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


@pytest.fixture(scope="module")
def fleets():
    """`baton up --mock` fleets by their flags, started on first use and shared by this module's
    tests (each start is a few seconds of processes importing the router and engine code)."""
    started: dict[tuple[str, ...], UpProcess] = {}

    def get(fleet: list[str]) -> UpProcess:
        if tuple(fleet) not in started:
            started[tuple(fleet)] = _start(fleet)
        return started[tuple(fleet)]

    try:
        yield get
    finally:
        with ThreadPoolExecutor(max(1, len(started))) as pool:  # each stop waits on its drain
            list(pool.map(UpProcess.stop, started.values()))


@pytest.mark.slow  # multi-process deployments, as tests/services/test_launcher.py
@pytest.mark.parametrize("fleet", [["--prompt-engines", "1", "--completion-engines", "1"],
                                   ["--normal-engines", "1"]], ids=["pd-1+1", "normal-1"])
def test_baton_up_mock_serves_the_openai_client(fleets, fleet):
    up = fleets(fleet)
    engines = up.engines
    assert len(engines) == (2 if "--prompt-engines" in fleet else 1), up.banner
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda i: _ask(up.port, i), range(NUM_REQUESTS)))
    assert all(a[1:] == ("length", MAX_TOKENS) and a[0] for a in answers), answers
    # Deterministic tokens: the same prompt, the same text (here through the prefix cache).
    assert len({a[0] for a in answers[0::2]}) == 1
    deadline = time.monotonic() + 20
    while True:
        stats = {e: probe_engine(a, timeout_s=5.0, keys=KEYS) for e, a in engines.items()}
        if all(s is not None and is_whole(s) for s in stats.values()):
            break
        assert time.monotonic() < deadline, f"pools not whole: {stats}"
        time.sleep(0.2)
    if "completion-0" in stats:  # NIXL moved the mock pool's bytes
        extra = stats["completion-0"].extra
        assert extra["kv_pulls_done"] == NUM_REQUESTS and extra["kv_bytes_total"] > 0
    for child in psutil.Process(up.proc.pid).children():
        argv = child.cmdline()
        if "--engine-id" in argv:  # no torch library mapped in an engine process
            assert "--mock" in argv
            assert not [m.path for m in child.memory_maps() if "libtorch" in m.path]


@pytest.mark.slow
def test_baton_up_api_keys_file_reaches_the_router(tmp_path):
    """`baton up --api-keys-file`: the router demands one of the named keys (401 without),
    answers with one, and the launcher's banner names the model (it asked with a file's key)."""
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n  - {name: alice, key: sk-alice-0123456789abcdef}\n"
                    "  - {name: bob, key: sk-bob-0123456789abcdef0}\n")
    keys.chmod(0o600)
    up = _start(["--normal-engines", "1", "--api-keys-file", str(keys), "--cache-salt-per-key"])
    try:
        from openai import AuthenticationError, OpenAI

        assert '"model": "MODEL"' not in up.banner, up.banner
        base = f"{up.base_url}/v1"
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=base, api_key="sk-nobody-0123456789ab", max_retries=0).models.list()
        client = OpenAI(base_url=base, api_key="sk-bob-0123456789abcdef0", max_retries=0,
                        timeout=30)
        resp = client.completions.create(model=client.models.list().data[0].id, prompt="hello",
                                         max_tokens=4, temperature=0)
        assert resp.usage.completion_tokens == 4
    finally:
        up.stop()


def test_baton_up_refuses_a_bad_api_keys_file_before_starting(tmp_path):
    from baton_cli.main import main as baton_main

    keys = tmp_path / "keys.yaml"
    keys.write_text("keys: []\n")
    keys.chmod(0o600)
    assert baton_main(["up", "--mock", PROFILE, "--api-keys-file", str(keys)]) == 2
    assert baton_main(["up", "--mock", PROFILE, "--cache-salt-per-key"]) == 2


# 13 x "time" then "court": 14 prompt tokens in the router's tokenizer (SmolLM2), whose first
# mock token is id 9, one of that tokenizer's special tokens: it decodes to no text.
SPECIAL_FIRST = " ".join(["time"] * 13 + ["court"])


@pytest.mark.slow
def test_a_request_whose_only_token_decodes_to_no_text_is_served(fleets):
    """The one failed request of 2,000 in bench/mock_fleet.py: max_tokens 1 and a mock token
    that is a special id of the router's tokenizer (skipped in text). The router ends the stream
    properly (finish_reason length, one completion token, no text); the benchmark's client
    counted a stream without text as failed. It is a complete response, and its TTFT is the
    chunk that finishes it."""
    import asyncio

    import httpx

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import serve_bench as sb

    from baton.perf.mock_runner import mock_token
    from baton.workload.synthetic import RequestSpec
    from router.text import TextStream, load_model_info

    tok = load_model_info().tokenizer
    ids = tok.encode(SPECIAL_FIRST)
    first = mock_token(len(ids), ids[-1], 0, 49152)
    assert TextStream(tok).add([first]) == "" and tok.decode([first]) == ""  # the premise

    up = fleets(["--normal-engines", "1"])  # the serving test's, when it ran
    cfg = sb.BenchConfig(base_url=up.base_url, endpoint="completions", progress=False)

    async def ask(max_tokens: int):
        spec = RequestSpec(0, "short", SPECIAL_FIRST, 14, max_tokens)
        async with httpx.AsyncClient(base_url=cfg.base_url, timeout=30) as client:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
            return await sb.send_request(client, cfg, spec, model, True, time.perf_counter())

    one = asyncio.run(ask(1))
    assert one.ok, (one.error, up.tail(20))
    assert (one.text, one.output_tokens, one.prompt_tokens) == ("", 1, 14)
    assert 0 < one.ttft_s <= one.e2e_s
    two = asyncio.run(ask(2))  # the second token has text: TTFT at its chunk
    assert two.ok and two.output_tokens == 2 and two.text, two.error


@pytest.mark.slow
def test_the_speed_probe_reads_the_engines_busy_time_against_the_simulators(fleets):
    """simulator/calibrate.py `speed_probe` (bench/sim_validate.py's probe of the host's speed
    now), on the serving test's mock engine: it sleeps each forward the profile predicts, so
    the probe finds about the profile's speed, for prompt steps and decode steps alike."""
    import httpx

    from baton.perf.profile import load
    from simulator.calibrate import ProbeConfig, speed_probe
    from simulator.fleet import FleetConfig

    up = fleets(["--normal-engines", "1"])
    httpx.post(f"{up.base_url}/reset_prefix_cache", timeout=30).raise_for_status()
    assert list(up.metrics_urls) == ["normal-0"]
    found = speed_probe(up.base_url, list(up.metrics_urls.values()), load(PROFILE),
                        FleetConfig(num_normal=1, num_blocks=96, max_num_seqs=8),
                        ProbeConfig(lone_lens=(128, 256), solo_max_tokens=12, burst=8,
                                    burst_max_tokens=12))
    # Phase 1 is mostly prompt steps, phases 2 and 3 mostly decode steps.
    pre, dec = found.predicted_prefill_s, found.predicted_decode_s
    assert pre[0] > dec[0] and min(dec[1] - pre[1], dec[2] - pre[2]) > 0, found
    assert 0.7 < found.prefill_factor < 1.4 and 0.7 < found.decode_factor < 1.4, found
    # The engine says which of its busy seconds were prompt steps: the factors are those
    # seconds over the simulator's, not a fit (the phases with decode steps hold some too).
    real_pre = found.real_prefill_s
    assert real_pre is not None and all(0 < p < b for p, b in zip(real_pre, found.real_busy_s, strict=True))
    assert found.prefill_factor == pytest.approx(sum(real_pre) / sum(pre))
    assert found.factor == pytest.approx(sum(found.real_busy_s) / (sum(pre) + sum(dec)))
    assert 0 <= found.misfit < 0.3, found
    deadline = time.monotonic() + 20  # the probe's requests leave the pool whole
    while not all(is_whole(probe_engine(a, 5.0, keys=KEYS)) for a in up.engines.values()):
        assert time.monotonic() < deadline, "pool not whole after the probe"
        time.sleep(0.2)


def test_a_mock_step_sleeps_the_forward_and_the_simulator_charges_the_whole_step(monkeypatch):
    """The profile's step is forward + the engine's own work (docs/profile.md, measured outside
    the runner's `execute`). A mock engine's core does that work for real around `execute`, so
    the mock sleeps the forward's share only; the simulator's clock gets the whole step."""
    import baton.perf.mock_runner as mr
    from baton.engine import EngineConfig, LLMEngine
    from baton.perf.profile import load
    from baton.sampling.params import SamplingParams

    prof = load(PROFILE)
    slept, charged = [], []
    monkeypatch.setattr(mr.time, "sleep", slept.append)
    for on_step in (None, charged.append):
        runner = mr.MockRunner(prof, 64, on_step=on_step)
        engine = LLMEngine(EngineConfig(engine_type="normal", block_size=16, num_threads=1),
                           runner=runner)
        engine.add_request("r", list(range(3, 40)), SamplingParams(max_tokens=3, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
    assert len(slept) == len(charged) == 3  # a prefill step, two decode steps
    own_s = (prof.step_overhead_ms + prof.sample_row_ms) / 1e3  # one sampled row a step
    # The forward's share, less what the mock's own work in the call took (microseconds here:
    # no KV pool); never the engine's share, which its core spends for real.
    assert all(0 < s <= c - own_s for s, c in zip(slept, charged, strict=True)), (slept, charged)
    assert sum(charged) == pytest.approx(runner.busy_s)


@pytest.mark.slow
def test_a_mock_kv_pull_takes_the_profiles_transfer_time(tmp_path):
    """A mock completion engine's pull lands no sooner than the profile's transfer time (its
    tiny pool moves in far less): a profile of 0.4 s a pull puts that gap between the prompt
    engine's first token and the completion engine's second, as the simulator predicts, and
    pulls that start together land one after another."""
    import asyncio
    import json

    import httpx

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import serve_bench as sb

    from baton.workload.synthetic import RequestSpec

    slow = json.loads(Path(PROFILE).read_text())
    slow["transfer"]["latency_ms"] = 400.0
    profile = tmp_path / "slow_pull.json"
    profile.write_text(json.dumps(slow))
    up = _start(["--prompt-engines", "1", "--completion-engines", "1"], str(profile))
    try:
        cfg = sb.BenchConfig(base_url=up.base_url, endpoint="completions", progress=False)

        async def ask(n: int):
            specs = [RequestSpec(i, "short", " ".join(WORDS[i:40 + i]), 40, 3) for i in range(n)]
            async with httpx.AsyncClient(base_url=cfg.base_url, timeout=30) as client:
                model = (await client.get("/v1/models")).json()["data"][0]["id"]
                return await asyncio.gather(*(sb.send_request(client, cfg, spec, model, True,
                                                              time.perf_counter())
                                              for spec in specs))

        (res,) = asyncio.run(ask(1))
        assert res.ok and res.output_tokens == 3, (res.error, up.tail(20))
        # The pull (0.4 s) between tokens 1 and 2, less the few ms the first token takes to
        # reach this client after the hand-off has left for the completion engine (0.396 s
        # was seen once in CI).
        assert res.itl_s[0] > 0.35, res.itl_s
        assert res.itl_s[1] < 0.2, res.itl_s  # then decode steps of the profile's ~16 ms
        # Two at once: their pulls land one after another (the link is the first's until its
        # 0.4 s are done), as the simulator's do; the second's first gap holds both.
        both = asyncio.run(ask(2))
        assert all(r.ok for r in both), [r.error for r in both]
        assert max(r.itl_s[0] for r in both) > 0.65, [r.itl_s for r in both]
    finally:
        up.stop()
