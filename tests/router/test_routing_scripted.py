"""The router's own logic over real HTTP and real ZMQ, against scripted engines (no model):
SSE and JSON bodies, usage, PD hand-off, stop strings, retry, abort on disconnect."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from router.config import RouterConfig
from tests.router.conftest import serve_router
from tests.router.scripted_engine import ScriptedEngine

MODEL = "SmolLM2-135M-Instruct"
TEXT = " one two three four five six seven eight nine ten eleven twelve"


@pytest.fixture
def tokens(model_info) -> list[int]:
    return model_info.tokenizer.encode(TEXT)


@pytest.fixture
def engine_waits(monkeypatch) -> list[str]:
    """The roles of the requests that found no live engine and began to wait for one: the real
    `EnginePool.wait_pick`, observed (the routers here run in this process's threads)."""
    from router.engine_pool import EnginePool

    waits: list[str] = []
    wait_pick = EnginePool.wait_pick

    async def observed(self, role, exclude=frozenset()):
        if not self.has_live(role):
            waits.append(role)
        return await wait_pick(self, role, exclude)

    monkeypatch.setattr(EnginePool, "wait_pick", observed)
    return waits


def _is_unavailable(url: str) -> bool:
    """Past the connect grace: no engine counts as live."""
    return httpx.get(f"{url}/health", timeout=5).status_code == 503


def _config(*entries: ScriptedEngine, **overrides) -> RouterConfig:
    overrides.setdefault("num_prepare_workers", 0)  # routing is under test, not preparing
    return RouterConfig(engines=[f"{e.role}={e.address}" for e in entries], **overrides)


def _sse(response: httpx.Response) -> list[dict]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[len("data: "):]))
    return events


def _wait_for(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_normal_engine_stream_and_json(engines, tokens, model_info):
    normal = engines("normal", tokens)
    with serve_router(_config(normal), model_info) as url, httpx.Client(base_url=url) as http:
        body = {"model": MODEL, "prompt": "Count:", "max_tokens": 5, "temperature": 0}
        whole = http.post("/v1/completions", json=body).json()
        expected = model_info.tokenizer.decode(tokens[:5])
        assert whole["choices"][0]["text"] == expected
        assert whole["choices"][0]["finish_reason"] == "length"
        assert whole["usage"]["completion_tokens"] == 5
        with http.stream("POST", "/v1/completions", json={
                **body, "stream": True, "stream_options": {"include_usage": True}}) as response:
            events = _sse(response)
        assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == expected
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5
        assert normal.generates[0].sampling.temperature == 0.0
        assert normal.generates[0].sampling.stop_token_ids == [model_info.stop_token_ids[0]]


def test_pd_handoff_and_chat(engines, tokens, model_info):
    prompt = engines("prompt", tokens, name="p0")
    completion = engines("completion", tokens)
    with serve_router(_config(prompt, completion), model_info) as url, \
            httpx.Client(base_url=url) as http:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Count"}],
                "max_completion_tokens": 8}
        whole = http.post("/v1/chat/completions", json=body).json()
        expected = model_info.tokenizer.decode(tokens[:8])
        assert whole["choices"][0]["message"] == {"role": "assistant", "content": expected}
        sent = completion.generates[0]
        assert sent.kv_handle == b"handle:p0" and sent.first_logprob == -0.5
        assert sent.prompt_token_ids == prompt.generates[0].prompt_token_ids
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            events = _sse(r)
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == expected
        one = http.post("/v1/chat/completions", json={**body, "max_completion_tokens": 1}).json()
        assert one["choices"][0]["finish_reason"] == "length" and len(completion.generates) == 2
        metrics = http.get("/metrics").text
        assert "baton_router_kv_transfer_seconds_count 2.0" in metrics


def test_stop_string_cuts_and_aborts(engines, tokens, model_info):
    normal = engines("normal", tokens, delay_s=0.05)
    with serve_router(_config(normal), model_info) as url, httpx.Client(base_url=url) as http:
        result = http.post("/v1/completions", json={
            "model": MODEL, "prompt": "x", "max_tokens": 12, "stop": ["four", "zzz"]}).json()
        assert result["choices"][0]["text"] == " one two three "
        assert result["choices"][0]["finish_reason"] == "stop"
        _wait_for(lambda: normal.aborts == [normal.generates[0].req_id])
        assert not normal.running


def test_a_stop_string_inside_a_multi_token_delta_ends_where_one_token_at_a_time_would(
        engines, tokens, model_info):
    """An engine keeping speculative drafts sends several tokens a delta: the text, the usage
    count and the logprobs end at the token that completed the stop string, as when the
    tokens come one a delta."""
    body = {"model": MODEL, "prompt": "x", "max_tokens": 12, "stop": ["four"], "logprobs": 0}
    results = []
    for per_delta in (1, 5):
        normal = engines("normal", tokens, tokens_per_delta=per_delta, name=f"n{per_delta}")
        with serve_router(_config(normal), model_info) as url, httpx.Client(base_url=url) as http:
            results.append(http.post("/v1/completions", json=body).json())
    one, five = (r["choices"][0] for r in results)
    assert five["text"] == one["text"] == " one two three "
    assert five["logprobs"] == one["logprobs"]
    assert results[0]["usage"] == results[1]["usage"]
    assert results[1]["usage"]["completion_tokens"] == 4  # " one two three four"


def test_prompt_engine_failure_retries_once(engines, tokens, model_info):
    broken = engines("prompt", tokens, mode="error", name="broken")
    silent = engines("prompt", tokens, mode="silent", name="silent")
    completion = engines("completion", tokens)
    config = _config(broken, silent, completion, first_token_timeout_s=0.5)
    with serve_router(config, model_info) as url, httpx.Client(base_url=url) as http:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 4}
        response = http.post("/v1/completions", json=body)
        # One engine errors, the other times out: two tries, then a 503 that says why.
        assert response.status_code == 503, response.text
        assert "failed" in response.json()["error"]["message"]
        assert len(broken.generates) + len(silent.generates) == 2
        good = engines("prompt", tokens, name="good")
        with serve_router(_config(broken, good, completion, failure_cooldown_s=0), model_info) \
                as url2:
            for _ in range(4):
                ok = httpx.post(f"{url2}/v1/completions", json=body, timeout=10)
                assert ok.status_code == 200, ok.text
            # No cooldown: equal loads send each request to `broken` first, then to `good`.
            assert 'baton_router_engine_retries_total{role="prompt"} 4.0' in \
                httpx.get(f"{url2}/metrics").text
        assert len(good.generates) == 4


def test_killed_prompt_engine_fails_over(engines, tokens, model_info):
    first = engines("prompt", tokens, name="first")
    second = engines("prompt", tokens, name="second")
    completion = engines("completion", tokens)
    with serve_router(_config(first, second, completion), model_info) as url, \
            httpx.Client(base_url=url, timeout=10) as http:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 3}
        for _ in range(4):  # both connected and used
            assert http.post("/v1/completions", json=body).status_code == 200
        first.close()
        before = len(second.generates)
        for _ in range(4):
            assert http.post("/v1/completions", json=body).status_code == 200
        assert len(second.generates) >= before + 4


def test_client_disconnect_aborts_every_engine(engines, tokens, model_info):
    prompt = engines("prompt", tokens)
    completion = engines("completion", tokens, delay_s=0.2)
    with serve_router(_config(prompt, completion), model_info) as url:
        with httpx.Client(base_url=url) as http, http.stream("POST", "/v1/completions", json={
                "model": MODEL, "prompt": "x", "max_tokens": 12, "stream": True}) as response:
            lines = response.iter_lines()
            while not next(lines).startswith("data: "):
                pass
            _wait_for(lambda: completion.running)
        req_id = completion.generates[0].req_id
        _wait_for(lambda: req_id in completion.aborts)
        assert not completion.running
        # The prompt engine's lease was claimed (completion streamed), yet an abort is harmless.


def test_concurrent_streams_demultiplex(engines, tokens, model_info):
    normal = engines("normal", tokens, delay_s=0.01)
    with serve_router(_config(normal), model_info) as url:
        import asyncio

        async def one(client: httpx.AsyncClient, n: int) -> str:
            text = ""
            async with client.stream("POST", "/v1/completions", json={
                    "model": MODEL, "prompt": "x", "max_tokens": n, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        text += json.loads(line[6:])["choices"][0]["text"]
            return text

        async def main() -> list[str]:
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                return await asyncio.gather(*(one(client, 1 + i % 12) for i in range(32)))

        texts = asyncio.run(main())
        for i, text in enumerate(texts):
            assert text == model_info.tokenizer.decode(tokens[:1 + i % 12])


def test_client_gone_during_json_request_aborts(engines, tokens, model_info):
    normal = engines("normal", tokens, delay_s=0.2)
    with serve_router(_config(normal), model_info) as url:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
            httpx.post(f"{url}/v1/completions", timeout=0.5,
                       json={"model": MODEL, "prompt": "x", "max_tokens": 12})
        _wait_for(lambda: normal.aborts == [normal.generates[0].req_id])
        assert not normal.running


def test_unreachable_engine_is_503_not_a_hang(model_info):
    from baton.ops.ports import free_port

    config = RouterConfig(engines=[f"normal=tcp://127.0.0.1:{free_port()}"], connect_grace_s=0.3,
                          engine_wait_timeout_s=0.5, num_prepare_workers=0)
    with serve_router(config, model_info) as url:
        _wait_for(lambda: _is_unavailable(url))
        response = httpx.post(f"{url}/v1/completions", timeout=10,
                              json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert response.status_code == 503
        assert "no live normal engine within 0.5 s: none of the 1 registered normal engines is " \
            "live" in response.text


def test_request_waits_for_an_engine_coming_back(engines, tokens, model_info, engine_waits):
    """No live engine when the request arrives: it waits (engine_wait_timeout_s) for the one
    being restarted instead of an instant 503."""
    from concurrent.futures import ThreadPoolExecutor

    from baton.ops.ports import free_port

    port = free_port()
    config = RouterConfig(engines=[f"normal=tcp://127.0.0.1:{port}"], connect_grace_s=0.3,
                          engine_wait_timeout_s=30, num_prepare_workers=0)
    with serve_router(config, model_info) as url, ThreadPoolExecutor(1) as pool:
        _wait_for(lambda: _is_unavailable(url))
        body = {"model": MODEL, "prompt": "x", "max_tokens": 3}
        reply = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=60)
        _wait_for(lambda: engine_waits == ["normal"])  # it found none live and waits
        assert not reply.done()
        engines("normal", tokens, port=port)  # an instant 503 would have been answered by now
        response = reply.result(60)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == model_info.tokenizer.decode(tokens[:3])


def test_prompt_engine_dying_mid_prefill_is_retried_once_it_is_back(engines, tokens, model_info,
                                                                   engine_waits):
    """The only prompt engine dies holding the request; its restart (same address) serves it."""
    from concurrent.futures import ThreadPoolExecutor

    dying = engines("prompt", tokens, mode="silent", name="dying")
    completion = engines("completion", tokens)
    port = int(dying.address.rsplit(":", 1)[1])
    with serve_router(_config(dying, completion), model_info) as url, \
            ThreadPoolExecutor(1) as pool:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 4, "stream": False}
        reply = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=60)
        _wait_for(lambda: dying.generates)
        dying.close()  # the connection drops mid-prefill
        _wait_for(lambda: engine_waits == ["prompt"])  # the retry waits for a prompt engine
        assert not reply.done()
        back = engines("prompt", tokens, name="back", port=port)
        response = reply.result(60)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == model_info.tokenizer.decode(tokens[:4])
        assert [g.req_id for g in back.generates] == [dying.generates[0].req_id]
        assert 'baton_router_engine_retries_total{role="prompt"} 1.0' in \
            httpx.get(f"{url}/metrics").text


def test_client_gone_before_first_token_aborts(engines, tokens, model_info):
    silent = engines("normal", tokens, mode="silent")
    with serve_router(_config(silent), model_info) as url:
        for stream in (False, True):
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{url}/v1/completions", timeout=0.5, json={
                    "model": MODEL, "prompt": "x", "max_tokens": 4, "stream": stream})
        _wait_for(lambda: len(silent.aborts) == 2)
        assert silent.aborts == [g.req_id for g in silent.generates]
