"""KV events per tier (docs/scheduler.md P10): a real scheduler with a disk tier's keys, through
the real wire encoding into the router's index, which tells pool blocks from disk blocks, and
the scorer that prices a disk block between a pool block and a new one."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from baton import protocol
from baton.engine.kv_events import KvEventPublisher, KvEventSource
from baton.protocol import KvEvents, ResetPrefixCache
from router.kv_index import KvIndex, RequestKeys
from router.selection import Candidate, OverlapMinusLoad
from tests.scheduler.utils import create_scheduler, drain

SEED = 4242
BS = 4
TOKENS = list(range(100, 125))  # 6 full blocks and one token


class FakeDisk:
    """A disk tier's event side only (its files are tests/engine/test_kv_disk.py's)."""

    def __init__(self) -> None:
        self.held: set[int] = set()
        self.stored: list[int] = []
        self.removed: list[int] = []
        self.store = SimpleNamespace(capacity_blocks=64)

    def drain_events(self):
        out, self.stored, self.removed = (self.stored, self.removed), [], []
        return out

    def keys(self) -> list[int]:
        return sorted(self.held)


def _wire(msg: KvEvents) -> KvEvents:
    decoded = protocol.decode_to_router(protocol.encode(msg))
    assert isinstance(decoded, KvEvents)
    return decoded


def test_p10_events_carry_the_tier_and_the_index_credits_each() -> None:
    sched = create_scheduler(enable_prefix_caching=True, prefix_cache_seed=SEED, num_blocks=32,
                             block_size=BS)
    disk = FakeDisk()
    pub = KvEventPublisher(KvEventSource(sched, BS, SEED, sched.num_total_blocks(), disk),
                           instance_id="inst-1")
    keys = RequestKeys(TOKENS).keys_for(BS, SEED)
    disk.held = set(keys[2:5])
    index = KvIndex()
    snapshot = _wire(pub.subscribe(b"router", nonce=1))
    assert snapshot.num_disk_blocks == 64
    assert index.apply("e", snapshot)
    request = RequestKeys(TOKENS)
    assert index.overlap("e", request) == 0 and index.disk_overlap("e", request) == 0
    sched.add_sequence("a", TOKENS[:9], 1)  # two blocks into the pool
    out = sched.schedule()
    sched.process_outputs(out, np.full(1, 7, dtype=np.int32))
    drain(sched)
    assert index.apply("e", _wire(pub.poll()))
    assert index.overlap("e", request) == 2 and index.disk_overlap("e", request) == 3
    disk.removed = [keys[3]]
    disk.held.discard(keys[3])
    delta = _wire(pub.poll())
    assert delta.disk_removed and not delta.stored
    assert index.apply("e", delta)
    assert index.disk_overlap("e", request) == 1  # the chain stops at the removed block


def test_p10_a_disk_block_costs_less_than_a_new_one_and_more_than_a_pool_one() -> None:
    keys = RequestKeys(TOKENS).keys_for(BS, SEED)
    index = KvIndex()
    for engine, pool, disk in (("pool", keys[:4], []), ("disk", keys[:1], keys[1:4]),
                               ("cold", [], [])):
        index.apply(engine, KvEvents("i-" + engine, 0, is_snapshot=True,
                                     stored=protocol.pack_keys(pool), block_size=BS,
                                     seed=SEED, num_total_blocks=32,
                                     disk_stored=protocol.pack_keys(disk), num_disk_blocks=32))
    policy = OverlapMinusLoad(index)
    request = RequestKeys(TOKENS)
    assert policy.select("normal", [Candidate("cold"), Candidate("disk"), Candidate("pool")],
                         request).engine_id == "pool"
    choice = policy.select("prompt", [Candidate("cold"), Candidate("disk")], request)
    assert choice.engine_id == "disk" and choice.num_overlap_blocks == 4
    assert choice.num_disk_blocks == 3 and choice.num_active_blocks == 3  # 7 blocks, 4 held
    # Four blocks of queued work outweigh what its pool block and 3 disk blocks save (1 + 2.1)
    assert policy.select("normal", [Candidate("cold"), Candidate("disk", num_active_blocks=3)],
                         request).engine_id == "disk"
    assert policy.select("normal", [Candidate("cold"), Candidate("disk", num_active_blocks=4)],
                         request).engine_id == "cold"
    # A weight of 0 treats disk blocks as new ones: only the pool block counts.
    flat = OverlapMinusLoad(index, disk_weight=0.0)
    assert flat.select("normal", [Candidate("disk", num_active_blocks=2), Candidate("cold")],
                       request).engine_id == "cold"


def test_p11_a_shared_block_is_every_engine_of_its_tier_and_costs_less_than_a_new_one() -> None:
    keys = RequestKeys(TOKENS).keys_for(BS, SEED)
    index = KvIndex()
    tier = "redis://baton@kv:6379/0#bkv:0123456789abcdef:"
    for engine, pool, shared, tier_id in (("writer", keys[:1], keys[:5], tier),
                                          ("reader", [], [], tier),
                                          ("elsewhere", [], [], "redis://other:6379/0#bkv:x:"),
                                          ("cold", [], [], "")):
        assert index.apply(engine, _wire(KvEvents(
            "i-" + engine, 0, is_snapshot=True, stored=protocol.pack_keys(pool), block_size=BS,
            seed=SEED, num_total_blocks=32, shared_stored=protocol.pack_keys(shared),
            num_shared_blocks=64 if tier_id else 0, shared_tier=tier_id)))
    request = RequestKeys(TOKENS)
    # The writer's own pool block first, then the store's; the reader reaches the same store.
    assert index.overlap("writer", request) == 1 and index.shared_overlap("writer", request) == 4
    assert index.shared_overlap("reader", request) == 5
    assert index.shared_overlap("elsewhere", request) == 0
    assert index.shared_overlap("cold", request) == 0
    policy = OverlapMinusLoad(index)
    choice = policy.select("prompt", [Candidate("cold"), Candidate("reader")], request)
    assert choice.engine_id == "reader" and choice.num_shared_blocks == 5
    assert choice.num_overlap_blocks == 5 and choice.num_active_blocks == 2
    # Five shared blocks save 4.5 blocks of compute at the measured weight: more than 3 queued.
    assert policy.select("normal", [Candidate("cold"), Candidate("reader", num_active_blocks=3)],
                         request).engine_id == "reader"
    flat = OverlapMinusLoad(index, shared_weight=0.0)
    assert flat.select("normal", [Candidate("reader", num_active_blocks=1), Candidate("cold")],
                       request).engine_id == "cold"
    # A delta removing a key (the store evicted it, the reader saw it missing) cuts the chain.
    assert index.apply("writer", _wire(KvEvents("i-writer", 1,
                                                shared_removed=protocol.pack_keys(keys[2:3]))))
    assert index.shared_overlap("reader", request) == 2
    # A snapshot naming a tier without a bound (or a bound without a tier) breaks the rules.
    assert not index.apply("bad", KvEvents("i-bad", 0, is_snapshot=True, block_size=BS,
                                           seed=SEED, num_total_blocks=32, shared_tier=tier))


def test_p11_a_reset_clears_the_store_only_when_asked_and_never_with_pool_only(make_client):
    client = make_client()
    both = client.post("/reset_prefix_cache", params={"pool_only": "true", "shared": "true"})
    assert both.status_code == 400 and both.json()["error"]["param"] == "shared"
    assert ResetPrefixCache(7, shared=True).shared and not ResetPrefixCache(7).shared
    decoded = protocol.decode_to_engine(protocol.encode(ResetPrefixCache(7, False, True)))
    assert isinstance(decoded, ResetPrefixCache) and decoded.shared and not decoded.pool_only
