"""A mixed fleet on real engines, as a user starts it: `baton up --normal-engines 1
--prompt-engines 1 --completion-engines 1 --profile PROFILE.json` (real processes, the real
model, the embedded Redis, the router choosing each request's path from the test profile:
router/path.py). A short prompt at an idle fleet stays co-located; a long prompt that arrives
while the normal engine is decoding goes disaggregated (its prefill would stall that stream);
the same long prompt at an idle fleet is co-located, and greedy output is the same token for
token on both paths. Every pool is whole afterwards."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from baton.ops.ports import free_port
from baton.service.client import probe_engine
from tests.cluster import KEYS, is_whole, wait_for
from tests.router.test_path_choice import _path_counts
from tests.services.test_launcher import _Lines, _up

pytestmark = pytest.mark.slow

PROFILE = Path(__file__).resolve().parents[1] / "data" / "profile_test.json"
MODEL = "SmolLM2-135M-Instruct"
# Small pools, one thread each, the exact mode: three engines share this machine's cores.
ENGINE_FLAGS = ["--", "--num-blocks", "160", "--max-model-len", "1024", "--max-num-seqs", "8",
                "--num-threads", "1", "--quantization", "none"]
LONG_PROMPT = "The quick brown fox jumps over the lazy dog near the river bank. " * 20


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


def _banner(proc, stderr: _Lines) -> str:
    banner, deadline = "", time.monotonic() + 240
    while "Ctrl-C stops" not in banner:
        line = proc.stdout.readline()
        assert line or proc.poll() is None, "".join(stderr.lines[-40:])
        banner += line
        assert time.monotonic() < deadline, banner
    return banner


def test_baton_up_mixed_fleet_short_colocated_long_disaggregated(model_info):
    port = free_port()
    proc = _up("--port", str(port), "--no-cpu-pinning", "--normal-engines", "1",
               "--prompt-engines", "1", "--completion-engines", "1", "--profile", str(PROFILE),
               *ENGINE_FLAGS)
    stderr = _Lines(proc.stderr)
    url = f"http://127.0.0.1:{port}"
    try:
        engines = dict(re.findall(r"^\s+((?:prompt|completion|normal)-\d+)\s+(tcp://\S+)",
                                  _banner(proc, stderr), re.MULTILINE))
        assert sorted(engines) == ["completion-0", "normal-0", "prompt-0"], engines
        assert len(model_info.tokenizer.encode(LONG_PROMPT)) > 250
        _complete(url, "The capital of France is")
        assert _path_counts(url) == {("colocated", "predicted"): 1}

        story = {"model": MODEL, "prompt": "Write a long story about a dragon.",
                 "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=url, timeout=120) as http, \
                http.stream("POST", "/v1/completions", json=story) as streaming:
            lines = streaming.iter_lines()
            while not next(lines).startswith("data: "):  # its first token: it decodes now
                pass
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
        stderr.wait_for("prompt tokens, path disaggregated (predicted: co-located", 5)

        def whole() -> bool:
            stats = [probe_engine(a, timeout_s=5.0, keys=KEYS) for a in engines.values()]
            return all(s is not None and is_whole(s) for s in stats)

        wait_for(whole, timeout_s=20, poll_s=0.2)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
