"""P10, a tier below the pool: the spill log of evictions and adopted blocks, no model."""

from __future__ import annotations

import numpy as np

from baton.engine.scheduler import compute_block_keys

from .utils import create_caching_scheduler, drain, step

SEED = 99
A = list(range(100, 112))  # three full blocks of 4
B = list(range(500, 512))


def tier_scheduler(**overrides):
    sched = create_caching_scheduler(SEED, **overrides)
    sched.set_spill_capacity(64)
    return sched


def run(sched, rid, prompt):
    sched.add_sequence(rid, prompt, 1)
    step(sched)
    drain(sched)


def test_p10_eviction_for_reuse_is_spilled_a_reset_is_not() -> None:
    sched = tier_scheduler(num_blocks=6)  # 5 usable blocks
    run(sched, "a", A + [1])  # a's three full blocks end cached-free
    keys, _, _, _ = sched.drain_spills()
    assert len(keys) == 0
    run(sched, "b", B + [2])  # 4 blocks, 2 plain free: evicts two of a's
    keys, parents, ids, tokens = sched.drain_spills()
    want = compute_block_keys(A, 4, SEED)
    assert len(keys) == 2 and set(keys.tolist()) <= set(want.tolist())
    for key, parent, block in zip(keys, parents, tokens, strict=True):
        i = want.tolist().index(int(key))
        assert parent == (want[i - 1] if i else SEED)
        assert block.tolist() == A[4 * i:4 * i + 4]  # the tokens the spilled bytes hold
    assert len(ids) == len(keys) and all(0 < b < 6 for b in ids)
    assert len(sched.drain_spills()[0]) == 0  # a drain empties the log
    assert sched.reset_prefix_cache()
    assert len(sched.drain_spills()[0]) == 0  # P8 drops blocks, it does not evict for reuse
    sched.check_invariants()


def test_p10_adopted_blocks_are_hit_by_the_next_admission() -> None:
    sched = tier_scheduler()
    prompt = A + [7]
    keys = compute_block_keys(prompt[:-1], 4, SEED)
    assert sched.num_held_prefix_blocks(keys) == 0
    ids = sched.adopt_blocks(A, SEED, 0, reserve=1)
    assert len(ids) == 3 and all(i > 0 for i in ids)
    assert sched.num_cached_blocks() == 3 and sched.num_held_prefix_blocks(keys) == 3
    sched.check_invariants()
    sched.add_sequence("a", prompt, 1)
    out = sched.schedule()
    assert list(out.block_tables[0][:3]) == ids.tolist()
    assert list(out.seqlens_q) == [1] and sched.num_cached_prompt_tokens("a") == 12
    sched.process_outputs(out, np.full(1, 7, dtype=np.int32))
    drain(sched)
    sched.check_invariants()


def test_p10_adoption_extends_the_held_run_and_never_evicts_it() -> None:
    sched = tier_scheduler(num_blocks=6)  # 5 usable blocks
    run(sched, "a", A[:4] + [1])  # block 0 of A cached-free
    run(sched, "f", B[:8] + [1])  # two more cached-free; the pool's LRU: A0, then B1, B0
    keys = compute_block_keys(A, 4, SEED)
    assert sched.num_held_prefix_blocks(keys) == 1
    assert sched.adopt_blocks(A, SEED, 2).tolist() == [-1]  # block 1 not held: nothing
    ids = sched.adopt_blocks(A, SEED, 1, reserve=1)
    assert all(i > 0 for i in ids) and sched.num_held_prefix_blocks(keys) == 3
    # room came from B's blocks (spilled), never from A's block 0
    spilled = set(sched.drain_spills()[0].tolist())
    assert int(keys[0]) not in spilled and spilled <= set(compute_block_keys(B[:8], 4, SEED).tolist())
    assert sched.adopt_blocks(A, SEED, 1).tolist() == [-1, -1]  # held already: nothing new
    sched.check_invariants()


def test_p10_adoption_keeps_the_reserve_free() -> None:
    sched = tier_scheduler(num_blocks=4)  # 3 usable blocks
    ids = sched.adopt_blocks(A, SEED, 0, reserve=1)
    assert all(i > 0 for i in ids[:2]) and ids[2] == -1
    assert sched.num_free_blocks() == 3 and sched.num_cached_blocks() == 2
    sched.check_invariants()


def test_p10_a_closing_reset_spills_every_cached_block() -> None:
    sched = tier_scheduler()
    run(sched, "a", A + [1])
    assert sched.reset_prefix_cache(spill=True)
    keys, _, ids, _ = sched.drain_spills()
    assert sorted(keys.tolist()) == sorted(compute_block_keys(A, 4, SEED).tolist())
    assert sched.num_cached_blocks() == 0 and sched.num_free_blocks() == sched.num_total_blocks()
    sched.check_invariants()
