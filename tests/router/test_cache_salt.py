"""Tenants (issue 32): a request's `cache_salt` keys its prompt blocks from its own seed (P1,
docs/scheduler.md), so one tenant's prompts never hit, nor route by, another's cached blocks.

Real processes: a prompt and a completion engine on the real model, a real Redis registry, the
router over HTTP; the direct part talks to the prompt engine over its (CURVE) socket.
"""

from __future__ import annotations

import time
import uuid

import httpx
import pytest

from baton.engine.block_keys import compute_block_keys, key_seed, salted_seed
from baton.ops.registry import RedisRegistry, RegistryConfig, record_signing_key
from baton.protocol import SamplingOptions
from kv_transfer.protocol import decode_handle
from router.config import RouterConfig
from router.kv_index import RequestKeys
from tests.cluster import KEYS, EngineProcess
from tests.router.conftest import serve_router

MODEL = "SmolLM2-135M-Instruct"
PREFIX = "salt"
BLOCK = 16  # tests/cluster.py BASE_ARGS
ENGINE_ARGS = ["--num-blocks", "256", "--max-model-len", "1024", "--max-num-seqs", "16"]
LONG = ("You are a careful assistant for a law firm. " * 14
        + "Summarise the following clause in one sentence.")


def test_request_keys_use_the_salted_seed() -> None:
    tokens = list(range(1000, 1040))
    for salt in ("", "tenant-a"):
        want = compute_block_keys(tokens, BLOCK, salted_seed(77, salt)).tolist()
        assert RequestKeys(tokens, salt).keys_for(BLOCK, 77) == want
    assert RequestKeys(tokens, "a").keys_for(BLOCK, 77) != RequestKeys(tokens, "b").keys_for(BLOCK, 77)
    assert key_seed("m", "") == salted_seed(key_seed("m"), "")
    assert salted_seed(key_seed("m"), "a") != key_seed("m")


@pytest.fixture(scope="module")
def pd(redis_server, model_info, tmp_path_factory):
    logs = tmp_path_factory.mktemp("salt-engines")
    engines = [EngineProcess("prompt-engine", "prompt-0", logs, redis_server.url, PREFIX,
                             ENGINE_ARGS),
               EngineProcess("completion-engine", "completion-0", logs, redis_server.url,
                             PREFIX, ENGINE_ARGS)]
    try:
        deadline = time.monotonic() + 240
        for engine in engines:
            engine.wait_ready(deadline)
        config = RouterConfig(registry_url=redis_server.url, registry_prefix=PREFIX,
                              refresh_s=0.2, max_model_len=1024)
        with serve_router(config, model_info) as url:
            deadline = time.monotonic() + 30
            while httpx.get(f"{url}/health").status_code != 200:
                assert time.monotonic() < deadline, "router never healthy"
                time.sleep(0.2)
            yield {"url": url, "prompt": engines[0], "completion": engines[1]}
    finally:
        for engine in engines:
            engine.stop()


@pytest.mark.slow
def test_p1_cache_salt_isolates_tenants_through_the_router(pd) -> None:
    def ask(salt: str | None):
        extra = {"cache_salt": salt} if salt is not None else {}
        with httpx.Client(base_url=pd["url"], timeout=120) as http:
            resp = http.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": LONG}],
                "temperature": 0, "max_tokens": 8, **extra})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        return body["usage"]["prompt_tokens_details"]["cached_tokens"], \
            body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens"]

    a1, b, a2, shared = ask("tenant-a"), ask("tenant-b"), ask("tenant-a"), ask(None)
    hit = BLOCK * ((a1[2] - 1) // BLOCK) - BLOCK
    assert hit > 0
    assert (a1[0], b[0], shared[0]) == (0, 0, 0), (a1, b, shared)
    assert a2[0] >= hit, (a2, hit)
    assert len({a1[1], b[1], a2[1], shared[1]}) == 1  # the same greedy answer every way


@pytest.mark.slow
def test_the_kv_handle_keys_respect_the_salt(pd, model_info, redis_server) -> None:
    registry = RedisRegistry(RegistryConfig(url=redis_server.url, prefix=PREFIX,
                                            signing_key=record_signing_key(KEYS)))
    try:
        [record] = registry.list("prompt")
    finally:
        registry.close()
    ids = model_info.tokenizer.encode(LONG + " (handle)")
    greedy = SamplingOptions(max_tokens=4, temperature=0.0, ignore_eos=True)
    req_id = uuid.uuid4().hex
    with pd["prompt"].client() as c:
        first = c.generate(ids, greedy, req_id=req_id, timeout_s=120, cache_salt="tenant-c")
    handle = decode_handle(first.kv_handle)
    salted = compute_block_keys(ids, BLOCK, key_seed(record.model_fingerprint, "tenant-c"))
    assert handle.block_keys == salted.tolist() and len(salted) > 0
    assert handle.block_keys != compute_block_keys(ids, BLOCK,
                                                   key_seed(record.model_fingerprint)).tolist()
    with pd["completion"].client() as c:
        # Another tenant's salt: the handle's keys disagree with the request's, refused.
        wrong = c.generate(ids, greedy, req_id=req_id, timeout_s=60, cache_salt="tenant-d",
                           kv_handle=first.kv_handle, first_token_id=first.token_ids[0])
        assert "block keys" in wrong.error, wrong
        done = c.generate(ids, greedy, req_id=req_id, timeout_s=120, cache_salt="tenant-c",
                          kv_handle=first.kv_handle, first_token_id=first.token_ids[0])
    # The prompt engine sampled the first of the 4 tokens; the completion engine the rest.
    assert done.finish_reason == "length" and len(done.token_ids) == 3, done

