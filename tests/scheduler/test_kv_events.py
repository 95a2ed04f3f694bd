"""KV events of the prefix cache (cache-aware routing): what enters and leaves the index, the
net change per drain, the overflow bound, and nothing recorded while nobody listens."""

from __future__ import annotations

from baton.engine.scheduler import compute_block_keys

from .utils import create_caching_scheduler, create_scheduler, drain, step

SEED = 77
A = list(range(100, 108))  # two full blocks of 4
C = list(range(400, 408))


def cached_scheduler(**overrides):
    return create_caching_scheduler(SEED, **{"num_blocks": 8, **overrides})


def keys(tokens):
    return set(compute_block_keys(tokens, 4, SEED).tolist())


def drained(sched):
    ok, stored, removed = sched.drain_kv_events()
    return ok, set(stored.tolist()), set(removed.tolist())


def test_stored_then_evicted_keys_and_snapshot() -> None:
    sched = cached_scheduler()  # 7 usable blocks
    sched.set_kv_event_capacity(64)
    sched.add_sequence("a", A, 1)
    step(sched)
    assert drained(sched) == (True, keys(A), set())
    assert set(sched.prefix_cache_keys().tolist()) == keys(A)
    assert drained(sched) == (True, set(), set())  # nothing changed since
    sched.add_sequence("c", C, 1)
    step(sched)
    sched.add_sequence("d", list(range(500, 520)), 1)  # 5 blocks: 3 plain free, then a's 2
    step(sched)
    ok, stored, removed = drained(sched)
    assert ok and removed == keys(A)
    assert stored == keys(C) | keys(list(range(500, 520)))
    assert set(sched.prefix_cache_keys().tolist()) == stored
    sched.check_invariants()
    drain(sched)


def test_net_change_per_drain_and_reset() -> None:
    sched = cached_scheduler()
    sched.set_kv_event_capacity(64)
    sched.add_sequence("a", A, 1)
    step(sched)
    assert sched.reset_prefix_cache()  # a's keys stored and evicted before one drain
    assert drained(sched) == (True, set(), keys(A))  # net: gone (never seen held)
    assert len(sched.prefix_cache_keys()) == 0


def test_overflow_asks_for_a_snapshot() -> None:
    sched = cached_scheduler(num_blocks=16)
    sched.set_kv_event_capacity(3)
    sched.add_sequence("a", A + C, 1)  # four keys, one over the bound
    step(sched)
    assert drained(sched) == (False, set(), set())
    assert set(sched.prefix_cache_keys().tolist()) == keys(A + C)
    assert drained(sched) == (True, set(), set())  # the flag clears with the drain


def test_nothing_recorded_while_off() -> None:
    sched = cached_scheduler()
    sched.add_sequence("a", A, 1)
    step(sched)
    assert drained(sched) == (True, set(), set())
    sched.set_kv_event_capacity(8)  # a listener now starts from a snapshot
    assert set(sched.prefix_cache_keys().tolist()) == keys(A)
    sched.set_kv_event_capacity(0)
    sched.reset_prefix_cache()
    assert drained(sched) == (True, set(), set())


def test_caching_off_has_no_events() -> None:
    sched = create_scheduler(num_blocks=8, block_size=4)
    sched.set_kv_event_capacity(8)
    sched.add_sequence("a", A, 1)
    step(sched)
    assert drained(sched) == (True, set(), set())
    assert len(sched.prefix_cache_keys()) == 0
