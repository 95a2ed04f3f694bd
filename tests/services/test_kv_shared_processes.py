"""The shared cluster tier across processes (docs/scheduler.md P11): engine A, a real `baton engine`
process with --kv-shared-tier, computes a long prefix and publishes it to a real redis-server;
engine B, this process with its own pool, serves the next request with that prefix from the
store (cached_tokens > 0) and the text of a cold run; then the store is killed and A still
answers, by recompute, with the reason in its log."""

from __future__ import annotations

import time

import pytest
from model.reference import baton_model

from baton.engine import EngineConfig, LLMEngine
from baton.ops.kv_store import RedisKvStore
from baton.ops.redis_server import RedisServer
from baton.protocol import SamplingOptions
from baton.sampling.params import SamplingParams
from tests.cluster import EngineProcess

pytestmark = pytest.mark.slow  # a multi-process deployment

BS = 16  # tests/cluster.py's engines
PREFIX = [300 + (i * 7919) % 40000 for i in range(100)]  # 6 full blocks, then a partial one


def test_p11_engine_b_serves_what_engine_a_published_and_a_dead_store_recomputes(
        tmp_path) -> None:
    store_server = RedisServer(maxmemory_bytes=64 << 20).start()
    a = EngineProcess("engine", "shared-a", tmp_path, args=[
        "--num-blocks", "24", "--kv-shared-tier", store_server.url,
        "--kv-shared-password-file", store_server.password_file])
    store = RedisKvStore(store_server.url, store_server.password_file)
    try:
        a.wait_ready(time.monotonic() + 120)
        greedy = SamplingOptions(max_tokens=4, temperature=0.0, ignore_eos=True)
        with a.client() as c:
            from_a = c.generate(PREFIX, greedy, timeout_s=120)
        assert from_a.finish_reason and len(from_a.token_ids) == 4
        deadline = time.monotonic() + 30
        while a.stats().extra.get("kv_tier_written_blocks_shared", 0) < len(PREFIX) // BS:
            assert time.monotonic() < deadline, a.tail()
            time.sleep(0.2)
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        cold = LLMEngine(EngineConfig(num_blocks=24, num_threads=1,
                                      enable_prefix_caching=False), loaded=baton_model())
        b = LLMEngine(EngineConfig(num_blocks=24, num_threads=1), loaded=baton_model(),
                      shared_store=store)
        out = b.generate(PREFIX, params)[0]
        assert out.num_cached_tokens == (len(PREFIX) - 1) // BS * BS
        assert out.token_ids == cold.generate(PREFIX, params)[0].token_ids == from_a.token_ids
        assert b.tier_stats()["kv_tier_loaded_blocks_shared"] == (len(PREFIX) - 1) // BS
        b.close()
        store_server.proc.kill()  # the store dies; A's next prompt finds nothing there
        store_server.proc.wait()
        with a.client() as c:
            again = c.generate(PREFIX[50:] + PREFIX[:50], greedy, timeout_s=120)
        assert again.finish_reason == "length" and not again.error
        log = a.tail(20000)
        assert "KV tiers: pool" in log and "shared redis://" in log
        assert "KV shared tier" in log and "unreachable" in log and "recompute" in log
        assert a.stats().extra["kv_tier_up_shared"] == 0
    finally:
        a.stop()
        store.close()
        store_server.stop()
