"""Migration in the router, over real HTTP and ZMQ against scripted engines (no model): an
engine failing (error delta) or hanging (token timeout) mid-stream, the request re-sent with
the tokens so far and continued on a live engine, a stop string across the seam; the limit;
the metrics. The real engines' exactness is tests/router/test_migration_e2e.py."""

from __future__ import annotations

import httpx
import pytest

from tests.router.conftest import serve_router
from tests.router.test_routing_scripted import MODEL, TEXT, _config, _sse, _wait_for

MAX_TOKENS = 10


@pytest.fixture
def tokens(model_info) -> list[int]:
    return model_info.tokenizer.encode(TEXT)


def _stream(url: str, max_tokens: int = MAX_TOKENS, **extra) -> list[dict]:
    body = {"model": MODEL, "prompt": "Count:", "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, **extra}
    with httpx.Client(base_url=url, timeout=30) as http, \
            http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        return _sse(response)


def _text(events: list[dict]) -> str:
    return "".join(e["choices"][0]["text"] for e in events if e.get("choices"))


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_completion_engine_failing_mid_stream_is_migrated(engines, tokens, model_info):
    prompt = engines("prompt", tokens, name="p0")
    failing = engines("completion", tokens, name="c0", fail_after=3)
    live = engines("completion", tokens, name="c1")
    with serve_router(_config(prompt, failing, live), model_info) as url:
        events = _stream(url)
        assert _text(events) == model_info.tokenizer.decode(tokens[:MAX_TOKENS])
        assert events[-1]["usage"]["completion_tokens"] == MAX_TOKENS
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        # The first token came from p0, three more from c0: four go to the re-prefill.
        again = prompt.generates[1]
        assert again.output_token_ids == tokens[:4] and again.req_id.endswith("~m1")
        assert live.generates[0].output_token_ids == tokens[:4]
        assert live.generates[0].first_token_id == tokens[4]
        assert _metric(url, 'baton_router_migrations_total{cause="error",role="completion"}') == 1


def test_colocated_engine_failing_mid_stream_is_migrated(engines, tokens, model_info):
    failing = engines("normal", tokens, name="n0", fail_after=2)
    live = engines("normal", tokens, name="n1")
    with serve_router(_config(failing, live), model_info) as url:
        assert _text(_stream(url)) == model_info.tokenizer.decode(tokens[:MAX_TOKENS])
        assert live.generates[0].output_token_ids == tokens[:2]


def test_a_request_with_n_choices_migrates_choice_by_choice(engines, tokens, model_info):
    """n=2: each open choice goes on as a request of its own (n=1, its sample_index, its
    tokens so far, wire id REQ~cI~mN) and both streams come out whole."""
    failing = engines("normal", tokens, name="n0", fail_after=2)
    live = engines("normal", tokens, name="n1")
    with serve_router(_config(failing, live), model_info) as url:
        events = _stream(url, n=2)
        texts = ["".join(e["choices"][0]["text"] for e in events
                         if e.get("choices") and e["choices"][0]["index"] == i) for i in (0, 1)]
        assert texts == [model_info.tokenizer.decode(tokens[:MAX_TOKENS])] * 2
        assert events[-1]["usage"]["completion_tokens"] == 2 * MAX_TOKENS
        moved = sorted(live.generates, key=lambda g: g.req_id)
        assert [g.req_id.rsplit("~", 2)[1:] for g in moved] == [["c0", "m1"], ["c1", "m1"]]
        assert [(g.sampling.n, g.sampling.sample_index) for g in moved] == [(1, 0), (1, 1)]
        assert all(g.output_token_ids == tokens[:2] for g in moved)
        assert _metric(url, "baton_router_migrations_total") == 1


@pytest.mark.parametrize("limit", [0, 2])
def test_the_migration_limit_ends_the_stream_with_a_clear_error(engines, tokens, model_info,
                                                                 limit):
    prompt = engines("prompt", tokens, name="p0")
    failing = [engines("completion", tokens, name=f"c{i}", fail_after=1) for i in range(2)]
    config = _config(prompt, *failing, migration_limit=limit)
    with serve_router(config, model_info) as url:
        events = _stream(url)
        # Each pass yields the prompt engine's token and one from a completion engine.
        assert _text(events) == model_info.tokenizer.decode(tokens[:2 * (limit + 1)])
        error = events[-1]["error"]
        assert f"migration {limit} of at most {limit}" in error["message"], error
        assert len(prompt.generates) == limit + 1
        if limit:
            assert _metric(url, "baton_router_migrations_total") == limit
        body = {"model": MODEL, "prompt": "Count:", "max_tokens": MAX_TOKENS, "temperature": 0}
        whole = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert whole.status_code == 502 and "migration" in whole.json()["error"]["message"]


def test_a_migration_that_needs_one_more_token_ends_at_the_prompt_engine(engines, tokens,
                                                                         model_info):
    """Only max_tokens' last token is left: the re-prefill's first token finishes it."""
    prompt = engines("prompt", tokens, name="p0")
    failing = engines("completion", tokens, name="c0", fail_after=3)
    live = engines("completion", tokens, name="c1")
    with serve_router(_config(prompt, failing, live), model_info) as url:
        events = _stream(url, max_tokens=5)
        assert _text(events) == model_info.tokenizer.decode(tokens[:5])
        assert events[-1]["usage"]["completion_tokens"] == 5
        assert not live.generates


def test_a_hung_completion_engine_is_migrated_at_the_token_timeout(engines, tokens, model_info):
    prompt = engines("prompt", tokens, name="p0")
    hung = engines("completion", tokens, name="c0", stall_after=3)
    live = engines("completion", tokens, name="c1")
    with serve_router(_config(prompt, hung, live, token_timeout_s=1.0), model_info) as url:
        assert _text(_stream(url)) == model_info.tokenizer.decode(tokens[:MAX_TOKENS])
        assert _metric(url, 'baton_router_migrations_total{cause="timeout",role="completion"}') == 1
        _wait_for(lambda: len(hung.aborts) == 1)  # the hung pass is aborted there


def test_a_stop_string_across_the_migration_is_found(engines, tokens, model_info):
    """The text before the failure and after it are one stream: a stop string made of the
    last token before the failure and the first after it stops the request there."""
    prompt = engines("prompt", tokens, name="p0")
    failing = engines("completion", tokens, name="c0", fail_after=3)
    live = engines("completion", tokens, name="c1")
    decode = model_info.tokenizer.decode
    stop = decode(tokens[3:5])  # output 4 came from c0, output 5 is the re-prefill's
    with serve_router(_config(prompt, failing, live), model_info) as url:
        events = _stream(url, stop=[stop])
        assert _text(events) == decode(tokens[:3])
        assert events[-2]["choices"][0]["finish_reason"] == "stop"
        assert events[-1]["usage"]["completion_tokens"] == 5

