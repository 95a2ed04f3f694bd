"""LoRA adapters through the router with real engine processes on a tiny seeded Llama (an HF
folder written by transformers) and random PEFT adapters: the official openai client names the
adapter in `model`, /v1/models lists base and adapters, an unknown model is a 404 with the list,
adapters load and unload at run time (POST /v1/load_lora_adapter, /v1/unload_lora_adapter) on
every engine, and a prompt never hits another adapter's blocks. Two deployments:
  normal  one NORMAL engine started with --lora-modules, router with a static engine list
  pd      one PROMPT + one COMPLETION engine on the Redis registry, the adapter loaded at run time
Greedy answers equal an in-process exact engine with the same adapter (itself equal to PEFT:
tests/model/test_lora.py)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import pytest

from baton.protocol import SamplingOptions
from router.config import RouterConfig
from router.text import load_model_info
from tests.cluster import EngineProcess, start_all, wait_whole
from tests.router.conftest import serve_router
from tests.threads import engine_config

pytestmark = pytest.mark.slow

BASE = "tiny-llama"
ENGINE_ARGS = ["--num-blocks", "64", "--max-model-len", "256", "--block-size", "8"]
PROMPT = " ".join(f"t{i}" for i in (17, 301, 88, 1999, 5, 640, 71, 1203, 44, 9, 812, 333,
                                    27, 1500, 66, 7, 402, 90))  # 18 tokens: two full blocks


@pytest.fixture(scope="module")
def folders(lora_folders) -> dict[str, Path]:
    return lora_folders


@pytest.fixture(scope="module")
def expected(folders) -> dict[str, list[int]]:
    """Greedy tokens of PROMPT under each adapter ("" = the base), from an in-process engine."""
    from baton.engine import LLMEngine
    from baton.sampling.params import SamplingParams

    engine = LLMEngine(engine_config(model=str(folders["base"]), device="cpu", num_blocks=64,
                                     block_size=8))
    for name in ("alpha", "beta"):
        engine.load_lora(name, str(folders[name]))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ids = engine.tokenizer.encode(PROMPT)
    outs = engine.generate([ids] * 3, params, lora_names=["", "alpha", "beta"])
    return {lora: out.token_ids for lora, out in zip(["", "alpha", "beta"], outs, strict=True)}


@pytest.fixture(scope="module")
def deployments(folders, redis_server, tmp_path_factory):
    logs = tmp_path_factory.mktemp("engines")
    model = ["--model", str(folders["base"]), *ENGINE_ARGS]
    normal = EngineProcess("engine", "lora-normal", logs,
                           args=[*model, "--lora-modules", f"alpha={folders['alpha']}"])
    prompt = EngineProcess("prompt-engine", "lora-prompt", logs, redis_server.url, "lora", model)
    completion = EngineProcess("completion-engine", "lora-completion", logs, redis_server.url,
                               "lora", model)
    engines = [normal, prompt, completion]
    info = load_model_info(str(folders["base"]), BASE, 256)
    try:
        start_all(engines)
        with serve_router(RouterConfig(engines=[f"normal={normal.address}"], model_name=BASE,
                                       max_model_len=256), info) as normal_url, \
                serve_router(RouterConfig(registry_url=redis_server.url, registry_prefix="lora",
                                          refresh_s=0.2, model_name=BASE, max_model_len=256),
                             info) as pd_url:
            _wait(lambda: httpx.get(f"{pd_url}/health").status_code == 200)
            _wait(lambda: "alpha" in _models(normal_url))  # asked on connection
            yield {"normal": normal_url, "pd": pd_url, "completion": completion,
                   "engines": engines}
    finally:
        for engine in engines:  # all at once: each drains and exits on its own
            if engine.proc.poll() is None:
                engine.proc.send_signal(signal.SIGTERM)
        for engine in engines:
            engine.stop()


def _wait(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.1)


def _models(url: str) -> list[str]:
    return [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]


def _openai(url: str):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _ask(client, model: str) -> tuple[list[str], int]:
    done = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert done.model == model
    return done.choices[0].text.split(), done.usage.prompt_tokens_details.cached_tokens


def _words(ids: list[int]) -> list[str]:
    return [f"t{t}" for t in ids]


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def test_adapters_through_the_router_with_the_openai_client(deployments, folders, expected):
    """normal: alpha from --lora-modules; beta loaded, served, refused twice, unloaded; the
    404 lists what is served; A, B, A, base on one prompt: only A's second finds blocks."""
    import openai

    url = deployments["normal"]
    client = _openai(url)
    assert _models(url) == [BASE, "alpha"]
    with pytest.raises(openai.NotFoundError, match=f"'nope' does not exist.*'{BASE}', 'alpha'"):
        _ask(client, "nope")
    load = {"lora_name": "beta", "lora_path": str(folders["beta"])}
    assert _post(url, "/v1/load_lora_adapter", load).status_code == 200
    assert _models(url) == [BASE, "alpha", "beta"]
    again = _post(url, "/v1/load_lora_adapter", load)
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    narrow = _post(url, "/v1/load_lora_adapter",
                   {"lora_name": "narrow", "lora_path": str(folders["narrow"])})
    assert narrow.status_code == 400, narrow.text
    assert "'narrow': layers.0.self_attn.q_proj.lora_A has shape (4, 32)" in \
        narrow.json()["error"]["message"]

    answers = [_ask(client, model) for model in ("alpha", "beta", "alpha", BASE)]
    assert [a[0] for a in answers] == [_words(expected[m]) for m in ("alpha", "beta", "alpha", "")]
    assert [a[1] for a in answers] == [0, 0, 16, 0]

    missing = _post(url, "/v1/unload_lora_adapter", {"lora_name": "gamma"})
    assert missing.status_code == 404 and "'gamma' is not loaded" in missing.text
    assert _post(url, "/v1/unload_lora_adapter", {"lora_name": "beta"}).status_code == 200
    assert _models(url) == [BASE, "alpha"]
    with pytest.raises(openai.NotFoundError):
        _ask(client, "beta")
    wait_whole(deployments["engines"])


def test_the_disaggregated_path_runs_the_adapter_on_both_engines(deployments, folders, expected):
    """pd: beta loaded at run time on the prompt and the completion engine; its answer is the
    co-located one; a completion engine without the adapter refuses the hand-off by name."""
    url = deployments["pd"]
    client = _openai(url)
    load = {"lora_name": "beta", "lora_path": str(folders["beta"])}
    reply = _post(url, "/v1/load_lora_adapter", load)
    assert reply.status_code == 200, reply.text
    assert set(reply.json()["engines"]) == {"lora-prompt", "lora-completion"}
    assert _models(url) == [BASE, "beta"]
    assert _ask(client, "beta") == (_words(expected["beta"]), 0)
    assert _ask(client, "beta") == (_words(expected["beta"]), 16)
    assert _ask(client, BASE) == (_words(expected[""]), 0)

    greedy = SamplingOptions(max_tokens=4, temperature=0.0, ignore_eos=True)
    with deployments["completion"].client() as c:
        refused = c.generate([5, 6, 7], greedy, timeout_s=30, lora_name="alpha",
                             kv_handle=b"x", first_token_id=9)
    assert "LoRA adapter 'alpha' is not loaded on this engine" in refused.error, refused
    assert _post(url, "/v1/unload_lora_adapter", {"lora_name": "beta"}).status_code == 200
    assert _models(url) == [BASE]
    wait_whole(deployments["engines"])
