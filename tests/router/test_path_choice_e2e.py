"""A mixed fleet on real engines: one NORMAL, one PROMPT and one COMPLETION engine (real
processes, the real model, a real Redis registry) behind a router that chooses each request's
path from the test profile (router/path.py). A short prompt at an idle fleet stays co-located;
a long prompt that arrives while the normal engine is decoding goes disaggregated (its prefill
would stall that stream); the same long prompt at an idle fleet is co-located, and greedy
output is the same token for token on both paths."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from router.config import RouterConfig
from tests.cluster import EngineProcess, wait_for, wait_whole
from tests.router.conftest import serve_router
from tests.router.test_path_choice import _path_counts

pytestmark = pytest.mark.slow

PROFILE = Path(__file__).resolve().parents[1] / "data" / "profile_test.json"
MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 1024
ENGINE_ARGS = ["--num-blocks", "160", "--max-model-len", str(MAX_MODEL_LEN),
               "--max-num-seqs", "8"]
LONG_PROMPT = "The quick brown fox jumps over the lazy dog near the river bank. " * 20


@pytest.fixture(scope="module")
def mixed_fleet(redis_server, model_info, tmp_path_factory):
    logs = tmp_path_factory.mktemp("mixed")
    engines = [EngineProcess(command, f"{role}-0", logs, redis_server.url, "mixed", ENGINE_ARGS)
               for command, role in (("engine", "normal"), ("prompt-engine", "prompt"),
                                     ("completion-engine", "completion"))]
    try:
        deadline = time.monotonic() + 240
        for engine in engines:
            engine.wait_ready(deadline)
        config = RouterConfig(registry_url=redis_server.url, registry_prefix="mixed",
                              refresh_s=0.2, max_model_len=MAX_MODEL_LEN, num_prepare_workers=0,
                              profile_path=str(PROFILE))
        with serve_router(config, model_info) as url:
            wait_for(lambda: httpx.get(f"{url}/health").json()["engines"] ==
                     {"normal": 1, "prompt": 1, "completion": 1}, timeout_s=30, poll_s=0.1)
            yield url, engines
    finally:
        for engine in engines:
            engine.stop()


def _complete(url: str, prompt: str, **extra) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, **extra}
    done = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert done.status_code == 200, done.text
    return done.json()["choices"][0]["text"]


def _normal_is_idle(url: str) -> bool:
    """The router's view of the normal engine (registry record + its own requests) is 0."""
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith('baton_router_engine_load{') and 'role="normal"' in line:
            return float(line.rsplit(" ", 1)[1]) == 0
    return False


def test_short_colocated_long_disaggregated_same_greedy_output(mixed_fleet, model_info):
    url, engines = mixed_fleet
    assert len(model_info.tokenizer.encode(LONG_PROMPT)) > 250
    _complete(url, "The capital of France is")
    assert _path_counts(url) == {("colocated", "predicted"): 1}

    story = {"model": MODEL, "prompt": "Write a long story about a dragon.", "max_tokens": 400,
             "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url, timeout=120) as http, \
            http.stream("POST", "/v1/completions", json=story) as streaming:
        lines = streaming.iter_lines()
        while not next(lines).startswith("data: "):  # its first token: it decodes now
            pass
        assert _path_counts(url)[("colocated", "predicted")] == 2
        disaggregated = _complete(url, LONG_PROMPT)
        assert _path_counts(url).get(("disaggregated", "predicted")) == 1
    # The stream is gone (aborted); once the registry shows the normal engine idle, the same
    # prompt stays co-located. Its own salt: the prompt engine's cached copy must not count.
    wait_whole(engines)
    wait_for(lambda: _normal_is_idle(url), timeout_s=15, poll_s=0.1)
    colocated = _complete(url, LONG_PROMPT, cache_salt="second")
    assert _path_counts(url) == {("colocated", "predicted"): 3, ("disaggregated", "predicted"): 1}
    assert colocated == disaggregated
    wait_whole(engines)
