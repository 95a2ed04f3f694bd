"""A quantized mode (--quantization int4) gives the same greedy tokens disaggregated (a prompt
engine hands its KV to a completion engine) as co-located (one NORMAL engine): real engine
processes, a real Redis registry, the router, the openai client."""

from __future__ import annotations

import time

import pytest

from router.config import RouterConfig
from tests.cluster import EngineProcess, wait_whole
from tests.router.conftest import serve_router
from tests.router.test_e2e import MODEL, _openai, _wait_healthy

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 512
ARGS = ["--num-blocks", "128", "--max-model-len", str(MAX_MODEL_LEN), "--quantization", "int4"]
PROMPTS = ["The capital of France is", "Write a haiku about the sea.",
           "List the planets of the solar system in order:"]


def test_int4_disaggregated_equals_co_located(redis_server, model_info, tmp_path):
    normal = EngineProcess("engine", "q-normal-0", tmp_path, args=ARGS)
    prompt = EngineProcess("prompt-engine", "q-prompt-0", tmp_path, redis_server.url, "qpd", ARGS)
    completion = EngineProcess("completion-engine", "q-completion-0", tmp_path,
                               redis_server.url, "qpd", ARGS)
    engines = [normal, prompt, completion]
    try:
        deadline = time.monotonic() + 240
        for engine in engines:
            engine.wait_ready(deadline)
        normal_cfg = RouterConfig(engines=[f"normal={normal.address}"], max_model_len=MAX_MODEL_LEN)
        pd_cfg = RouterConfig(registry_url=redis_server.url, registry_prefix="qpd", refresh_s=0.2,
                              max_model_len=MAX_MODEL_LEN)
        with serve_router(normal_cfg, model_info) as normal_url, \
                serve_router(pd_cfg, model_info) as pd_url:
            _wait_healthy(pd_url, {"prompt": 1, "completion": 1})
            for text in PROMPTS:
                outs = []
                for url in (normal_url, pd_url):
                    done = _openai(url).completions.create(model=MODEL, prompt=text, max_tokens=24,
                                                           temperature=0)
                    outs.append((done.choices[0].text, done.usage.completion_tokens))
                assert outs[0] == outs[1], (text, outs)
                assert outs[0][0]
        wait_whole(engines)
    finally:
        for engine in engines:
            engine.stop()
