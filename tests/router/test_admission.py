"""SLO-aware admission (router/admission.py, `--admission-ttft-ms`): a request whose predicted
TTFT under the router's current load is past factor x its SLO gets 429 with Retry-After at
once, counted; the same request is admitted when the load is gone. The router's dispatch runs
over real ZMQ against a scripted engine that never answers (its queue only grows), with the
test profile's costs (tests/data/profile_test.json)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import httpx
import pytest

from baton.perf.profile import load as load_profile
from router.admission import Overloaded, SloAdmission
from router.config import RouterConfig
from router.path import COLOCATED, EngineView, PathRequest, PredictedPath
from tests.cluster import wait_for
from tests.router.conftest import serve_router

PROFILE = Path(__file__).resolve().parents[1] / "data" / "profile_test.json"
MODEL = "SmolLM2-135M-Instruct"


def test_admission_refuses_past_the_factor_with_retry_after():
    admission = SloAdmission(ttft_slo_ms=500, factor=2.0)
    admission.check(1000.0, COLOCATED)  # at the limit: admitted
    with pytest.raises(Overloaded) as refused:
        admission.check(2600.0, COLOCATED)
    assert refused.value.status == 429 and refused.value.code == "slo_overload"
    assert refused.value.headers == {"Retry-After": "3"}  # 2100 ms over the SLO, rounded up
    assert "2600 ms on the colocated path" in refused.value.message
    for bad in (dict(ttft_slo_ms=0), dict(ttft_slo_ms=-5), dict(ttft_slo_ms=float("inf")),
                dict(ttft_slo_ms=100, factor=0.5), dict(ttft_slo_ms=100, factor=float("nan"))):
        with pytest.raises(ValueError, match="admission"):
            SloAdmission(**bad)


def test_admission_needs_a_profile_in_the_router_and_baton_up():
    from baton_cli.launcher import LaunchConfig, Launcher

    with pytest.raises(ValueError, match="admission_ttft_ms needs profile_path"):
        RouterConfig(insecure=True, admission_ttft_ms=300)
    with pytest.raises(ValueError, match="admission factor must be >= 1"):
        RouterConfig(insecure=True, profile_path=str(PROFILE), admission_ttft_ms=300,
                     admission_factor=0.9)
    with pytest.raises(ValueError, match="--admission-ttft-ms .* needs --profile"):
        LaunchConfig(num_normal_engines=1, admission_ttft_ms=300)
    argv = Launcher(LaunchConfig(num_normal_engines=1, profile=str(PROFILE),
                                 admission_ttft_ms=300, admission_factor=1.5)).router_argv()
    assert argv[argv.index("--admission-ttft-ms") + 1] == "300"
    assert argv[argv.index("--admission-factor") + 1] == "1.5"
    assert "--admission-ttft-ms" not in Launcher(
        LaunchConfig(num_normal_engines=1, profile=str(PROFILE))).router_argv()


def _rejections(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith('baton_router_slo_rejections_total{path="colocated"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _send_and_stay(url: str, body: dict) -> socket.socket:
    """A client that sends `body` and waits for its answer until the test closes the socket
    (it leaves when the test says, not after a timeout)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: "
                 b"application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (host.encode(), len(data), data))
    return sock


def _outcomes(url: str) -> list[list]:
    """The router's outcomes for the planner, less their end times: [TTFT s, TPOT s, ok]."""
    raw = httpx.get(f"{url}/planner/observations", params={"window_s": 600}, timeout=5).json()
    return [row[1:] for row in raw["outcomes"]]


def test_a_request_past_its_slo_under_load_gets_429_and_is_admitted_once_the_load_is_gone(
        engines, model_info):
    long_prompt = " six" * 1000
    num_tokens = len(model_info.tokenizer.encode(long_prompt))
    # The limit between the long prompt's predicted TTFT at an idle engine and behind one more
    # of its kind: the first is admitted, the second refused.
    predicted = PredictedPath(load_profile(PROFILE))
    alone = predicted.ttft_ms(PathRequest(num_tokens), EngineView(), COLOCATED)
    queued = predicted.ttft_ms(PathRequest(num_tokens), EngineView(
        num_queued_prefills=1, num_queued_tokens=num_tokens), COLOCATED)
    assert queued > 1.8 * alone
    slo_ms, factor = (alone + queued) / 2 / 1.5, 1.5

    normal = engines("normal", model_info.tokenizer.encode(" one two"), mode="silent")
    config = RouterConfig(engines=[f"normal={normal.address}"], num_prepare_workers=0,
                          profile_path=str(PROFILE), admission_ttft_ms=slo_ms,
                          admission_factor=factor)
    body = {"model": MODEL, "prompt": long_prompt, "max_tokens": 4, "temperature": 0}
    with serve_router(config, model_info) as url:
        first = _send_and_stay(url, body)  # admitted; the engine never answers
        wait_for(lambda: len(normal.generates) == 1, timeout_s=10)

        refused = httpx.post(f"{url}/v1/completions", json=body, timeout=10)
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert error["code"] == "slo_overload" and error["type"] == "rate_limit_error"
        assert f"{queued:.0f} ms" in error["message"], (error, queued)
        assert refused.headers["Retry-After"] == str(max(1, -(-int(queued - slo_ms) // 1000)))
        assert _rejections(url) == 1.0
        assert len(normal.generates) == 1  # the refused request never reached the engine
        # what the planner reads (planner/signals.py): the refusal ended outside its SLO
        assert _outcomes(url) == [[0.0, 0.0, 0]]

        first.close()  # the client leaves: the router aborts its request there
        wait_for(lambda: len(normal.aborts) == 1, timeout_s=10)
        second = _send_and_stay(url, body)  # the queue is empty again: admitted
        wait_for(lambda: len(normal.generates) == 2, timeout_s=10)
        second.close()
        wait_for(lambda: len(normal.aborts) == 2, timeout_s=10)
        assert _rejections(url) == 1.0
        assert _outcomes(url) == [[0.0, 0.0, 0]]  # the clients that left are not outcomes
