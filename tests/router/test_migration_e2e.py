"""Request migration with real processes: one prompt engine, three completion engines, a real
Redis registry, the router over HTTP and the official openai client.

A completion engine killed (SIGKILL) or ending a request with an error delta (SIGTERM with no
drain time aborts what it runs) mid-stream: the stream goes on, re-prefilled on the prompt
engine and continued on a live completion engine, with exactly the undisturbed text, greedy and
seeded; every kind of request (n > 1, json_schema, logprobs, a stop string across the seam)
likewise. With the limit reached the stream ends with an error that says so. Each test ends with
every live engine's pool whole (no block owned, no lease, no pull).
"""

from __future__ import annotations

import signal
import time

import httpx
import pytest

from router.config import RouterConfig
from tests.cluster import EngineProcess, start_all, wait_for, wait_whole
from tests.router.conftest import serve_router

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PREFIX = "mig"
ENGINE_ARGS = ["--num-blocks", "128", "--max-model-len", "512", "--registry-ttl", "2"]
# No drain time: a SIGTERM aborts the running request at once, a real engine's error delta.
COMPLETION_ARGS = [*ENGINE_ARGS, "--drain-timeout", "0"]
PROMPT = ("Here is a long story about a lighthouse keeper who finds a message in a bottle "
          "washed up on the rocks one stormy night:")
MAX_TOKENS = 40
KILL_AFTER_CHUNKS = 8
GREEDY = {"temperature": 0}
SEEDED = {"temperature": 1.0, "top_p": 0.95, "seed": 1234}


@pytest.fixture(scope="module")
def cluster(redis_server, model_info, tmp_path_factory):
    logs = tmp_path_factory.mktemp("migration")
    url = redis_server.url
    prompt = EngineProcess("prompt-engine", "prompt-0", logs, url, PREFIX, ENGINE_ARGS)
    completions = [EngineProcess("completion-engine", f"completion-{i}", logs, url, PREFIX,
                                 COMPLETION_ARGS) for i in range(3)]
    engines = [prompt, *completions]
    try:
        start_all(engines)
        config = RouterConfig(registry_url=url, registry_prefix=PREFIX, refresh_s=0.2,
                              max_model_len=512, num_prepare_workers=0)
        with serve_router(config, model_info) as router_url:
            _wait_engines(router_url, 3)
            state = {"url": router_url, "prompt": prompt, "completions": completions,
                     "redis_url": url, "references": _references(router_url), "logs": logs}
            yield state
    finally:
        for engine in [*engines, *completions]:  # the fixture's and any started since
            engine.kill()


def _wait_engines(url: str, num_completion: int) -> None:
    def ready() -> bool:
        health = httpx.get(f"{url}/health")
        return health.status_code == 200 and health.json()["engines"]["completion"] == num_completion
    wait_for(ready, timeout_s=30, poll_s=0.2)


def _client(url: str):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _stream(url: str, sampling: dict, on_chunk=lambda n: None) -> tuple[str, object]:
    """The streamed text and the usage; `on_chunk(n)` runs after the n-th text chunk."""
    stream = _client(url).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, **sampling)
    text, usage, num_chunks = "", None, 0
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].text:
            text += chunk.choices[0].text
            num_chunks += 1
            on_chunk(num_chunks)
    return text, usage


def _references(url: str) -> dict[str, str]:
    """The undisturbed texts, every engine up."""
    return {name: _stream(url, sampling)[0] for name, sampling in
            (("greedy", GREEDY), ("seeded", SEEDED))}


def _serving(completions: list[EngineProcess]) -> EngineProcess:
    """The live completion engine that is decoding the (one) running request."""
    live = [e for e in completions if e.proc.poll() is None]
    for _ in range(200):
        busy = [e for e in live if e.stats().num_running]
        if busy:
            return busy[0]
        time.sleep(0.05)
    raise AssertionError("no completion engine runs the request")


def _interrupt(cluster, sig: int, stalls: list[float], after: int = KILL_AFTER_CHUNKS):
    """An on_chunk that signals the serving completion engine after KILL_AFTER_CHUNKS chunks
    and notes the longest gap between two chunks after that (for the report: chunks sent
    before the kill may still be in flight, so the stall is the longest gap, not the next)."""
    state = {"gap": 0.0}

    def on_chunk(n: int) -> None:
        now = time.monotonic()
        if n == after:
            victim = _serving(cluster["completions"])
            victim.proc.send_signal(sig)
            victim.proc.wait(30)
            stalls.append(0.0)
        elif n > after:
            stalls[-1] = max(stalls[-1], now - state["last"])
        state["last"] = time.monotonic()
    return on_chunk


def _metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _live(cluster) -> list[EngineProcess]:
    return [e for e in [cluster["prompt"], *cluster["completions"]] if e.proc.poll() is None]


def test_killed_then_failing_completion_engines_leave_the_streams_exact(cluster):
    """Greedy: SIGKILL of the serving engine; seeded: SIGTERM (an abort delta) of the next one.
    Both streams equal the undisturbed ones, usage counts every token once, and the
    re-prefill took the prompt's blocks from the prompt engine's prefix cache."""
    url, refs, stalls = cluster["url"], cluster["references"], []
    assert refs["greedy"] != refs["seeded"]
    text, usage = _stream(url, GREEDY, _interrupt(cluster, signal.SIGKILL, stalls))
    assert text == refs["greedy"]
    assert usage.completion_tokens == MAX_TOKENS
    wait_whole(_live(cluster))
    text, usage = _stream(url, SEEDED, _interrupt(cluster, signal.SIGTERM, stalls))
    assert text == refs["seeded"]
    assert usage.completion_tokens == MAX_TOKENS
    wait_whole(_live(cluster))
    assert _metric(url, "baton_router_migrations_total") == 2
    prefilled = _metric(url, 'baton_router_migration_prefill_tokens_total{kind="prefilled"}')
    cached = _metric(url, 'baton_router_migration_prefill_tokens_total{kind="cached"}')
    print(f"\nmigration: longest gap after the kill {[round(s, 3) for s in stalls]} s; "
          f"re-prefilled {prefilled:.0f} tokens, {cached:.0f} from the prefix cache")
    # Each re-prefill found the prompt's full blocks in the prompt engine's cache (its first
    # prefill left them there); the outputs were computed elsewhere.
    assert cached == 2 * (usage.prompt_tokens // 16) * 16


def _replenish(cluster, num_live: int = 2) -> None:
    """Start completion engines until `num_live` run (each kind of request below kills one)."""
    completions = cluster["completions"]
    live = [e for e in completions if e.proc.poll() is None]
    fresh = [EngineProcess("completion-engine", f"completion-{len(completions) + i}",
                           cluster["logs"], cluster["redis_url"], PREFIX, COMPLETION_ARGS)
             for i in range(num_live - len(live))]
    completions += fresh
    start_all(fresh)
    _wait_engines(cluster["url"], num_live)


def _events(url: str, path: str, body: dict, on_chunk=lambda n: None) -> list[dict]:
    """The SSE events of one streamed request; `on_chunk(n)` after the n-th chunk with text."""
    import json

    events, num_chunks = [], 0
    with httpx.Client(base_url=url, timeout=120) as http, \
            http.stream("POST", path, json={**body, "model": MODEL, "stream": True,
                                          "stream_options": {"include_usage": True}}) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            events.append(event)
            choice = (event.get("choices") or [{}])[0]
            if choice.get("text") or (choice.get("delta") or {}).get("content"):
                num_chunks += 1
                on_chunk(num_chunks)
    assert "error" not in events[-1], events[-1]
    return events


def _texts(events: list[dict]) -> dict[int, str]:
    texts: dict[int, str] = {}
    for event in events:
        for choice in event.get("choices") or []:
            piece = choice.get("text") if "text" in choice else \
                (choice.get("delta") or {}).get("content")
            texts[choice["index"]] = texts.get(choice["index"], "") + (piece or "")
    return texts


def _token_logprobs(events: list[dict]) -> list[tuple[str, float, dict]]:
    out = []
    for event in events:
        for choice in event.get("choices") or []:
            lp = choice.get("logprobs")
            if lp:
                out += list(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"],
                                strict=True))
    return out


COMPLETIONS = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True}
SCHEMA = {"type": "object", "properties": {"keeper": {"type": "string"},
                                           "year": {"type": "integer"},
                                           "story": {"type": "string"}},
          "required": ["keeper", "year", "story"], "additionalProperties": False}
KINDS = {
    # n > 1, seeded: each choice continues from its own tokens with its own draws.
    "n2-seeded": ("/v1/completions", {**COMPLETIONS, **SEEDED, "n": 2}),
    # Structured output: the grammar state is rebuilt from the tokens so far.
    "json_schema": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Tell the lighthouse keeper's story as JSON."}],
        "max_tokens": 60, "temperature": 0,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "story", "schema": SCHEMA}}}),
    "logprobs": ("/v1/completions", {**COMPLETIONS, **GREEDY, "logprobs": 3}),
    # A stop string across the migration point: set from the undisturbed text below.
    "stop": ("/v1/completions", {**COMPLETIONS, **GREEDY}),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_kind_of_request_migrates_exactly(cluster, kind):
    """The serving completion engine killed mid-stream (SIGKILL): n=2 seeded choices,
    json_schema, logprobs and a stop string spanning the migration each end exactly as the
    undisturbed run (logprobs within rounding: a re-prefill computes the first continued
    token's logits in a prompt step, the undisturbed run in a decode step)."""
    import json

    _replenish(cluster)
    url = cluster["url"]
    path, body = KINDS[kind]
    reference = _events(url, path, body)
    kill_after = KILL_AFTER_CHUNKS
    if kind == "stop":
        # The router holds back text that may begin the stop string, so the client sees no
        # chunk of it: the kill comes after the 6th chunk, the engine a few tokens ahead, and
        # the stop string runs from the 7th token to the 16th, across the migration point.
        pieces = [e["choices"][0]["text"] for e in reference if e.get("choices")]
        stop = "".join(pieces[6:16]).strip()
        assert stop, pieces
        body = {**body, "stop": [stop]}
        reference = _events(url, path, body)
        assert _texts(reference)[0] == "".join(pieces).split(stop)[0]
        kill_after = 6
    migrations = _metric(url, "baton_router_migrations_total")
    events = _events(url, path, body, _interrupt(cluster, signal.SIGKILL, [], kill_after))
    assert _texts(events) == _texts(reference)
    counts = [{k: v for k, v in next(e["usage"] for e in reversed(run) if e.get("usage")).items()
               if k in ("prompt_tokens", "completion_tokens")} for run in (events, reference)]
    assert counts[0] == counts[1]  # every token counted once (cached_tokens may differ)
    if kind == "json_schema":
        json.loads(_texts(events)[0])
    if kind == "logprobs":
        got, want = _token_logprobs(events), _token_logprobs(reference)
        assert [g[0] for g in got] == [w[0] for w in want]
        assert [g[1] for g in got] == pytest.approx([w[1] for w in want], abs=1e-3)
        assert [sorted(g[2]) for g in got] == [sorted(w[2]) for w in want]
    wait_whole(_live(cluster))
    assert _metric(url, "baton_router_migrations_total") == migrations + 1


def test_the_limit_reached_ends_the_stream_with_a_clear_error(cluster, model_info):
    """A router with --migration-limit 0: the same kill ends the stream with an error naming
    the limit, after the tokens already sent; the pools are whole."""
    config = RouterConfig(registry_url=cluster["redis_url"], registry_prefix=PREFIX,
                          refresh_s=0.2, max_model_len=512, num_prepare_workers=0,
                          migration_limit=0)
    from openai import APIError

    with serve_router(config, model_info) as url:
        _wait_engines(url, 1)
        with pytest.raises(APIError, match="migration 0 of at most 0"):
            _stream(url, GREEDY, _interrupt(cluster, signal.SIGKILL, []))
    wait_whole(_live(cluster))
