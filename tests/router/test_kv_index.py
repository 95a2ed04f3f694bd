"""Cache-aware routing without processes: a real scheduler's KV events through the real wire
encoding into the router's index (credited blocks = the scheduler's own hits), the index's
refusals (gap, restart, bounds, malformed keys), and the cost that picks an engine."""

from __future__ import annotations

import numpy as np
import pytest

from baton import protocol
from baton.engine.kv_events import KvEventPublisher, KvEventSource
from baton.ops.registry import EngineRecord
from baton.protocol import KvEvents, pack_keys
from router.config import RouterConfig
from router.engine_pool import EnginePool
from router.kv_index import KvIndex, RequestKeys
from router.metrics import RouterMetrics
from tests.scheduler.utils import create_scheduler, drain

SEED = 4242
BS = 4


def _publisher(num_blocks: int = 32):
    sched = create_scheduler(enable_prefix_caching=True, prefix_cache_seed=SEED,
                             num_blocks=num_blocks, block_size=BS)
    source = KvEventSource(sched, BS, SEED, sched.num_total_blocks())
    return sched, KvEventPublisher(source, instance_id="inst-1")


def _wire(msg: KvEvents) -> KvEvents:
    decoded = protocol.decode_to_router(protocol.encode(msg))
    assert isinstance(decoded, KvEvents)
    return decoded


def _run(sched, rid: str, tokens: list[int]) -> int:
    sched.add_sequence(rid, tokens, 1)
    out = sched.schedule()
    hit = sched.num_cached_prompt_tokens(rid)
    sched.process_outputs(out, np.full(len(out.request_ids), 7, dtype=np.int32))
    return hit


def test_events_credit_exactly_what_the_scheduler_hits() -> None:
    sched, pub = _publisher()
    index = KvIndex()
    assert index.apply("e", _wire(pub.subscribe(b"router", nonce=1)))
    convo = list(range(100, 111))  # two full blocks and a partial one
    _run(sched, "t1", convo)
    index.apply("e", _wire(pub.poll()))
    assert pub.poll() is None  # nothing changed: nothing sent
    turn2 = convo + [7] + list(range(200, 210))
    credited = index.overlap("e", RequestKeys(turn2))
    assert credited == 2
    assert _run(sched, "t2", turn2) == credited * BS  # the scheduler hits what was credited
    index.apply("e", _wire(pub.poll()))
    # Evicting everything (reset) un-credits it.
    drain(sched)
    assert sched.reset_prefix_cache()
    assert index.apply("e", _wire(pub.poll()))
    assert index.overlap("e", RequestKeys(turn2)) == 0 and index.num_keys("e") == 0


def test_a_second_subscriber_does_not_break_the_firsts_sequence() -> None:
    sched, pub = _publisher()
    first, second = KvIndex(), KvIndex()
    first.apply("e", _wire(pub.subscribe(b"a", 1)))
    _run(sched, "t1", list(range(100, 112)))
    second.apply("e", _wire(pub.subscribe(b"b", 1)))  # between a change and its drain
    delta = _wire(pub.poll())
    assert first.apply("e", delta) and second.apply("e", delta)
    assert first.get("e").keys == second.get("e").keys == set(sched.prefix_cache_keys().tolist())
    pub.unsubscribe(b"a")
    pub.unsubscribe(b"b")
    assert pub.poll() is None


def test_overflow_becomes_a_snapshot() -> None:
    sched, pub = _publisher()
    pub.capacity = 2
    index = KvIndex()
    index.apply("e", _wire(pub.subscribe(b"r", 1)))
    pub.source.scheduler.set_kv_event_capacity(2)
    _run(sched, "t1", list(range(100, 116)))  # four keys
    msg = _wire(pub.poll())
    assert msg.is_snapshot and index.apply("e", msg)
    assert index.num_keys("e") == 4


def _snapshot(keys=(1, 2), seq=5, instance="i", num_blocks=8) -> KvEvents:
    return KvEvents(instance, seq, is_snapshot=True, stored=pack_keys(keys), block_size=BS,
                    seed=SEED, num_total_blocks=num_blocks)


@pytest.mark.parametrize("bad", [
    KvEvents("i", 7, stored=pack_keys([3])),  # a gap: seq 6 was lost
    KvEvents("j", 6, stored=pack_keys([3])),  # another process
    KvEvents("i", 6, stored=b"\x01" * 12),  # not whole keys
    KvEvents("i", 6, stored=pack_keys(range(10, 19))),  # more keys than blocks
    KvEvents("i", 6, stored=pack_keys(range(10, 17))),  # 9 held with 8 blocks
])
def test_index_drops_an_engine_on_a_bad_delta(bad: KvEvents) -> None:
    index = KvIndex()
    assert index.apply("e", _snapshot())
    assert not index.apply("e", bad)
    assert "e" not in index and index.num_resyncs == 1
    assert not index.apply("e", KvEvents("i", 6))  # nothing but a snapshot until resubscribed
    assert index.apply("e", _snapshot(seq=9)) and index.apply("e", KvEvents("i", 10))


@pytest.mark.parametrize("bad", [
    _snapshot(num_blocks=0), _snapshot(num_blocks=1 << 30), _snapshot(keys=range(9)),
    KvEvents("i", 1, is_snapshot=True, block_size=0, num_total_blocks=8),
    KvEvents("", 1, is_snapshot=True, block_size=BS, num_total_blocks=8),
    KvEvents("i", 1, is_snapshot=True, block_size=BS, num_total_blocks=8,
             removed=pack_keys([1])),
])
def test_index_refuses_a_bad_snapshot(bad: KvEvents) -> None:
    index = KvIndex()
    assert not index.apply("e", bad) and "e" not in index


class _Connected:
    """The router's socket to an engine, as far as candidate filtering asks: connected."""

    is_connected = True
    kv_subscribed_at = 0.0

    def is_usable(self, connect_grace_s: float) -> bool:
        return True


def _pool(routing: str = "cache-aware") -> EnginePool:
    pool = EnginePool(RouterConfig(engines=["prompt=tcp://a", "prompt=tcp://b"], routing=routing),
                      RouterMetrics())
    pool.membership.records = {"prompt": [EngineRecord("prompt", f"p-{x}", f"tcp://{x}",
                                                        block_size=BS) for x in "ab"]}
    pool.membership.clients = {f"tcp://{x}": _Connected() for x in "ab"}
    return pool


def test_cost_weighs_held_blocks_against_active_blocks() -> None:
    tokens = list(range(100, 140))  # 10 blocks
    pool = _pool()
    request = RequestKeys(tokens)
    keys = request.keys_for(BS, SEED)
    pool.kv_index.apply("tcp://b", _snapshot(keys[:6], num_blocks=64))
    record, active, overlap = pool.choose("prompt", request)
    assert (record.address, active, overlap) == ("tcp://b", 4, 6)
    pool.acquire("tcp://b", 7)  # b is busy: 4 + 7 > 10 + 0
    assert pool.choose("prompt", RequestKeys(tokens))[0].address == "tcp://a"
    pool.release("tcp://b", 7)
    pool.acquire("tcp://a", 1)  # without overlap anywhere the load decides
    assert pool.choose("prompt", RequestKeys(list(range(500, 520))))[0].address == "tcp://b"
    decisions = pool.metrics.routing_decisions
    assert decisions.labels("prompt", "cached")._value.get() == 1
    assert decisions.labels("prompt", "uncached")._value.get() == 2
    assert pool.metrics.routing_credited_blocks.labels("prompt")._value.get() == 6


def test_least_loaded_ignores_the_caches() -> None:
    pool = _pool("least-loaded")
    assert pool.kv_index is None
    pool.acquire("tcp://a")
    assert pool.choose("prompt", RequestKeys(list(range(40))))[0].address == "tcp://b"


def test_request_keys_use_the_salted_seed() -> None:
    """A request with a cache salt is keyed from its engine's seed salted (P1), as the engine
    keys it; no salt is the engine's own seed."""
    from baton.engine.block_keys import compute_block_keys, key_seed, salted_seed

    tokens = list(range(1000, 1040))
    for salt in ("", "tenant-a"):
        want = compute_block_keys(tokens, 16, salted_seed(77, salt)).tolist()
        assert RequestKeys(tokens, salt).keys_for(16, 77) == want
    assert RequestKeys(tokens, "a").keys_for(16, 77) != RequestKeys(tokens, "b").keys_for(16, 77)
    assert key_seed("m", "") == salted_seed(key_seed("m"), "") == key_seed("m")
    assert key_seed("m", "a") == salted_seed(key_seed("m"), "a") != key_seed("m")
