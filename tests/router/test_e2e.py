"""End to end with real processes: engines (`baton engine | prompt-engine | completion-engine`)
running the real model, a real Redis registry, the router over HTTP, the official openai client.

Two deployments share one module so the model is loaded once per engine:
  normal  one NORMAL engine, router with a static engine list
  pd      two PROMPT engines + one COMPLETION engine, router on the Redis registry
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from baton.protocol import SamplingOptions
from baton_cli.main import _SUBCOMMANDS
from router.config import RouterConfig
from tests.cluster import KEYS, EngineProcess, wait_for, wait_whole
from tests.router import kv_rounds
from tests.router.conftest import serve_router

_NEEDED = ("engine", "prompt-engine", "completion-engine")
_MISSING = [c for c in _NEEDED if c not in _SUBCOMMANDS]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bool(_MISSING), reason="engine services not built yet: `baton "
                       + ", ".join(_MISSING) + "` missing from baton_cli/main.py _SUBCOMMANDS"),
]

MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 1024
ENGINE_ARGS = ["--num-blocks", "512", "--max-model-len", str(MAX_MODEL_LEN),
               "--max-num-seqs", "64"]
READY_TIMEOUT_S = 240.0


@pytest.fixture(scope="module")
def deployments(redis_server, model_info, tmp_path_factory):
    logs = tmp_path_factory.mktemp("engines")
    normal = EngineProcess("engine", "normal-0", logs, args=ENGINE_ARGS)
    prompts = [EngineProcess("prompt-engine", f"prompt-{i}", logs, redis_server.url, "pd",
                             ENGINE_ARGS) for i in range(2)]
    completion = EngineProcess("completion-engine", "completion-0", logs, redis_server.url, "pd",
                               ENGINE_ARGS)
    engines = [normal, *prompts, completion]
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        for engine in engines:
            engine.wait_ready(deadline)
        normal_config = RouterConfig(engines=[f"normal={normal.address}"],
                                     max_model_len=MAX_MODEL_LEN)
        pd_config = RouterConfig(registry_url=redis_server.url, registry_prefix="pd",
                                 refresh_s=0.2, max_model_len=MAX_MODEL_LEN)
        with serve_router(normal_config, model_info) as normal_url, \
                serve_router(pd_config, model_info) as pd_url:
            _wait_healthy(pd_url, {"prompt": 2, "completion": 1})
            yield {"normal": normal_url, "pd": pd_url, "normal_engine": normal,
                   "prompts": prompts, "completion": completion, "engines": engines}
    finally:
        for engine in engines:
            engine.stop()


def _wait_healthy(url: str, counts: dict[str, int]) -> None:
    deadline = time.monotonic() + 30
    while True:
        health = httpx.get(f"{url}/health")
        if health.status_code == 200 and all(
                health.json()["engines"][role] == n for role, n in counts.items()):
            return
        assert time.monotonic() < deadline, health.text
        time.sleep(0.2)


def _together(*calls):
    """Independent requests sent at once, their results in order: the engines batch them (a
    step of six rows costs little more than one of one here), so a test of several requests
    takes about as long as its longest, and each result is checked as before."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(call) for call in calls]]


def _openai(url: str):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _engine_text(engine: EngineProcess, info, ids: list[int], max_tokens: int) -> str:
    from baton.service.client import EngineClient

    sampling = SamplingOptions(max_tokens=max_tokens, temperature=0.0,
                               stop_token_ids=list(info.stop_token_ids))
    with EngineClient(engine.address, keys=KEYS) as client:
        result = client.generate(ids, sampling, timeout_s=120)
    assert result.finish_reason in ("stop", "length"), result.error
    return info.tokenizer.decode(result.token_ids)


def _chat_stream_text(client, messages, max_tokens: int) -> str:
    stream = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                            max_tokens=max_tokens, stream=True)
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


@pytest.mark.parametrize("deployment", ["normal", "pd"])
def test_openai_client_greedy_matches_the_engine(deployments, model_info, deployment):
    client = _openai(deployments[deployment])
    engine = deployments["normal_engine"]
    prompt = "The capital of France is"
    expected = _engine_text(engine, model_info, model_info.tokenizer.encode(prompt), 12)
    done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert done.choices[0].text == expected
    assert done.usage.completion_tokens <= 12
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                         temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].usage.total_tokens == done.usage.total_tokens

    messages = [{"role": "user", "content": "Name three colours."}]
    ids = model_info.tokenizer.apply_chat_template(messages, tokenize=True)
    expected = _engine_text(engine, model_info, ids, 16)
    chat = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                          max_completion_tokens=16)
    assert chat.choices[0].message.content == expected
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert _chat_stream_text(client, messages, 16) == expected


@pytest.mark.parametrize("deployment", ["normal", "pd"])
def test_disconnect_mid_stream_frees_every_block(deployments, deployment):
    engines = ([deployments["normal_engine"]] if deployment == "normal"
               else [*deployments["prompts"], deployments["completion"]])
    body = {"model": MODEL, "prompt": "Write a long story about a dragon.", "max_tokens": 400,
            "temperature": 0, "ignore_eos": True, "stream": True}

    def still_decoding() -> None:
        assert any(e.stats().num_running for e in engines)

    _read_then_disconnect(deployments[deployment], body, 4, before_hanging_up=still_decoding)
    wait_whole(engines)


def _read_then_disconnect(base_url: str, body: dict, num_chunks: int,
                          before_hanging_up=lambda: None) -> None:
    """Stream a completion, read `num_chunks` data chunks, call `before_hanging_up`, hang up."""
    with httpx.Client(base_url=base_url, timeout=60) as http, \
            http.stream("POST", "/v1/completions", json=body) as response:
        seen = 0
        for line in response.iter_lines():
            seen += line.startswith("data: {")
            if seen == num_chunks:
                before_hanging_up()
                break


def test_64_concurrent_streams_match_their_whole_text(deployments):
    from openai import AsyncOpenAI

    prompts = [f"Say something about the number {i}." for i in range(64)]

    async def run(stream: bool) -> list[str]:
        client = AsyncOpenAI(base_url=f"{deployments['pd']}/v1", api_key="unused",
                             max_retries=0, timeout=300)

        async def one(prompt: str) -> str:
            kwargs = dict(model=MODEL, messages=[{"role": "user", "content": prompt}],
                          temperature=0, max_tokens=8)
            if not stream:
                return (await client.chat.completions.create(**kwargs)).choices[0].message.content
            text = ""
            async for chunk in await client.chat.completions.create(stream=True, **kwargs):
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
            return text

        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await client.close()

    streamed = asyncio.run(run(stream=True))
    whole = asyncio.run(run(stream=False))
    assert all(streamed) and streamed == whole
    wait_whole([*deployments["prompts"], deployments["completion"]])


def _engine_ids(engine: EngineProcess, info, ids: list[int], **sampling) -> list[int]:
    from baton.service.client import EngineClient

    options = SamplingOptions(temperature=0.0, stop_token_ids=list(info.stop_token_ids),
                              **sampling)
    with EngineClient(engine.address, keys=KEYS) as client:
        result = client.generate(ids, options, timeout_s=120)
    assert result.finish_reason in ("stop", "length"), result.error
    return result.token_ids


def _both(deployments, path: str, body: dict) -> dict:
    """The same request through the co-located and the disaggregated router: equal answers."""
    def post(deployment: str) -> httpx.Response:
        return httpx.post(f"{deployments[deployment]}{path}", json={"model": MODEL, **body},
                          timeout=120)

    answers = []
    for response in _together(lambda: post("normal"), lambda: post("pd")):
        assert response.status_code == 200, response.text
        answers.append(response.json())
    # Usage less its cached tokens: which of several requests sent at once meets another's
    # prefix in the cache is a race (test_prefix_cache_hits_are_reported_and_exact checks them).
    strip = [({**a["choices"][0]}, {k: v for k, v in a["usage"].items()
                                    if k != "prompt_tokens_details"}) for a in answers]
    assert strip[0] == strip[1], answers
    return answers[0]


def test_logit_bias_penalties_and_min_tokens_through_the_router(deployments, model_info):
    """Each changes greedy output as specified, on both deployments alike (the first token is
    sampled on the prompt engine there) and as the engine itself samples it."""
    tok, engine = model_info.tokenizer, deployments["normal_engine"]
    prompt = "The capital of France is"
    ids = tok.encode(prompt)
    penalties = {"presence_penalty": 1.5, "frequency_penalty": 1.0, "repetition_penalty": 1.3}
    messages = [{"role": "user", "content": "Answer with one word: is water wet?"}]
    chat = {"messages": messages, "max_tokens": 40, "temperature": 0}
    # Two rounds of requests sent at once: the second needs the first's tokens.
    plain, long_plain, penalised, done_penalised, short = _together(
        lambda: _engine_ids(engine, model_info, ids, max_tokens=8),
        lambda: _engine_ids(engine, model_info, ids, max_tokens=24),
        lambda: _engine_ids(engine, model_info, ids, max_tokens=24, **penalties),
        lambda: _both(deployments, "/v1/completions", {"prompt": prompt, "max_tokens": 24,
                                                        "temperature": 0, **penalties}),
        lambda: _both(deployments, "/v1/chat/completions", chat))
    assert penalised != long_plain
    assert done_penalised["choices"][0]["text"] == tok.decode(penalised)
    num_short = short["usage"]["completion_tokens"]
    assert short["choices"][0]["finish_reason"] == "stop" and num_short < 30
    k = next(i for i in range(2, 24) if long_plain[i] not in long_plain[:i])
    first_word = short["choices"][0]["message"]["content"].split()[0]
    biased, done_biased, stopped, longer, cut, held = _together(
        lambda: _engine_ids(engine, model_info, ids, max_tokens=8, logit_bias={plain[0]: -100.0}),
        lambda: _both(deployments, "/v1/completions", {"prompt": prompt, "max_tokens": 8,
                                                        "temperature": 0,
                                                        "logit_bias": {str(plain[0]): -100}}),
        lambda: _both(deployments, "/v1/completions", {"prompt": prompt, "max_tokens": 24,
                                                        "temperature": 0,
                                                        "stop_token_ids": [long_plain[k]]}),
        lambda: _both(deployments, "/v1/chat/completions", {**chat, "min_tokens": num_short + 6}),
        # A stop string in the first min_tokens tokens does not stop the request.
        lambda: _both(deployments, "/v1/chat/completions", {**chat, "stop": [first_word]}),
        lambda: _both(deployments, "/v1/chat/completions", {**chat, "stop": [first_word],
                                                             "min_tokens": num_short + 6}))
    assert biased[0] != plain[0]
    assert done_biased["choices"][0]["text"] == tok.decode(biased)
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] == k + 1, k  # the stop id is output
    assert longer["usage"]["completion_tokens"] >= num_short + 6
    assert longer["choices"][0]["message"]["content"].startswith(
        short["choices"][0]["message"]["content"])
    assert cut["choices"][0]["message"]["content"] == ""
    assert held["choices"][0]["message"]["content"].startswith(first_word)
    wait_whole([deployments["normal_engine"], *deployments["prompts"], deployments["completion"]])


def _completion_choices(url: str, body: dict, stream: bool = False):
    """Each choice's (text, finish reason) by index, and the usage."""
    client = _openai(url)
    if not stream:
        done = client.completions.create(model=MODEL, **body)
        assert [c.index for c in done.choices] == list(range(body["n"]))
        return [(c.text, c.finish_reason) for c in done.choices], done.usage, done
    texts, reasons, usage = {}, {}, None
    for chunk in client.completions.create(model=MODEL, stream=True,
                                           stream_options={"include_usage": True}, **body):
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                assert c.index not in reasons
                reasons[c.index] = c.finish_reason
    return [(texts[i], reasons[i]) for i in range(body["n"])], usage, None


def test_n_choices_fork_one_prompt(deployments, model_info):
    """n > 1: one prefill and one pull, the other choices forked; seeded choices repeat, differ
    from each other, are each the n = 1 request drawing with sample_index i, and are the same
    co-located, disaggregated, streamed or not; greedy choices are equal; usage counts every
    choice once and the prompt once; a disconnect ends every choice; pools whole after."""
    tok, engine = model_info.tokenizer, deployments["normal_engine"]
    prompt = "Once upon a time, in a land far away,"
    body = {"prompt": prompt, "n": 3, "temperature": 1.0, "seed": 11, "max_tokens": 6,
            "logprobs": 0}
    normal, usage, done = _completion_choices(deployments["normal"], body)
    assert len({text for text, _ in normal}) > 1
    assert usage.prompt_tokens == len(tok.encode(prompt))
    assert usage.completion_tokens == sum(len(c.logprobs.tokens) for c in done.choices)
    assert _completion_choices(deployments["normal"], body)[0] == normal
    from baton.service.client import EngineClient

    def alone(i: int):
        with EngineClient(engine.address, keys=KEYS) as direct:
            return direct.generate(tok.encode(prompt), SamplingOptions(
                max_tokens=6, temperature=1.0, seed=11, sample_index=i,
                stop_token_ids=list(model_info.stop_token_ids)), timeout_s=120)

    alones = _together(*(lambda i=i: alone(i) for i in range(len(normal))))
    for i, ((text, _), result) in enumerate(zip(normal, alones, strict=True)):
        assert tok.decode(result.token_ids) == text, i
    prompts, completion = deployments["prompts"], deployments["completion"]
    before = [sum(e.stats().num_prompt_tokens for e in prompts),
              completion.stats().extra["kv_pulls_done"]]
    pd, pd_usage, _ = _completion_choices(deployments["pd"], body)
    assert pd == normal and pd_usage.completion_tokens == usage.completion_tokens
    after = [sum(e.stats().num_prompt_tokens for e in prompts),
             completion.stats().extra["kv_pulls_done"]]
    # Prefilled once (at most the whole prompt: a cached prefix is skipped), pulled once.
    assert after[0] - before[0] <= usage.prompt_tokens and after[1] - before[1] == 1
    assert _completion_choices(deployments["pd"], body, stream=True)[0] == normal
    assert _completion_choices(deployments["normal"], body, stream=True)[0] == normal

    messages = [{"role": "user", "content": "Name a fruit."}]

    def choices_alike(deployment: str) -> None:
        client = _openai(deployments[deployment])
        one = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                             max_tokens=8)
        two = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                             max_tokens=8, n=2)
        assert [c.message.content for c in two.choices] == [one.choices[0].message.content] * 2
        assert two.usage.completion_tokens == 2 * one.usage.completion_tokens
        assert two.usage.prompt_tokens == one.usage.prompt_tokens
        # Each choice its own grammar matcher (the forks' fed their own first token), and
        # the prompt scored once, echoed in every choice.
        picked = client.completions.create(
            model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=5, temperature=1.0,
            seed=2, n=3, extra_body={"structured_outputs": {"choice": [" yes", " no", " maybe"]}})
        assert all(c.text in (" yes", " no", " maybe") for c in picked.choices), picked
        echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, n=2,
                                           echo=True, logprobs=0, temperature=0)
        assert [c.text.startswith(prompt) for c in echoed.choices] == [True, True]
        assert echoed.choices[0].logprobs == echoed.choices[1].logprobs
        assert echoed.choices[0].logprobs.token_logprobs[0] is None

    _together(lambda: choices_alike("normal"), lambda: choices_alike("pd"))
    too_many = httpx.post(f"{deployments['normal']}/v1/completions",
                          json={"model": MODEL, "prompt": prompt, "n": 17})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"

    long = {"model": MODEL, "prompt": "Write a long story about a dragon.", "max_tokens": 400,
            "temperature": 1.0, "ignore_eos": True, "stream": True, "n": 3}
    for deployment in ("normal", "pd"):
        _read_then_disconnect(deployments[deployment], long, 8)
    wait_whole([engine, *deployments["prompts"], deployments["completion"]])


def _reference_token_logprobs(ids: list[int]) -> list[float]:
    """transformers' logprob of each token of `ids` after the first, on the same GGUF."""
    import torch
    from model.reference import reference_model

    with torch.inference_mode():
        logits = reference_model()(torch.tensor([ids])).logits[0].float()
    lp = logits.log_softmax(dim=-1)
    return lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()


@pytest.mark.parametrize("deployment", ["normal", "pd"])
def test_chat_logprobs_streamed_and_not(deployments, model_info, deployment):
    """Greedy: each token's logprob is its first alternative's, equal to transformers', and the
    stream carries the same entries as the whole answer (the first from the prompt engine)."""
    client = _openai(deployments[deployment])
    messages = [{"role": "user", "content": "Name three colours."}]
    kwargs = dict(model=MODEL, messages=messages, temperature=0, max_tokens=8, logprobs=True,
                  top_logprobs=5)
    done = client.chat.completions.create(**kwargs)
    content = done.choices[0].logprobs.content
    assert len(content) == done.usage.completion_tokens
    assert "".join(e.token for e in content) == done.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 5
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == entry.logprob
        assert entry.logprob >= max(t.logprob for t in entry.top_logprobs)
        assert bytes(entry.bytes).decode() == entry.token
    streamed = [e for chunk in client.chat.completions.create(stream=True, **kwargs)
                if chunk.choices and chunk.choices[0].logprobs
                for e in chunk.choices[0].logprobs.content]
    # Equal up to float noise: the second run's prompt meets the first's in the prefix cache,
    # so its last positions are computed in another batch shape.
    assert [e.token for e in streamed] == [e.token for e in content]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(streamed, content, strict=True)) < 1e-4
    ids = model_info.tokenizer.apply_chat_template(messages, tokenize=True)
    out = _engine_ids(deployments["normal_engine"], model_info, ids, max_tokens=8)
    want = _reference_token_logprobs(ids + out)[len(ids) - 1:]
    assert max(abs(e.logprob - w) for e, w in zip(content, want, strict=True)) < 1e-4
    wait_whole([deployments["normal_engine"], *deployments["prompts"], deployments["completion"]])


@pytest.mark.parametrize("deployment", ["normal", "pd"])
def test_completion_echo_logprobs_are_the_prompts(deployments, model_info, deployment):
    """lm-eval's loglikelihood shape: echo + logprobs (max_tokens 1 and 0): prompt logprobs
    equal transformers' log-softmax, the first is null, text offsets add up; streamed alike."""
    client = _openai(deployments[deployment])
    prompt = "The capital of France is Paris, and the capital of Italy is"
    ids = model_info.tokenizer.encode(prompt)
    want = _reference_token_logprobs(ids)
    for max_tokens in (1, 0):
        done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                         temperature=0, echo=True, logprobs=2)
        choice = done.choices[0]
        lp = choice.logprobs
        assert choice.text.startswith(prompt) and len(lp.tokens) == len(ids) + max_tokens
        assert done.usage.completion_tokens == max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        got = lp.token_logprobs[1:len(ids)]
        assert max(abs(g - w) for g, w in zip(got, want, strict=True)) < 1e-4
        assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
        assert "".join(lp.tokens) == choice.text
        for token, top in zip(lp.tokens[1:], lp.top_logprobs[1:], strict=True):
            assert 2 <= len(top) <= 3 and token in top
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3,
                                       temperature=0, echo=True, logprobs=0, stream=True)
    chunks = [c.choices[0] for c in stream if c.choices]
    assert chunks[0].text == prompt
    tokens = [t for c in chunks if c.logprobs for t in c.logprobs.token_logprobs]
    assert tokens[0] is None and len(tokens) == len(ids) + 3
    assert max(abs(g - w) for g, w in zip(tokens[1:len(ids)], want, strict=True)) < 1e-4
    wait_whole([deployments["normal_engine"], *deployments["prompts"], deployments["completion"]])


_PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                            "age": {"type": "integer"}},
           "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.parametrize("deployment", ["normal", "pd"])
def test_structured_outputs_validate(deployments, deployment):
    """json_schema (strict), json_object and vLLM's regex/choice extras, streamed and not: the
    prompt engine constrains the first token, the completion engine the rest."""
    import jsonschema

    client = _openai(deployments[deployment])
    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": _PERSON,
                                                  "strict": True}}
    done, streamed, loose, choice, regex = _together(
        lambda: client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                               max_tokens=60, response_format=fmt),
        lambda: "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=MODEL, messages=messages, temperature=0.9, seed=5, max_tokens=60,
            response_format=fmt, stream=True) if c.choices),
        lambda: client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                               max_tokens=60,
                                               response_format={"type": "json_object"}),
        lambda: client.completions.create(
            model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=5, temperature=0,
            extra_body={"structured_outputs": {"choice": [" yes", " no"]}}),
        lambda: client.completions.create(
            model=MODEL, prompt="A date:", max_tokens=12, temperature=0,
            extra_body={"structured_outputs": {"regex": r" \d{4}-\d{2}"}}))
    assert done.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(done.choices[0].message.content), _PERSON)
    jsonschema.validate(json.loads(streamed), _PERSON)
    text = loose.choices[0].message.content
    if loose.choices[0].finish_reason == "stop":  # an open-ended object may run to max_tokens
        assert isinstance(json.loads(text), dict)
    assert text.lstrip().startswith("{")
    assert choice.choices[0].text in (" yes", " no")
    assert re.fullmatch(r" \d{4}-\d{2}", regex.choices[0].text), regex.choices[0].text
    wait_whole([deployments["normal_engine"], *deployments["prompts"], deployments["completion"]])


_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
_TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "maxLength": 20}}, "required": ["zone"]}}}


@pytest.mark.parametrize("deployment", ["normal", "pd"])
def test_tool_calls_validate(deployments, deployment):
    """required and named: a call whose arguments validate against the tool's parameters,
    finish reason tool_calls, streamed as a tool-call delta; auto: a call or an answer; none:
    plain text; a second turn carries the call and its result."""
    import jsonschema

    client = _openai(deployments[deployment])
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (_WEATHER, _TIME)}
    forced = ("required", {"type": "function", "function": {"name": "get_time"}})
    turn2_messages = [*messages, {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"}]
    *calls, chunks, auto, plain, turn2 = _together(
        *(lambda c=choice: client.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=80, tools=[_WEATHER, _TIME],
            tool_choice=c) for choice in forced),
        lambda: [c.choices[0] for c in client.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=60, tools=[_WEATHER],
            tool_choice="required", stream=True) if c.choices],
        lambda: client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                               max_tokens=60, tools=[_WEATHER]),
        lambda: client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                               max_tokens=8, tools=[_WEATHER],
                                               tool_choice="none"),
        lambda: client.chat.completions.create(model=MODEL, temperature=0, max_tokens=8,
                                               messages=turn2_messages))
    for choice, done in zip(forced, calls, strict=True):
        assert done.choices[0].finish_reason == "tool_calls", done.choices[0]
        call = done.choices[0].message.tool_calls[0]
        assert choice == "required" or call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    deltas = [d for c in chunks if c.delta.tool_calls for d in c.delta.tool_calls]
    assert len(deltas) == 1 and deltas[0].index == 0 and deltas[0].id.startswith("call_")
    assert chunks[-1].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(deltas[0].function.arguments), schemas["get_weather"])
    message = auto.choices[0].message
    assert (auto.choices[0].finish_reason == "tool_calls") == bool(message.tool_calls)
    assert message.tool_calls or isinstance(message.content, str)
    assert plain.choices[0].message.tool_calls is None
    assert turn2.choices[0].finish_reason in ("stop", "length")
    wait_whole([deployments["normal_engine"], *deployments["prompts"], deployments["completion"]])


@pytest.mark.parametrize("deployment", ["normal", "pd"])
def test_prefix_cache_hits_are_reported_and_exact(deployments, deployment):
    """A repeated system prompt is served from the prefix cache (usage says how much), with the
    text of a cold run; /reset_prefix_cache empties every engine's cache."""
    client = _openai(deployments[deployment])
    system = "You are a terse assistant. " + "Answer in one short sentence only. " * 12
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": "What colour is the sky?"}]
    url = deployments[deployment]
    with httpx.Client(base_url=url, timeout=30) as http:
        reset = http.post("/reset_prefix_cache")
    assert reset.status_code == 200 and all(reset.json()["engines"].values()), reset.text
    if deployment == "pd":  # the router's index has seen the reset: it credits no engine
        wait_for(lambda: kv_rounds.metric(url, "baton_router_kv_index_keys") == 0, timeout_s=20)

    def ask():
        return client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                              max_tokens=12)

    runs = [ask()]
    assert runs[0].usage.prompt_tokens_details.cached_tokens == 0
    if deployment == "pd":  # cache-aware routing: the next ones go where the prompt is cached
        wait_for(lambda: kv_rounds.metric(url, "baton_router_kv_index_keys") > 0, timeout_s=20)
    runs += [ask(), ask()]
    # Every full block of the prompt but the last (a token may merge across its boundary).
    hit = 16 * ((runs[0].usage.prompt_tokens - 1) // 16) - 16
    assert hit > 0
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in runs]
    assert all(c >= hit for c in cached[1:]), (cached, hit)
    assert len({r.choices[0].message.content for r in runs}) == 1
    stream = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                            max_tokens=12, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= hit
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) \
        == runs[0].choices[0].message.content


SALTED = ("You are a careful assistant for a law firm. " * 14
          + "Summarise the following clause in one sentence.")


@pytest.mark.parametrize("deployment", ["normal", "pd"])
def test_p1_cache_salt_isolates_tenants_through_the_router(deployments, deployment):
    """cache_salt A, then B, then A again, then none, on one long prompt: B and none find
    nothing cached, A finds its own blocks again (on pd, cache-aware routing keys the salted
    prompt as the engines do and sends it home), and every answer is the same greedy text."""
    url = deployments[deployment]
    prompt = f"[{deployment}] {SALTED}"

    def ask(salt: str | None):
        extra = {"cache_salt": salt} if salt is not None else {}
        resp = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": MODEL, "messages": [{"role": "user", "content": prompt}],
            "temperature": 0, "max_tokens": 8, **extra})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        return (body["usage"]["prompt_tokens_details"]["cached_tokens"],
                body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens"])

    keys_before = kv_rounds.metric(url, "baton_router_kv_index_keys")
    a1 = ask("tenant-a")
    if deployment == "pd":  # the router's index has A's salted blocks before A asks again
        wait_for(lambda: kv_rounds.metric(url, "baton_router_kv_index_keys") > keys_before,
                 timeout_s=20)
    b, a2, shared = ask("tenant-b"), ask("tenant-a"), ask(None)
    hit = 16 * ((a1[2] - 1) // 16) - 16
    assert hit > 0
    assert (a1[0], b[0], shared[0]) == (0, 0, 0), (a1, b, shared)
    assert a2[0] >= hit, (a2, hit)
    assert len({a1[1], b[1], a2[1], shared[1]}) == 1


def test_the_kv_handle_keys_respect_the_salt(deployments, model_info, redis_server):
    """A prompt engine's KV handle carries the salted keys, and a completion engine refuses
    the handle for a request with another tenant's salt (the keys disagree)."""
    from baton.engine.block_keys import compute_block_keys, key_seed
    from baton.ops.registry import RedisRegistry, RegistryConfig, record_signing_key
    from kv_transfer.protocol import decode_handle

    registry = RedisRegistry(RegistryConfig(url=redis_server.url, prefix="pd",
                                            signing_key=record_signing_key(KEYS)))
    try:
        fingerprint = registry.list("prompt")[0].model_fingerprint
    finally:
        registry.close()
    ids = model_info.tokenizer.encode(SALTED + " (handle)")
    greedy = SamplingOptions(max_tokens=4, temperature=0.0, ignore_eos=True)
    req_id = f"salted-{time.monotonic_ns()}"
    with deployments["prompts"][0].client() as c:
        first = c.generate(ids, greedy, req_id=req_id, timeout_s=120, cache_salt="tenant-c")
    handle = decode_handle(first.kv_handle)
    salted = compute_block_keys(ids, 16, key_seed(fingerprint, "tenant-c")).tolist()
    assert handle.block_keys == salted and salted
    assert handle.block_keys != compute_block_keys(ids, 16, key_seed(fingerprint)).tolist()
    with deployments["completion"].client() as c:
        wrong = c.generate(ids, greedy, req_id=req_id, timeout_s=60, cache_salt="tenant-d",
                           kv_handle=first.kv_handle, first_token_id=first.token_ids[0])
        assert "block keys" in wrong.error, wrong
        done = c.generate(ids, greedy, req_id=req_id, timeout_s=120, cache_salt="tenant-c",
                          kv_handle=first.kv_handle, first_token_id=first.token_ids[0])
    # The prompt engine sampled the first of the 4 tokens; the completion engine the rest.
    assert done.finish_reason == "length" and len(done.token_ids) == 3, done


def test_cache_aware_routing_keeps_conversations_home(deployments, model_info, redis_server):
    """Four interleaved conversations of three turns over the two prompt engines: every later
    turn lands where its prefix is cached (the engine's own cached_tokens says so) and the
    router credits no more than the engines report. A router started mid-run rebuilds its index
    from the engines' snapshots and sends the next turns home too; after a reset (every cached
    block evicted) no router credits anything."""
    url = deployments["pd"]
    conversations = [[] for _ in kv_rounds.TOPICS]
    credited = kv_rounds.credited_tokens(url)
    rounds = [kv_rounds.run_round(url, conversations, turn) for turn in (1, 2, 3)]
    for previous, current in zip(rounds, rounds[1:], strict=False):
        kv_rounds.assert_home(previous, current)
    assert kv_rounds.credited_tokens(url) - credited <= (
        sum(c for r in rounds for _, c in r) + kv_rounds.BLOCK * 3 * len(conversations))
    config = RouterConfig(registry_url=redis_server.url, registry_prefix="pd", refresh_s=0.2,
                          max_model_len=MAX_MODEL_LEN)
    with serve_router(config, model_info) as fresh:
        _wait_healthy(fresh, {"prompt": 2, "completion": 1})
        wait_for(lambda: all(kv_rounds.metric(fresh, "baton_router_kv_index_keys",
                                              engine=p.engine_id) > 0
                             for p in deployments["prompts"]), timeout_s=20)
        kv_rounds.assert_home(rounds[-1], kv_rounds.run_round(fresh, conversations, 4))
        with httpx.Client(base_url=fresh, timeout=30) as http:
            assert http.post("/reset_prefix_cache").status_code == 200
        for router in (url, fresh):
            wait_for(lambda r=router: kv_rounds.metric(r, "baton_router_kv_index_keys") == 0,
                     timeout_s=20)
    deployments["conversations"] = conversations
    wait_whole([*deployments["prompts"], deployments["completion"]])


def test_restarted_prompt_engine_is_not_credited_with_what_it_lost(deployments, redis_server,
                                                                 tmp_path):
    # The victim comes back on its old address and id, so only the dropped connection and its
    # new instance id tell the router that the blocks it held are gone: were it still credited
    # with them, the conversations homed there would be routed to it on credit it cannot serve.
    url, conversations = deployments["pd"], deployments["conversations"]
    victim = deployments["prompts"][0]
    kv_rounds.run_round(url, conversations, 5)  # after the reset: spread over both again
    wait_for(lambda: kv_rounds.metric(url, "baton_router_kv_index_keys",
                                      engine=victim.engine_id) > 0, timeout_s=20)
    victim.kill()
    reborn = EngineProcess("prompt-engine", victim.engine_id, tmp_path, redis_server.url, "pd",
                           ENGINE_ARGS, port=victim.port)
    deployments["engines"].append(reborn)  # stopped with the others
    deployments["prompts"][0] = reborn
    reborn.wait_ready(time.monotonic() + READY_TIMEOUT_S)
    _wait_healthy(url, {"prompt": 2, "completion": 1})
    credited = kv_rounds.credited_tokens(url)
    cached = sum(c for _, c in kv_rounds.run_round(url, conversations, 6))
    assert kv_rounds.credited_tokens(url) - credited <= cached + kv_rounds.BLOCK * len(
        conversations)
    wait_whole([*deployments["prompts"], deployments["completion"]])


def test_killed_prompt_engine_requests_go_to_the_other(deployments):
    # Last in this module: it leaves one prompt engine.
    victim, survivor = deployments["prompts"]
    client = _openai(deployments["pd"])
    before = survivor.stats().num_prompt_tokens
    victim.stop(signal.SIGKILL)
    for i in range(4):
        done = client.completions.create(model=MODEL, prompt=f"Count to {i + 3}:", max_tokens=4,
                                         temperature=0)
        assert done.choices[0].finish_reason in ("stop", "length")
    assert survivor.stats().num_prompt_tokens > before
    _wait_healthy(deployments["pd"], {"prompt": 1, "completion": 1})  # its record expired



@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch):
    # The openai client honours proxy variables; the router is on loopback.
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.delenv(var, raising=False)
    os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
