"""Bad input is refused before any engine is involved: status, OpenAI error body, a message
naming the problem. No engine runs here, so a valid request ends in 503."""

from __future__ import annotations

import logging

import pytest

from router import openai_protocol
from router.config import RouterConfig

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "Hello"}]
_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def _error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.fixture
def client(make_client):
    return make_client(max_model_len=64)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("raw, words", [
    (b"{not json", "not valid JSON"),
    (b"", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b'{"prompt": "hi", "messages": []}', "'model'"),
])
def test_malformed_bodies(client, path, raw, words):
    error = _error(client.post(path, content=raw), 400)
    assert words in error["message"]


@pytest.mark.parametrize("body, param, words", [
    ({"model": MODEL}, "prompt", "Missing required field 'prompt'"),
    ({"model": MODEL, "prompt": ""}, "prompt", "must not be empty"),
    ({"model": MODEL, "prompt": []}, "prompt", "must not be empty"),
    ({"model": MODEL, "prompt": 5}, "prompt", "Invalid value for 'prompt'"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": "5"}, "max_tokens", "valid integer"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 2.5}, "max_tokens", "valid integer"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens", "at least 1, got 0"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": -3}, "max_tokens", "got -3"),
    ({"model": MODEL, "prompt": "hi", "temperature": -0.5}, "temperature", ">= 0, got -0.5"),
    ({"model": MODEL, "prompt": "hi", "temperature": "hot"}, "temperature", "valid number"),
    ({"model": MODEL, "prompt": "hi", "top_p": 0}, "top_p", "(0, 1]"),
    ({"model": MODEL, "prompt": "hi", "top_k": -2}, "top_k", "got -2"),
    ({"model": MODEL, "prompt": "hi", "stream": "yes"}, "stream", "valid boolean"),
    ({"model": MODEL, "prompt": "hi", "stop": 7}, "stop", "Invalid value for 'stop'"),
    ({"model": MODEL, "prompt": "hi", "n": 17}, "n", "got 17"),
    ({"model": MODEL, "prompt": "hi", "n": 0}, "n", "got 0"),
    ({"model": MODEL, "prompt": "hi", "logprobs": 21}, "logprobs", "[0, 20], got 21"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens", "at least 1"),
    ({"model": MODEL, "prompt": "hi", "suffix": "x"}, "suffix", "not supported"),
    ({"model": MODEL, "prompt": "hi", "best_of": 2}, "best_of", "not supported"),
    ({"model": MODEL, "prompt": "hi", "response_format": {"type": "xml"}},
     "response_format", "must be text, json_object or json_schema"),
    ({"model": MODEL, "prompt": "hi", "guided_regex": "a(b"}, "guided_regex", "unclosed group"),
    ({"model": MODEL, "prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["b"]}},
     "structured_outputs.choice", "one structured output at a time"),
    ({"model": MODEL, "prompt": "hi", "structured_outputs": {"json": {"type": "bogus"}}},
     "structured_outputs.json", "bogus"),
    ({"model": MODEL, "prompt": "hi", "structured_outputs": {"choice": "yes"}},
     "structured_outputs.choice", "non-empty strings"),
    ({"model": MODEL, "prompt": "hi", "structured_outputs": {"regx": "a"}},
     "structured_outputs", "unknown"),
    ({"model": MODEL, "prompt": "hi", "structured_outputs": {"regex": "a"},
      "ignore_eos": True}, "ignore_eos", "cannot go with a structured output"),
    ({"model": MODEL, "prompt": ["a", "b"]}, "prompt", "One prompt per request"),
    ({"model": MODEL, "prompt": [1, 10**6]}, "prompt", "outside the vocabulary"),
    ({"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": 1}},
     "stream_options.include_usage", "valid boolean"),
    ({"model": MODEL, "prompt": "hi", "presence_penalty": 2.5}, "presence_penalty",
     "[-2, 2], got 2.5"),
    ({"model": MODEL, "prompt": "hi", "frequency_penalty": -2.01}, "frequency_penalty",
     "got -2.01"),
    ({"model": MODEL, "prompt": "hi", "repetition_penalty": 0}, "repetition_penalty", "> 0"),
    ({"model": MODEL, "prompt": "hi", "min_p": 1.5}, "min_p", "[0, 1], got 1.5"),
    ({"model": MODEL, "prompt": "hi", "min_tokens": -1}, "min_tokens", "got -1"),
    ({"model": MODEL, "prompt": "hi", "min_tokens": 9, "max_tokens": 4}, "min_tokens",
     "(9) must be at most"),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"12": 101}}, "logit_bias", "got 101"),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias", "'abc'"),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"99999999": 1}}, "logit_bias",
     "token ids in [0, 49152)"),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"12": "x"}}, "logit_bias.12",
     "valid number"),
    ({"model": MODEL, "prompt": "hi", "stop_token_ids": [49152]}, "stop_token_ids",
     "outside the vocabulary"),
    ({"model": MODEL, "prompt": "hi", "stop_token_ids": 5}, "stop_token_ids", "valid list"),
    ({"model": MODEL, "prompt": "hi", "speculative": "no"}, "speculative", "valid boolean"),
])
def test_completions_bad_input(client, body, param, words):
    error = _error(client.post("/v1/completions", json=body), 400)
    assert words.lower() in error["message"].lower()
    assert error["param"] == param


@pytest.mark.parametrize("body, param, words", [
    ({"model": MODEL}, "messages", "Missing required field 'messages'"),
    ({"model": MODEL, "messages": []}, "messages", "at least one message"),
    ({"model": MODEL, "messages": "hi"}, "messages", "Invalid value for 'messages'"),
    ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role",
     "robot"),
    ({"model": MODEL, "messages": [{"content": "x"}]}, "messages.0.role", "Missing"),
    ({"model": MODEL, "messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens",
     "at least 1"),
    ({"model": MODEL, "messages": CHAT, "max_tokens": 0}, "max_tokens", "at least 1"),
    ({"model": MODEL, "messages": CHAT, "temperature": -1}, "temperature", ">= 0"),
    ({"model": MODEL, "messages": CHAT, "top_logprobs": 2}, "top_logprobs", "needs 'logprobs'"),
    ({"model": MODEL, "messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs",
     "[0, 20], got 21"),
    ({"model": MODEL, "messages": CHAT, "tools": [{"type": "function"}]}, "tools.0",
     "must be"),
    ({"model": MODEL, "messages": CHAT, "tool_choice": "required"}, "tool_choice",
     "needs 'tools'"),
    ({"model": MODEL, "messages": CHAT, "tools": [_TOOL], "tool_choice": {
        "type": "function", "function": {"name": "other"}}}, "tool_choice", "not one of"),
    ({"model": MODEL, "messages": CHAT, "tools": [_TOOL, _TOOL]}, "tools.1.function.name",
     "unique"),
    ({"model": MODEL, "messages": CHAT, "tools": [_TOOL],
      "response_format": {"type": "json_object"}}, "tools", "cannot go together"),
    ({"model": MODEL, "messages": CHAT, "functions": [_TOOL["function"]]}, "functions",
     "not supported"),
    ({"model": MODEL, "messages": CHAT, "response_format": {"type": "json_schema"}},
     "response_format", "'schema' object"),
    ({"model": MODEL, "messages": CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "nope"),
    ({"model": MODEL, "messages": CHAT, "modalities": ["text", "audio"]}, "modalities",
     "not supported"),
    ({"model": MODEL, "messages": [{"role": "assistant", "content": None,
                                    "tool_calls": [{"id": "x"}]}]},
     "messages", "need function.name"),
    ({"model": MODEL, "messages": CHAT, "n": 17}, "n", "got 17"),
])
def test_chat_bad_input(client, body, param, words):
    error = _error(client.post("/v1/chat/completions", json=body), 400)
    assert words.lower() in error["message"].lower()
    assert error["param"] == param


def test_too_long_names_both_numbers(client, model_info):
    prompt = "one two three four five six seven eight nine ten"
    num_prompt = len(model_info.tokenizer.encode(prompt))
    error = _error(client.post("/v1/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": 60}), 400)
    assert "64" in error["message"] and str(num_prompt) in error["message"]
    assert "max_tokens=60" in error["message"]
    error = _error(client.post("/v1/completions", json={"model": MODEL, "prompt": "hi " * 80}),
                   400)
    assert "maximum context length is 64" in error["message"]
    # The chat template alone is ~30 tokens: 40 more do not fit in 64.
    error = _error(client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": CHAT, "max_completion_tokens": 40}), 400)
    assert "max_completion_tokens=40" in error["message"]


def test_unknown_model_is_404(client):
    for path, extra in (("/v1/completions", {"prompt": "hi"}),
                        ("/v1/chat/completions", {"messages": CHAT})):
        error = _error(client.post(path, json={"model": "gpt-17", **extra}), 404)
        assert "gpt-17" in error["message"] and error["code"] == "model_not_found"


def test_unknown_path_and_method_use_error_body(client):
    _error(client.get("/v1/nothing"), 404)
    _error(client.get("/v1/completions"), 405)


def test_no_engine_is_503_with_reason(client):
    error = _error(client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"}), 503)
    assert "no normal engine is registered" in error["message"]
    error = _error(client.post("/v1/chat/completions",
                               json={"model": MODEL, "messages": CHAT, "stream": True}), 503)
    assert "no normal engine" in error["message"]
    health = client.get("/health")
    assert health.status_code == 503 and "no normal engine" in health.json()["reason"]


def test_no_op_values_pass_bookkeeping_is_logged_and_unknown_fields_are_400(client, caplog):
    """No silent ignore: a field's no-op value is accepted (it asks for nothing), bookkeeping
    fields are accepted and logged, and an unknown field (top level or in a message) is a 400
    naming it, as OpenAI's API answers."""
    caplog.set_level(logging.INFO, logger="router.openai_protocol")
    openai_protocol._bookkeeping_seen.clear()  # logged once per process: not by an earlier test
    body = {"model": MODEL, "messages": CHAT, "response_format": {"type": "text"},
            "tool_choice": "none", "tools": [], "user": "u1", "metadata": {"k": "v"},
            "store": False, "parallel_tool_calls": True, "modalities": ["text"]}
    _error(client.post("/v1/chat/completions", json=body), 503)  # valid: no engine here
    assert "'user' accepted without effect" in caplog.text
    _error(client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "echo": True,
                                                "logprobs": 0, "max_tokens": 0}), 503)
    # cache_salt is declared (a tenant's prefix-cache salt, tests/router/test_cache_salt.py):
    # valid here, and bounded.
    _error(client.post("/v1/chat/completions", json={**body, "cache_salt": "tenant-a"}), 503)
    for bad in ("", "x" * 257, 5):
        error = _error(client.post("/v1/chat/completions", json={**body, "cache_salt": bad}), 400)
        assert error["param"] == "cache_salt", error
    for extra in ({"foo_bar": 1}, {"cache_salts": "a"}):
        error = _error(client.post("/v1/chat/completions", json={**body, **extra}), 400)
        name = next(iter(extra))
        assert error["param"] == name and f"Unknown field '{name}'" in error["message"]
        error = _error(client.post("/v1/completions",
                                   json={"model": MODEL, "prompt": "hi", **extra}), 400)
        assert error["param"] == name
    bad_message = [{"role": "user", "content": "hi", "foo": 1}]
    error = _error(client.post("/v1/chat/completions",
                               json={"model": MODEL, "messages": bad_message}), 400)
    assert error["param"] == "messages.0.foo"
    error = _error(client.post("/v1/chat/completions", json={**body, "priority": 5}), 400)
    assert error["param"] == "priority" and "arrival order" in error["message"]
    _error(client.post("/v1/chat/completions", json={**body, "priority": 0}), 503)


def test_models_and_metrics(client):
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 64
    client.post("/v1/completions", json={"model": MODEL, "prompt": ""})
    text = client.get("/metrics").text
    assert 'baton_router_requests_total{endpoint="/v1/completions",status="400"} 1.0' in text
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds", "kv_transfer_seconds"):
        assert f"baton_router_{name}_bucket" in text


def test_api_key(make_client, monkeypatch):
    client = make_client(api_key="s3cret")
    body = {"model": MODEL, "prompt": "hi"}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        error = _error(client.post("/v1/completions", json=body, headers=headers), 401)
        assert "API key" in error["message"] and error["code"] == "invalid_api_key"
    _error(client.get("/v1/models"), 401)
    ok = {"Authorization": "Bearer s3cret"}
    assert client.get("/v1/models", headers=ok).status_code == 200
    assert client.post("/v1/completions", json=body, headers=ok).status_code == 503
    assert client.get("/metrics").status_code == 200  # scrapes need no key
    monkeypatch.setenv("BATON_API_KEY", "from-env")
    client = make_client()
    _error(client.get("/v1/models"), 401)
    assert client.get("/v1/models", headers={"Authorization": "Bearer from-env"}).status_code == 200


@pytest.mark.parametrize("overrides, words", [
    ({"host": "example.com"}, "host"),
    ({"port": 70000}, "port"),
    ({"registry_url": "redis://x:1/0", "engines": ["normal=tcp://127.0.0.1:1"]}, "not both"),
    ({"registry_url": "http://x"}, "redis://"),
    ({"engines": ["decode=tcp://127.0.0.1:1"]}, "decode"),
    ({"token_timeout_s": 0}, "token_timeout_s"),
    ({"max_model_len": -1}, "max_model_len"),
])
def test_router_config_validation(overrides, words):
    with pytest.raises(ValueError, match=words):
        RouterConfig(**overrides)


def test_sampling_fields_reach_the_engines(model_info):
    import json

    from router.prepare_pool import prepare_raw

    body = {"model": MODEL, "prompt": "hi", "max_tokens": 8, "presence_penalty": 0.5,
            "frequency_penalty": -0.25, "repetition_penalty": 1.2, "logit_bias": {"42": -100},
            "min_tokens": 3, "min_p": 0.1, "stop_token_ids": [7, 7, 9], "top_k": 10**12}
    prep = prepare_raw(json.dumps(body).encode(), "completion", model_info)
    s = prep.sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -0.25, 1.2)
    assert s.logit_bias == {42: -100.0} and s.min_tokens == 3 and s.min_p == 0.1
    assert s.stop_token_ids == [*model_info.stop_token_ids, 7, 9]
    assert s.top_k == model_info.tokenizer.vocab_size  # past the vocabulary: all, as off
    assert prep.min_tokens == 3
    assert s.speculative is True  # speculative decoding, where the engine runs it
    body = {"model": MODEL, "prompt": "hi", "speculative": False}
    assert prepare_raw(json.dumps(body).encode(), "completion", model_info).sampling \
        .speculative is False
