"""--kv-cache-dtype bfloat16 across the hand-off, engines as separate processes with NIXL between
them: the prompt's bf16 blocks are pulled (half the bytes of float32's) and decode on to the
tokens a bf16 normal engine gives; a float32 completion engine refuses a bf16 prompt engine's
handle with a reason that names its KV layout, and nothing leaks on either side."""

from __future__ import annotations

import uuid

import pytest

from baton.protocol import AbortRequest, SamplingOptions
from tests.cluster import EngineProcess, start_all, wait_whole

pytestmark = pytest.mark.slow

BF16 = ["--kv-cache-dtype", "bfloat16", "--num-blocks", "48"]
GREEDY = SamplingOptions(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    logs = tmp_path_factory.mktemp("kvdtype")
    procs = {
        "normal": EngineProcess("engine", "normal-bf16", logs, args=BF16),
        "prompt": EngineProcess("prompt-engine", "prompt-bf16", logs,
                                args=[*BF16, "--lease-ttl", "8"]),
        "completion": EngineProcess("completion-engine", "completion-bf16", logs, args=BF16),
        "float32": EngineProcess("completion-engine", "completion-f32", logs,
                                 args=["--num-blocks", "24"]),
    }
    try:
        start_all(list(procs.values()))
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def _ids(n: int, seed: int) -> list[int]:
    return [300 + (i * 7919 + seed * 104729) % 40000 for i in range(n)]


def _prefill(engines, ids):
    with engines["prompt"].client() as c:
        first = c.generate(ids, GREEDY, req_id=uuid.uuid4().hex, timeout_s=120)
    assert first.kv_handle and len(first.token_ids) == 1, first
    return first


def _decode(completion: EngineProcess, ids, first):
    with completion.client() as c:
        return c.generate(ids, GREEDY, req_id=first.req_id, timeout_s=120,
                          kv_handle=first.kv_handle, first_token_id=first.token_ids[0])


@pytest.mark.parametrize("num_tokens", [17, 100])
def test_bf16_blocks_pulled_decode_as_a_bf16_normal_engine(engines, num_tokens: int) -> None:
    ids = _ids(num_tokens, seed=num_tokens)
    with engines["normal"].client() as c:
        want = c.generate(ids, GREEDY, timeout_s=120)
    before = engines["completion"].stats().extra["kv_blocks_pulled"]
    first = _prefill(engines, ids)
    rest = _decode(engines["completion"], ids, first)
    assert rest.finish_reason == "length", rest.error
    assert first.token_ids + rest.token_ids == want.token_ids
    pulled = engines["completion"].stats().extra["kv_blocks_pulled"] - before
    assert pulled == -(-num_tokens // 16)
    wait_whole([engines["normal"], engines["prompt"], engines["completion"]])


def test_a_float32_completion_engine_refuses_bf16_blocks(engines) -> None:
    ids = _ids(40, seed=9)
    first = _prefill(engines, ids)
    out = _decode(engines["float32"], ids, first)
    assert out.finish_reason == "bad_request" and not out.token_ids
    assert "KV cache dtype" in out.error and "float32" in out.error, out.error
    with engines["prompt"].client() as c:  # the router aborts the leg it could not place
        c.send(AbortRequest(first.req_id))
        c.stats()
    wait_whole([engines["prompt"], engines["float32"]])
