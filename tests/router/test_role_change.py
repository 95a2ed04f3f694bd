"""S41: an engine changes its role without a restart, with real processes: a prompt engine,
two completion engines, a real Redis registry and the router over HTTP.

A completion engine told to become a prompt engine while it decodes a stream finishes that
stream (no failure, no migration), switches over the same weights and KV pool, re-registers as
a prompt engine, and then prefills for the other completion engine exactly as the original
prompt engine does. Asked back while a lease of its own is still out, it waits for the lease,
refuses a second change meanwhile, and becomes a completion engine again. Pools whole after.
"""

from __future__ import annotations

import threading
import time
import uuid

import httpx
import pytest

from baton.protocol import AbortRequest, SamplingOptions
from router.config import RouterConfig
from tests.cluster import EngineProcess, start_all, wait_for, wait_whole
from tests.router.conftest import serve_router

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PREFIX = "role"
ENGINE_ARGS = ["--num-blocks", "96", "--max-model-len", "512", "--registry-ttl", "2"]
PROMPT = ("The old lighthouse keeper climbed the stairs every evening, and on the night of the "
          "storm he saw")
MAX_TOKENS = 48
GREEDY = SamplingOptions(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(redis_server, model_info, tmp_path_factory):
    logs = tmp_path_factory.mktemp("role")
    url = redis_server.url
    prompt = EngineProcess("prompt-engine", "prompt-0", logs, url, PREFIX, ENGINE_ARGS)
    completions = [EngineProcess("completion-engine", f"completion-{i}", logs, url, PREFIX,
                                 ENGINE_ARGS) for i in range(2)]
    engines = [prompt, *completions]
    try:
        start_all(engines)
        config = RouterConfig(registry_url=url, registry_prefix=PREFIX, refresh_s=0.2,
                              max_model_len=512, num_prepare_workers=0)
        with serve_router(config, model_info) as router_url:
            _wait_roles(router_url, {"prompt": 1, "completion": 2})
            yield {"url": router_url, "prompt": prompt, "completions": completions}
    finally:
        for engine in engines:
            engine.kill()


def _wait_roles(url: str, roles: dict[str, int], timeout_s: float = 30.0) -> None:
    def ready() -> bool:
        health = httpx.get(f"{url}/health")
        return health.status_code == 200 and all(
            health.json()["engines"].get(role) == n for role, n in roles.items())
    wait_for(ready, timeout_s=timeout_s, poll_s=0.2)


def _complete(url: str) -> str:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


def _metric(url: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(f"{url}/metrics").text
               .splitlines() if line.startswith(name))


def _disaggregated(prompt: EngineProcess, completion: EngineProcess, ids: list[int]) -> list[int]:
    req_id = uuid.uuid4().hex
    with prompt.client() as c:
        first = c.generate(ids, GREEDY, req_id=req_id, timeout_s=120)
    assert first.kv_handle and len(first.token_ids) == 1, first
    with completion.client() as c:
        rest = c.generate(ids, GREEDY, req_id=req_id, timeout_s=120, kv_handle=first.kv_handle,
                          first_token_id=first.token_ids[0])
    assert rest.finish_reason == "length", rest.error
    return first.token_ids + rest.token_ids


def _role_done(engine: EngineProcess, role: str, timeout_s: float = 60.0) -> None:
    def done() -> bool:
        stats = engine.stats()
        return stats.role == role and not stats.draining
    wait_for(done, timeout_s=timeout_s, poll_s=0.1)


def test_s41_completion_engine_becomes_a_prompt_engine_under_load(cluster):
    url, prompt, completions = cluster["url"], cluster["prompt"], cluster["completions"]
    result: dict[str, str] = {}
    streaming = threading.Thread(target=lambda: result.update(text=_complete(url)))
    streaming.start()
    victim = None
    for _ in range(600):
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
    # the same text as the same request served now
    assert _complete(url) == result["text"]
    wait_whole([prompt, *completions])
    cluster["switched"] = victim


def test_s41_a_second_change_or_a_bad_role_is_refused(cluster):
    victim = cluster.get("switched")
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
    _wait_roles(cluster["url"], {"prompt": 1, "completion": 2})
    with victim.client() as c:
        assert c.change_role("completion").message == "already completion"
    wait_whole([cluster["prompt"], *cluster["completions"]])
