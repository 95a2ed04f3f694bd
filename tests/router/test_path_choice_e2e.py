"""A mixed fleet on real engines: a normal, a prompt and two completion engines (real
processes, the real model, a real Redis registry, the router over HTTP choosing each request's
path from the test profile: router/path.py). One fleet serves the module's tests in order
(starting it is most of their time). `baton up --normal-engines 1 --prompt-engines 1
--completion-engines 1 --profile PROFILE.json`, as a user starts a mixed fleet, runs first, on
mock engines (seconds, not a model load per engine): all three kinds start and the router it
starts chooses paths from the profile.

Path choice: a short prompt at an idle fleet stays co-located; a long prompt that arrives while
the normal engine is decoding goes disaggregated (its prefill would stall that stream); the
same long prompt at an idle fleet is co-located, and greedy output is the same token for token
on both paths.

S41, an engine changes its role without a restart: a completion engine told to become a prompt
engine while it decodes a stream finishes that stream (no failure, no migration: its text is
exact), switches over the same weights and KV pool, re-registers as a prompt engine, and then
prefills for the other completion engine exactly as the original prompt engine does. Asked back
while a lease of its own is still out, it waits for the lease, refuses a second change
meanwhile, and becomes a completion engine again. Every pool is whole after each test."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass

import httpx
import pytest

from baton.protocol import AbortRequest, SamplingOptions
from baton.service.client import probe_engine
from router.config import RouterConfig
from tests.cluster import KEYS, EngineProcess, is_whole, start_all, wait_for
from tests.router.conftest import serve_router
from tests.router.test_path_choice import PROFILE, _path_counts
from tests.sim.test_mock_engines import _start

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PREFIX = "mixed"
# Small pools (tests/cluster.py: one thread each, the exact mode): four engines share this
# machine's cores; a short registry TTL so that a role change shows in the router at once.
ENGINE_ARGS = ["--num-blocks", "160", "--max-model-len", "1024", "--max-num-seqs", "8",
               "--registry-ttl", "2"]
LONG_PROMPT = "The quick brown fox jumps over the lazy dog near the river bank. " * 20
STORY = {"model": MODEL, "prompt": "Write a long story about a dragon.", "max_tokens": 400,
         "temperature": 0, "ignore_eos": True, "stream": True}
GREEDY = SamplingOptions(max_tokens=8, temperature=0.0, ignore_eos=True)


@dataclass
class Fleet:
    url: str
    engines: dict[str, EngineProcess]
    switched: EngineProcess | None = None  # the engine the first S41 test made a prompt engine

    def wait_whole(self) -> None:
        def whole() -> bool:
            stats = [probe_engine(e.address, timeout_s=5.0, keys=KEYS)
                     for e in self.engines.values()]
            return all(s is not None and is_whole(s) for s in stats)
        wait_for(whole, timeout_s=20, poll_s=0.1)


@pytest.fixture(scope="module")
def fleet(redis_server, model_info, tmp_path_factory):
    logs = tmp_path_factory.mktemp("mixed")
    url = redis_server.url
    kinds = [("engine", "normal-0"), ("prompt-engine", "prompt-0"),
             ("completion-engine", "completion-0"), ("completion-engine", "completion-1")]
    engines = {name: EngineProcess(command, name, logs, url, PREFIX, ENGINE_ARGS)
               for command, name in kinds}
    try:
        start_all(list(engines.values()))
        config = RouterConfig(registry_url=url, registry_prefix=PREFIX, refresh_s=0.2,
                              max_model_len=1024, num_prepare_workers=0,
                              profile_path=str(PROFILE))
        with serve_router(config, model_info) as router_url:
            _wait_roles(router_url, {"normal": 1, "prompt": 1, "completion": 2})
            yield Fleet(router_url, engines)
    finally:
        for engine in engines.values():
            engine.kill()


def _complete(url: str, prompt: str, **extra) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, **extra}
    done = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert done.status_code == 200, done.text
    return done.json()["choices"][0]["text"]


def _normal_is_idle(url: str) -> bool:
    """The router's view of the normal engine (registry record + its own requests) is 0."""
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith("baton_router_engine_load{") and 'role="normal"' in line:
            return float(line.rsplit(" ", 1)[1]) == 0
    return False


def _first_token(lines) -> None:
    """Read a stream until its first token: the request decodes now. (The caller keeps
    `lines`: a line iterator dropped closes the stream, and the router aborts the request.)"""
    while not next(lines).startswith("data: "):
        pass


def _wait_roles(url: str, roles: dict[str, int]) -> None:
    def ready() -> bool:
        health = httpx.get(f"{url}/health", timeout=5)
        return health.status_code == 200 and all(
            health.json()["engines"].get(role) == n for role, n in roles.items())
    wait_for(ready, timeout_s=30, poll_s=0.1)


def _metric(url: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(f"{url}/metrics").text
               .splitlines() if line.startswith(name))


def _disaggregated(prompt: EngineProcess, completion: EngineProcess,
                   ids: list[int]) -> list[int]:
    req_id = uuid.uuid4().hex
    with prompt.client() as c:
        first = c.generate(ids, GREEDY, req_id=req_id, timeout_s=120)
    assert first.kv_handle and len(first.token_ids) == 1, first
    with completion.client() as c:
        rest = c.generate(ids, GREEDY, req_id=req_id, timeout_s=120, kv_handle=first.kv_handle,
                          first_token_id=first.token_ids[0])
    assert rest.finish_reason == "length", rest.error
    return first.token_ids + rest.token_ids


def _role_done(engine: EngineProcess, role: str) -> None:
    def done() -> bool:
        stats = engine.stats()
        return stats.role == role and not stats.draining
    wait_for(done, timeout_s=60, poll_s=0.1)


def test_baton_up_starts_a_mixed_fleet_whose_router_chooses_paths():
    up = _start(["--normal-engines", "1", "--prompt-engines", "1", "--completion-engines", "1",
                 "--profile", str(PROFILE)])
    try:
        assert sorted(up.engines) == ["completion-0", "normal-0", "prompt-0"], up.banner
        _complete(up.base_url, "The capital of France is")
        assert _path_counts(up.base_url) == {("colocated", "predicted"): 1}  # the profile's
    finally:
        up.stop()


def test_mixed_fleet_short_colocated_long_disaggregated(fleet, model_info, caplog):
    caplog.set_level(logging.INFO, logger="router.dispatch")
    url = fleet.url
    assert len(model_info.tokenizer.encode(LONG_PROMPT)) > 250
    _complete(url, "The capital of France is")
    assert _path_counts(url) == {("colocated", "predicted"): 1}

    with httpx.Client(base_url=url, timeout=120) as http, \
            http.stream("POST", "/v1/completions", json=STORY) as streaming:
        lines = streaming.iter_lines()
        _first_token(lines)
        assert _path_counts(url)[("colocated", "predicted")] == 2
        disaggregated = _complete(url, LONG_PROMPT)
        assert _path_counts(url).get(("disaggregated", "predicted")) == 1
    # The stream is gone (aborted); once the registry shows the normal engine idle, the
    # same prompt stays co-located. Its own salt: the prompt engine's cached copy must not
    # count.
    wait_for(lambda: _normal_is_idle(url), timeout_s=20, poll_s=0.1)
    colocated = _complete(url, LONG_PROMPT, cache_salt="second")
    assert _path_counts(url) == {("colocated", "predicted"): 3,
                                 ("disaggregated", "predicted"): 1}
    assert colocated == disaggregated
    assert "prompt tokens, path disaggregated (predicted: co-located" in caplog.text
    fleet.wait_whole()


def test_s41_completion_engine_becomes_a_prompt_engine_under_load(fleet):
    url, engines = fleet.url, fleet.engines
    prompt = engines["prompt-0"]
    completions = [engines["completion-0"], engines["completion-1"]]
    result: dict[str, str] = {}
    # A long prompt while the normal engine decodes goes disaggregated (the test before): 48
    # tokens decoding on a completion engine, through the router. Once it is routed the
    # normal engine's stream ends (nothing else competes for the cores).
    disaggregated = ("disaggregated", "predicted")
    with httpx.Client(base_url=url, timeout=120) as http, \
            http.stream("POST", "/v1/completions", json=STORY) as story:
        lines = story.iter_lines()
        _first_token(lines)
        num_before = _path_counts(url).get(disaggregated, 0)
        streaming = threading.Thread(target=lambda: result.update(text=_complete(
            url, LONG_PROMPT, max_tokens=48, ignore_eos=True, cache_salt="s41")))
        streaming.start()
        wait_for(lambda: _path_counts(url).get(disaggregated, 0) == num_before + 1,
                 timeout_s=30, poll_s=0.02)
    victim = None
    for _ in range(1500):
        busy = [e for e in completions if e.stats().num_running]
        if busy:
            victim = busy[0]
            break
        time.sleep(0.02)
    assert victim is not None, "no completion engine runs the request"
    with victim.client() as c:
        reply = c.change_role("prompt")
    assert reply.ok and "draining 1 requests" in reply.message, reply
    assert victim.stats().draining
    streaming.join(120)
    assert result.get("text")  # finished where it ran: not failed, not migrated (its text is
    assert _metric(url, "baton_router_migrations_total") == 0  # checked exact below)
    _role_done(victim, "prompt")
    _wait_roles(url, {"prompt": 2, "completion": 1})
    other = next(e for e in completions if e is not victim)
    for seed in range(2):  # the new prompt engine prefills exactly as the original one
        ids = [300 + (i * 7919 + seed * 104729) % 40000 for i in range(40 + 17 * seed)]
        assert _disaggregated(victim, other, ids) == _disaggregated(prompt, other, ids)
    # the router serves on through the new fleet, and the drained stream was exact: greedy,
    # the same text as the same request served now (at an idle fleet: co-located)
    wait_for(lambda: _normal_is_idle(url), timeout_s=20, poll_s=0.1)
    assert _complete(url, LONG_PROMPT, max_tokens=48, ignore_eos=True,
                     cache_salt="again") == result["text"]
    fleet.wait_whole()
    fleet.switched = victim


def test_s41_a_second_change_or_a_bad_role_is_refused(fleet):
    victim = fleet.switched
    if victim is None:
        pytest.skip("needs the engine the test before switched")
    ids = [301 + i for i in range(50)]
    req_id = uuid.uuid4().hex
    with victim.client() as c:  # a prefill whose KV lease nobody pulls: the engine is not empty
        first = c.generate(ids, GREEDY, req_id=req_id, timeout_s=120)
        assert first.kv_handle
        reply = c.change_role("completion")
        assert reply.ok and "changing to completion" in reply.message, reply
        again = c.change_role("normal")
        assert not again.ok and "a change to completion is in progress" in again.message
        assert not c.change_role("decoder").ok
        time.sleep(0.5)
        stats = c.stats()
        assert stats.role == "prompt" and stats.draining  # the lease holds it
        c.send(AbortRequest(req_id))  # the lease ends: now it may switch
    _role_done(victim, "completion")
    _wait_roles(fleet.url, {"prompt": 1, "completion": 2})
    with victim.client() as c:
        assert c.change_role("completion").message == "already completion"
    fleet.wait_whole()
