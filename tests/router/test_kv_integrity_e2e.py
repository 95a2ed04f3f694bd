"""KV that arrives wrong is never decoded, with real processes: a prompt engine, a completion
engine whose second pull gets its first landed block inverted after the NIXL read (a test fault
armed in its environment, BATON_TEST_KV_FAULTS), a prompt engine that advertises other weights,
a real Redis registry, the router over HTTP and the official openai client.

The corrupted pull fails its checksum; the router migrates the request (a new prefill and
pull) and the stream equals the undisturbed one token for token. The pull from the engine with
other weights is refused at the handshake and the request ends with an error that says why,
no token decoded. Each counts in baton_kv_integrity_failures_total{where="pull"}; the pools end
whole.
"""

from __future__ import annotations

import uuid

import httpx
import pytest

from baton.ops.ports import free_port
from baton.protocol import SamplingOptions
from kv_transfer.integrity import FAULTS_ENV
from router.config import RouterConfig
from tests.cluster import EngineProcess, start_all, wait_for, wait_whole
from tests.router.conftest import serve_router
from tests.services.test_metrics import scrape, value

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PREFIX = "kvint"
ENGINE_ARGS = ["--num-blocks", "64", "--max-model-len", "512"]
PROMPT = ("The keeper of the lighthouse wrote in his log every night; on the night of the "
          "storm he wrote:")
MAX_TOKENS = 24
INTEGRITY = "baton_kv_integrity_failures_total"


@pytest.fixture(scope="module")
def cluster(redis_server, model_info, tmp_path_factory):
    logs = tmp_path_factory.mktemp("kvint")
    url = redis_server.url
    port = free_port()
    prompt = EngineProcess("prompt-engine", "prompt-0", logs, url, PREFIX, ENGINE_ARGS)
    completion = EngineProcess("completion-engine", "completion-0", logs, url, PREFIX,
                               [*ENGINE_ARGS, "--metrics-port", str(port)],
                               env={FAULTS_ENV: "corrupt_pull=2"})
    completion.metrics_port = port
    # Not in the registry: only the test sends to it, so the router never picks it.
    foreign = EngineProcess("prompt-engine", "prompt-foreign", logs,
                            args=[*ENGINE_ARGS, "--lease-ttl", "2"],
                            env={FAULTS_ENV: "foreign_weights"})
    engines = [prompt, completion, foreign]
    try:
        start_all(engines)
        config = RouterConfig(registry_url=url, registry_prefix=PREFIX, refresh_s=0.2,
                              max_model_len=512, num_prepare_workers=0)
        with serve_router(config, model_info) as router_url:
            wait_for(lambda: httpx.get(f"{router_url}/health").json()["engines"]
                     .get("completion") == 1, timeout_s=30, poll_s=0.2)
            yield {"url": router_url, "prompt": prompt, "completion": completion,
                   "foreign": foreign}
    finally:
        for engine in engines:
            engine.kill()


def _complete(url: str) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    return "".join(c.choices[0].text for c in stream if c.choices)


def _router_metric(url: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in
               httpx.get(f"{url}/metrics").text.splitlines() if line.startswith(name))


def test_a_block_corrupted_in_flight_is_caught_and_the_request_migrates_exactly(cluster):
    url, completion = cluster["url"], cluster["completion"]
    before = value(scrape(completion), INTEGRITY, where="pull")
    reference = _complete(url)  # pull 1: undisturbed
    assert _router_metric(url, "baton_router_migrations_total") == 0
    again = _complete(url)  # pull 2 lands inverted; the migration's pull 3 does not
    assert again == reference
    assert _router_metric(url, "baton_router_migrations_total") == 1
    wait_for(lambda: value(scrape(completion), INTEGRITY, where="pull") == before + 1,
             timeout_s=10, poll_s=0.2)
    assert value(scrape(completion), "baton_kv_transfer_failures_total",
                 reason="checksum_mismatch") == 1
    assert "checksum" in completion.tail(20000) and "TEST FAULTS ARMED" in completion.tail(20000)
    wait_whole([cluster["prompt"], completion])


def test_kv_from_an_engine_with_other_weights_is_refused_with_a_reason(cluster):
    foreign, completion = cluster["foreign"], cluster["completion"]
    before = value(scrape(completion), INTEGRITY, where="pull")
    ids = [300 + (i * 7919) % 40000 for i in range(40)]
    opts = SamplingOptions(max_tokens=8, temperature=0.0, ignore_eos=True)
    with foreign.client() as c:
        first = c.generate(ids, opts, req_id=uuid.uuid4().hex, timeout_s=120)
    assert first.kv_handle, first
    with completion.client() as c:
        rest = c.generate(ids, opts, req_id=first.req_id, timeout_s=120,
                          kv_handle=first.kv_handle, first_token_id=first.token_ids[0])
    assert rest.finish_reason == "kv_transfer_failed" and not rest.token_ids, rest
    assert "fingerprint_mismatch" in rest.error and "Wforeign-" in rest.error, rest.error
    # The counters are published at the registry-snapshot cadence.
    wait_for(lambda: value(scrape(completion), INTEGRITY, where="pull") == before + 1,
             timeout_s=10, poll_s=0.2)
    wait_whole([foreign, completion])  # the unclaimed lease expires (--lease-ttl 2)
