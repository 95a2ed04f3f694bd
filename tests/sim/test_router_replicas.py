"""Router replicas side by side: two routers, no state shared between them, each fed by the
same registry (Redis) and the same engines' KV events, over mock engines (`baton up --mock`
and a second `baton router` on its registry). Both serve, both see every engine, and
cache-aware routing on either sends a prefix the other one routed to the engine holding it."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from baton.ops.ports import free_port
from baton.workload.words import WORDS
from tests.sim.test_mock_engines import _start

NUM_ENGINES = 2


def _get(url: str, timeout_s: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return resp.read()


def _metric(base: str, name: str) -> dict[tuple, float]:
    """One metric family of a router's /metrics: label values -> value."""
    out: dict[tuple, float] = {}
    for family in text_string_to_metric_families(_get(f"{base}/metrics").decode()):
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def _wait(what: str, check, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _sees_every_engine(base: str) -> bool:
    import json

    try:
        return json.loads(_get(f"{base}/health"))["engines"].get("normal") == NUM_ENGINES
    except OSError:  # not up yet, or 503 before its first registry read
        return False


def _complete(base: str, prompt: str):
    from openai import OpenAI

    client = OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=30)
    resp = client.completions.create(model=client.models.list().data[0].id, prompt=prompt,
                                     max_tokens=4, temperature=0)
    assert resp.choices[0].finish_reason == "length" and resp.choices[0].text
    return resp.usage


def _indexed_keys(base: str) -> float:
    return sum(_metric(base, "baton_router_kv_index_keys").values())


def _cached_routings(base: str) -> float:
    return sum(v for labels, v in _metric(base, "baton_router_routing_decisions_total").items()
               if ("outcome", "cached") in labels)


@pytest.mark.slow  # multi-process deployments, as tests/sim/test_mock_engines.py
def test_two_routers_on_one_registry_serve_and_route_to_the_cache(redis_server, redis_url):
    up = _start(["--redis-url", redis_url, "--redis-password-file",
                 redis_server.password_file, "--normal-engines", str(NUM_ENGINES)])
    port_b = free_port()
    second = subprocess.Popen(
        [sys.executable, "-m", "baton_cli", "router", "--port", str(port_b), "--redis-url",
         redis_url, "--redis-password-file", redis_server.password_file],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    a, b = up.base_url, f"http://127.0.0.1:{port_b}"
    try:
        for base in (a, b):
            _wait(f"{base} to see {NUM_ENGINES} engines", lambda base=base:
                  second.poll() is None and _sees_every_engine(base))
        # A prefix each way: routed cold by one router, then again by the other, which only
        # knows where the blocks are from the engines' KV events.
        for i, (first, then) in enumerate(((a, b), (b, a))):
            prompt = " ".join(WORDS[(i * 31 + j * 7) % len(WORDS)] for j in range(96))
            before_keys, before_cached = _indexed_keys(then), _cached_routings(then)
            cold = _complete(first, prompt)
            _wait("the other router's KV index to learn the blocks",
                  lambda then=then, before=before_keys: _indexed_keys(then) > before)
            warm = _complete(then, prompt)
            assert cold.prompt_tokens == warm.prompt_tokens
            assert warm.prompt_tokens_details.cached_tokens >= 16 * (warm.prompt_tokens // 16
                                                                     - 1), (i, warm)
            assert _cached_routings(then) == before_cached + 1
        for base in (a, b):  # both served, and still see every engine
            _wait(f"{base} to see {NUM_ENGINES} engines", lambda base=base:
                  _sees_every_engine(base), timeout_s=5.0)
    finally:
        second.terminate()
        try:
            second.wait(timeout=30)
        except subprocess.TimeoutExpired:
            second.kill()
            second.wait(timeout=10)
        up.stop()
