"""The shared cluster tier (docs/scheduler.md P11) in the engine, over a real redis-server: a
block one engine published gives another engine (its own pool) the cold text token for token;
a corrupted value or another producer's is a counted miss and never wrong output; a store that
dies degrades to recompute with one warning and is used again once it is back, and one slower
than the timeout is not waited for."""

from __future__ import annotations

import logging
import time

import msgspec
import pytest
from model.reference import baton_model, prompt_of_length

from baton.engine import LLMEngine, kv_shared
from baton.engine.kv_disk_store import fingerprint_header, split_header
from baton.engine.kv_events import KvEventPublisher
from baton.ops.kv_store import RedisKvStore
from baton.ops.redis_server import RedisServer
from baton.ops.registry import connect
from baton.protocol import unpack_keys
from baton.sampling.params import SamplingParams
from tests.threads import engine_config

GREEDY = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
pytestmark = pytest.mark.slow
BS, NUM_BLOCKS = 4, 12
A = prompt_of_length(18)  # 4 full blocks before its last token
NUM_A_BLOCKS = (len(A) - 1) // BS


@pytest.fixture(scope="module")
def server():
    with RedisServer(maxmemory_bytes=32 << 20) as s:
        yield s


@pytest.fixture
def store(server):
    client = RedisKvStore(server.url, server.password_file, timeout_s=1.0)
    client.delete_prefix(kv_shared.NAME_PREFIX)  # each test starts from an empty tier
    yield client
    client.close()


def make_engine(store, **overrides) -> LLMEngine:
    return LLMEngine(engine_config(**{"num_blocks": NUM_BLOCKS, "block_size": BS, **overrides}),
                     loaded=baton_model(), shared_store=store)


@pytest.fixture(scope="module")
def cold_a() -> list[int]:
    engine = LLMEngine(engine_config(num_blocks=NUM_BLOCKS, block_size=BS,
                                     enable_prefix_caching=False), loaded=baton_model())
    return engine.generate(A, GREEDY)[0].token_ids


def publish_a(store) -> LLMEngine:
    engine = make_engine(store)
    assert engine.generate(A, GREEDY)[0].num_cached_tokens == 0
    engine.shared.flush()
    assert engine.tier_stats()["kv_tier_written_blocks_shared"] == len(A) // BS
    return engine


def rewrite_values(server, prefix: str, change) -> int:
    raw = connect(server.url, server.password_file)
    names = list(raw.scan_iter(match=f"{prefix}*"))
    for name in names:
        raw.set(name, change(raw.get(name)))
    raw.close()
    return len(names)


def test_p11_a_block_another_engine_published_gives_the_cold_text(store, cold_a) -> None:
    publisher = publish_a(store)
    reader = make_engine(store)  # its own pool: nothing of A in it
    out = reader.generate(A, GREEDY)[0]
    assert out.token_ids == cold_a and out.num_cached_tokens == NUM_A_BLOCKS * BS
    stats = reader.tier_stats()
    assert stats["kv_tier_loaded_blocks_shared"] == NUM_A_BLOCKS
    assert stats["kv_tier_hit_tokens_shared"] == NUM_A_BLOCKS * BS
    assert stats["kv_tier_hit_tokens_pool"] == 0 and stats["kv_integrity_failures_shared"] == 0
    assert stats["kv_tier_written_blocks_shared"] == len(A) // BS - NUM_A_BLOCKS  # only its own
    assert reader.num_free_blocks() == reader.num_total_blocks()
    reader.scheduler.check_invariants()
    # The events name what each engine knows of the store; the names hold the fingerprint.
    assert set(reader.shared.keys()) <= set(publisher.shared.keys())
    assert reader.shared.store.tier_id == publisher.shared.store.tier_id
    snapshot = KvEventPublisher(reader.kv_event_source()).subscribe(b"router", nonce=1)
    assert snapshot.shared_tier == reader.shared.store.tier_id
    assert list(unpack_keys(snapshot.shared_stored, snapshot.num_shared_blocks)) == \
        reader.shared.keys() and len(reader.shared.keys()) == NUM_A_BLOCKS
    other = make_engine(store, kv_cache_dtype="bfloat16")
    assert other.shared.store.prefix != reader.shared.store.prefix
    assert other.generate(A, GREEDY)[0].num_cached_tokens == 0  # a plain miss: other names
    assert other.tier_stats()["kv_integrity_failures_shared"] == 0
    # A reset clears what the engine owns; only shared=True empties the store.
    assert reader.reset_prefix_cache() and publisher.reset_prefix_cache()
    again = make_engine(store)
    assert again.generate(A, GREEDY)[0].num_cached_tokens == NUM_A_BLOCKS * BS
    names = [again.shared.store.name(k) for k in publisher.shared.keys()]
    assert again.reset_prefix_cache(shared=True) and not again.shared.keys()
    deadline = time.monotonic() + 5
    while any(v is not None for v in store.get_many(names)):  # the writer deletes them
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with pytest.raises(ValueError, match="contradict"):
        again.reset_prefix_cache(pool_only=True, shared=True)
    # A writer that is behind drops what does not fit its queue (counted): the step never waits.
    again.shared.queue_bytes = 1
    again.generate(prompt_of_length(30), GREEDY)
    stats = again.tier_stats()
    assert stats["kv_tier_dropped_blocks_shared"] > 0 and stats["kv_tier_written_blocks_shared"] == 0
    for engine in (publisher, reader, other, again):
        engine.close()


def test_p11_flipped_bytes_and_another_producer_are_counted_misses(server, store,
                                                                    cold_a) -> None:
    publisher = publish_a(store)
    prefix = publisher.shared.store.prefix
    publisher.close()

    def flip(value: bytes) -> bytes:
        data = bytearray(value)
        data[-100] ^= 0xFF  # one byte of the block's K/V
        return bytes(data)

    assert rewrite_values(server, prefix, flip) == len(A) // BS
    flipped = make_engine(store)
    out = flipped.generate(A, GREEDY)[0]
    assert out.token_ids == cold_a and out.num_cached_tokens == 0
    stats = flipped.tier_stats()
    assert stats["kv_integrity_failures_shared"] == 1  # the run stops at the first refusal
    assert stats["kv_tier_loaded_blocks_shared"] == 0 and stats["kv_tier_missed_blocks_shared"] > 0
    flipped.close()
    # Under the same names, a value whose producer is another (other weights, same name).
    store.delete_prefix(kv_shared.NAME_PREFIX)
    publish_a(store).close()

    def other_producer(value: bytes) -> bytes:
        theirs, start = split_header(value)
        other = msgspec.structs.replace(theirs, weights="f" * len(theirs.weights))
        return fingerprint_header(other) + value[start:]

    rewrite_values(server, prefix, other_producer)
    foreign = make_engine(store)
    out = foreign.generate(A, GREEDY)[0]
    assert out.token_ids == cold_a and out.num_cached_tokens == 0
    assert foreign.tier_stats()["kv_integrity_failures_shared"] == 1
    foreign.close()


def test_p11_a_dead_store_means_recompute_one_warning_and_a_reconnect(cold_a, caplog,
                                                                      monkeypatch) -> None:
    monkeypatch.setattr(kv_shared, "RETRY_S", 0.1)
    first = RedisServer(maxmemory_bytes=16 << 20).start()
    port, password = first.port, first.password
    store = RedisKvStore(first.url, first.password_file, timeout_s=0.5)
    engine = make_engine(store)
    first.proc.kill()  # the store dies with its blocks
    first.proc.wait()
    with caplog.at_level(logging.WARNING, logger="baton.engine.kv_shared"):
        outs = [engine.generate(A, GREEDY)[0], engine.generate(prompt_of_length(30), GREEDY)[0]]
    assert outs[0].token_ids == cold_a and outs[0].num_cached_tokens == 0
    warnings = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(warnings) == 1 and "recompute" in warnings[0].getMessage()
    stats = engine.tier_stats()
    assert stats["kv_tier_up_shared"] == 0 and stats["kv_tier_errors_shared"] >= 1
    first.stop()
    second = RedisServer(port=port, maxmemory_bytes=16 << 20)
    second.password = password  # the same store back (its clients keep their password)
    with second:
        deadline = time.monotonic() + 10
        while not engine.shared.store.is_up:  # the writer pings it every RETRY_S
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert "reachable again" in caplog.text
        engine.generate(prompt_of_length(40)[20:], GREEDY)
        engine.shared.flush()
        assert engine.tier_stats()["kv_tier_written_blocks_shared"] > 0
        engine.close()
    store.close()


def test_p11_a_store_slower_than_the_timeout_is_given_up(server, store, cold_a) -> None:
    """A store that answers after the tier's timeout (CLIENT PAUSE stalls every client of a
    real server for 2 s) is not waited for: the prompt computes, 0 tokens from the tier."""
    publish_a(store).close()
    slow = RedisKvStore(server.url, server.password_file, timeout_s=0.2)
    engine = make_engine(slow)
    raw = connect(server.url, server.password_file)
    raw.execute_command("CLIENT", "PAUSE", "2000", "ALL")
    out = engine.generate(A, GREEDY)[0]
    assert out.token_ids == cold_a and out.num_cached_tokens == 0  # 2 s later it would hit
    stats = engine.tier_stats()
    assert stats["kv_tier_timeouts_shared"] + stats["kv_tier_errors_shared"] >= 1
    assert stats["kv_tier_loaded_blocks_shared"] == 0
    raw.close()
    engine.close()
    slow.close()
