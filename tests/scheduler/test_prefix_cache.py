"""Prefix caching (P1-P8): exact block ids, ref counts and cached-free counts, no model."""

from __future__ import annotations

import numpy as np
import pytest

from baton.engine.scheduler import AllocStatus, EngineType, SchedulerConfig, compute_block_keys

from .utils import create_caching_scheduler, create_scheduler, drain, step

SEED = 1234
A = list(range(100, 108))  # two full blocks of 4


def cached_scheduler(**overrides):
    return create_caching_scheduler(SEED, **{"num_blocks": 16, **overrides})


def table(sched, rid):
    return sched.sequence_info(rid)["block_table"]


def test_p1_keys_chain_over_full_blocks_only() -> None:
    keys = compute_block_keys(A + [1, 2], 4, SEED)
    assert keys.dtype == np.uint64 and len(keys) == 2  # the partial tail has no key
    assert list(compute_block_keys(A, 4, SEED)) == list(keys)
    assert compute_block_keys(A[4:], 4, int(keys[0]))[0] == keys[1]  # key(i) = H(key(i-1), block i)
    assert compute_block_keys(A, 4, SEED + 1)[0] != keys[0]  # the seed is key(-1)
    assert compute_block_keys([101] + A[1:], 4, SEED)[1] != keys[1]  # a change reaches every later key
    assert len(compute_block_keys(A[:3], 4, SEED)) == 0


def test_p3_hit_at_block_boundary() -> None:
    sched = cached_scheduler()
    sched.add_sequence("a", A, 8)
    step(sched)
    assert table(sched, "a") == [1, 2]
    sched.add_sequence("b", A + [200, 201, 202, 203], 8)
    out = sched.schedule()
    assert out.prompt_run and out.request_ids == ["b"]
    assert list(out.seqlens_q) == [4] and list(out.positions) == [8, 9, 10, 11]
    assert list(out.block_tables[0]) == [1, 2, 3]
    assert sched.ref_count(1) == 2 and sched.ref_count(2) == 2 and sched.ref_count(3) == 1
    assert sched.num_cached_prompt_tokens("b") == 8
    assert sched.num_cached_prompt_tokens("a") == 0
    assert sched.prefix_cache_stats() == {"query_tokens": 8 + 12, "hit_tokens": 8}
    sched.process_outputs(out, np.full(1, 7, dtype=np.int32))
    sched.check_invariants()
    drain(sched)
    assert sched.num_cached_blocks() == 3  # a's and b's full prompt blocks keep their keys


def test_p3_mid_block_tail_not_shared() -> None:
    sched = cached_scheduler()
    sched.add_sequence("a", A, 8)
    step(sched)
    sched.add_sequence("b", A[:6] + [300, 301, 302, 303], 8)  # block 1 differs from its third token
    out = sched.schedule()
    assert list(out.positions) == list(range(4, 10))
    assert list(out.block_tables[0]) == [1, 3, 4]
    assert sched.ref_count(1) == 2 and sched.ref_count(2) == 1
    assert sched.num_cached_prompt_tokens("b") == 4
    sched.process_outputs(out, np.full(1, 7, dtype=np.int32))
    drain(sched)


def test_p3_whole_prompt_hit_recomputes_last_block() -> None:
    sched = cached_scheduler()
    sched.add_sequence("a", A, 8)
    step(sched)
    sched.add_sequence("b", A, 8)
    out = sched.schedule()
    # Both blocks are cached, but the last token's logits are needed: block 1 is recomputed
    # into a fresh block.
    assert list(out.seqlens_q) == [4] and list(out.positions) == [4, 5, 6, 7]
    assert list(out.block_tables[0]) == [1, 3]
    assert sched.ref_count(1) == 2 and sched.ref_count(2) == 1
    assert sched.num_cached_prompt_tokens("b") == 4
    sched.process_outputs(out, np.full(1, 7, dtype=np.int32))
    drain(sched)


def test_p2_lru_eviction_when_free_list_is_empty() -> None:
    sched = cached_scheduler(num_blocks=8)  # 7 usable
    c = list(range(400, 408))
    sched.add_sequence("a", A, 1)  # one output token: finished when the prompt is booked
    step(sched)
    sched.add_sequence("c", c, 1)
    step(sched)
    # Freed last block first: a's block 2 is older in the LRU than its block 1.
    assert sched.num_cached_blocks() == 4 and sched.num_free_blocks() == 7
    sched.check_invariants()
    sched.add_sequence("d", list(range(500, 520)), 1)  # 5 blocks: 3 plain free, then the 2 oldest
    out = sched.schedule()
    assert list(out.block_tables[0]) == [5, 6, 7, 2, 1]
    assert sched.num_cached_blocks() == 2
    sched.process_outputs(out, np.full(1, 7, dtype=np.int32))
    sched.check_invariants()
    # d's five blocks are keyed too now: LRU [4, 3, 1, 2, 7, 6, 5].
    sched.add_sequence("c2", c, 1)  # c's first block survived; its fresh block evicts c's second
    out = sched.schedule()
    assert sched.num_cached_prompt_tokens("c2") == 4
    assert list(out.block_tables[0]) == [3, 4]
    sched.process_outputs(out, np.full(1, 7, dtype=np.int32))
    sched.add_sequence("a2", A, 1)  # evicted for d: no hit
    out = sched.schedule()
    assert sched.num_cached_prompt_tokens("a2") == 0
    assert list(out.block_tables[0]) == [1, 2]  # d's oldest blocks, evicted in turn
    sched.process_outputs(out, np.full(1, 7, dtype=np.int32))
    drain(sched)


def test_p5_output_blocks_reusable_by_next_turn() -> None:
    sched = cached_scheduler()
    sched.add_sequence("t1", A[:3], 8)  # 3 prompt tokens, 8 outputs: block 1 is filled by decode
    for _ in range(9):
        step(sched)
    assert "t1" not in sched.live_request_ids()
    assert sched.num_cached_blocks() == 2  # tokens 0-7 have KV; position 10's token never ran
    turn = A[:3] + [7] * 8 + [600, 601, 602]  # the whole first turn, then the user's reply
    sched.add_sequence("t2", turn, 8)
    out = sched.schedule()
    assert sched.num_cached_prompt_tokens("t2") == 8
    assert list(out.positions) == list(range(8, 14))
    assert list(out.block_tables[0])[:2] == [1, 2]
    sched.process_outputs(out, np.full(1, 7, dtype=np.int32))
    drain(sched)


def test_p6_abort_and_preempt_keep_shared_ref_counts() -> None:
    sched = cached_scheduler(num_blocks=7)  # 6 usable
    sched.add_sequence("a", A, 20)
    step(sched)
    sched.add_sequence("b", A + [200, 201, 202, 203], 20)
    step(sched)
    assert table(sched, "a") == [1, 2] and table(sched, "b") == [1, 2, 3]
    sched.abort_sequence("b")
    step(sched)
    sched.check_invariants()
    assert sched.ref_count(1) == 1 and sched.ref_count(2) == 1 and sched.ref_count(3) == 0
    assert sched.num_cached_blocks() == 1  # b's own block 3 keeps its key
    sched.add_sequence("c", A + [200, 201, 202, 203, 204], 20)  # hits 1, 2 and b's block 3
    step(sched)
    assert table(sched, "c")[:3] == [1, 2, 3]
    assert sched.num_cached_prompt_tokens("c") == 12
    # Decode until the pool runs dry: the oldest output is preempted (recomputed).
    for _ in range(12):
        out, _ = step(sched)
        sched.check_invariants()
        if out.finished or sched.num_waiting():
            break
    assert sched.num_waiting() == 1
    assert sched.num_preemptions() == 1  # recomputed, counted all the same
    victim = sched.waiting_ids()[0]
    survivor = ({"a", "c"} - {victim}).pop()
    assert sched.sequence_info(victim)["block_table"] == []
    assert sched.ref_count(1) == 1 and sched.ref_count(2) == 1  # still the survivor's
    assert table(sched, survivor)[:2] == [1, 2]
    drain(sched)


def test_p7_prompt_release_enters_cache() -> None:
    sched = cached_scheduler(engine_type=EngineType.PROMPT)
    sched.add_sequence("a", A, 8)
    _, res = step(sched)
    assert [(rid, list(b)) for rid, b in res.handed_off] == [("a", [1, 2])]
    assert list(sched.block_keys("a")) == list(compute_block_keys(A, 4, SEED))
    assert sched.num_cached_blocks() == 0  # leased: owned
    sched.release_handed_off("a")
    assert sched.num_cached_blocks() == 2 and sched.num_free_blocks() == sched.num_total_blocks()
    sched.add_sequence("b", A + [9], 8)
    _, res = step(sched)
    assert [(rid, list(b)) for rid, b in res.handed_off] == [("b", [1, 2, 3])]
    assert sched.num_cached_prompt_tokens("b") == 8
    sched.release_handed_off("b")
    sched.check_invariants()
    drain(sched)


def completion_scheduler():
    return cached_scheduler(engine_type=EngineType.COMPLETION, stop_preempted_request=True)


def test_p7_completion_allocate_prompted_with_keys() -> None:
    sched = completion_scheduler()
    prompt = A + [108, 109, 110, 111]  # three full blocks
    keys = compute_block_keys(prompt, 4, SEED)
    first = sched.allocate_prompted("a", prompt, 7, 2, block_keys=keys)
    assert first.status == AllocStatus.OK and list(first.block_ids) == [1, 2, 3]
    assert first.num_cached_blocks == 0  # nothing local yet: all pulled
    sched.commit_prompted("a")  # the pull landed: its keys are registered
    for _ in range(3):
        step(sched)
    assert "a" not in sched.live_request_ids() and sched.num_cached_blocks() == 3
    hit = sched.allocate_prompted("b", prompt, 7, 2, block_keys=keys)
    # At most all but the last prompt block: the last one is always pulled.
    # Block 4 (a's decode block, never full) went back to the plain free list's tail.
    assert list(hit.block_ids) == [1, 2, 5] and hit.num_cached_blocks == 2
    assert sched.num_cached_prompt_tokens("b") == 8
    assert sched.ref_count(1) == 1 and sched.ref_count(3) == 0
    unknown = sched.allocate_prompted("c", prompt, 7, 2, block_keys=compute_block_keys(prompt, 4, 99))
    assert unknown.num_cached_blocks == 0 and len(unknown.block_ids) == 3
    other = [1] + prompt[1:]  # the handle's keys, but block 0 holds other tokens
    differ = sched.allocate_prompted("d", other, 7, 2, block_keys=keys)
    assert differ.num_cached_blocks == 0
    no_keys = sched.allocate_prompted("e", prompt, 7, 2)
    assert no_keys.num_cached_blocks == 0
    with pytest.raises(ValueError, match="block keys"):
        sched.allocate_prompted("f", prompt, 7, 2, block_keys=list(keys) + [5])
    for rid in ("b", "c", "d", "e"):
        assert sched.free_prompted(rid)
    sched.check_invariants()
    # b's hits went back to cached-free with their keys; fresh blocks went back to free.
    assert sched.num_cached_blocks() == 3
    drain(sched)


def test_p8_reset_refused_while_allocation_uncommitted() -> None:
    sched = completion_scheduler()
    prompt = A + [108, 109, 110, 111]
    keys = compute_block_keys(prompt, 4, SEED)
    sched.allocate_prompted("a", prompt, 7, 2, block_keys=keys)
    sched.commit_prompted("a")
    for _ in range(3):
        step(sched)
    assert sched.num_cached_blocks() == 3
    pending = sched.allocate_prompted("b", prompt, 7, 2, block_keys=keys)
    assert pending.num_cached_blocks == 2
    assert sched.reset_prefix_cache() is False
    assert sched.num_cached_blocks() == 1  # block 3: not hit by b
    sched.commit_prompted("b")
    assert sched.reset_prefix_cache() is True
    assert sched.num_cached_blocks() == 0
    sched.check_invariants()
    # b's owned blocks kept their keys: a third copy still hits them.
    again = sched.allocate_prompted("c", prompt, 7, 2, block_keys=keys)
    assert again.num_cached_blocks == 2
    sched.commit_prompted("c")
    drain(sched)


def test_caching_off_is_todays_behaviour() -> None:
    sched = create_scheduler(num_blocks=16, block_size=4)
    sched.add_sequence("a", A, 8)
    step(sched)
    sched.add_sequence("b", A + [9], 8)
    out = sched.schedule()
    assert list(out.block_tables[0]) == [3, 4, 5] and list(out.positions) == list(range(9))
    assert sched.num_cached_prompt_tokens("b") == 0 and sched.num_cached_blocks() == 0
    assert sched.prefix_cache_stats() == {"query_tokens": 0, "hit_tokens": 0}
    assert len(sched.block_keys("b")) == 2  # still computable, for a PROMPT engine's handles
    sched.process_outputs(out, np.full(1, 7, dtype=np.int32))
    drain(sched)


def test_config_rejects_caching_with_state_pool() -> None:
    with pytest.raises(ValueError, match="num_state_slots"):
        SchedulerConfig(enable_prefix_caching=True, num_state_slots=4)
    with pytest.raises(ValueError, match="prefix_cache_seed"):
        SchedulerConfig(prefix_cache_seed=1 << 64)
    SchedulerConfig(enable_prefix_caching=True, prefix_cache_seed=(1 << 64) - 1).to_native()


def test_p1_a_sequence_keyed_from_its_own_seed_hits_only_its_tenant() -> None:
    """A cache salt gives a request its own key seed (key(-1)): its blocks hit only requests
    of the same seed, whatever the tokens, on a normal, a prompt and a completion engine."""
    salted = SEED + 1000
    sched = cached_scheduler()
    sched.add_sequence("a", A + [9], 8, key_seed=salted)
    step(sched)
    drain(sched)
    assert sched.num_cached_blocks() == 2
    sched.add_sequence("shared", A + [9], 8)  # the engine's seed: no hit on the salted blocks
    sched.add_sequence("other", A + [9], 8, key_seed=salted + 1)
    sched.add_sequence("same", A + [9], 8, key_seed=salted)
    step(sched)
    assert [sched.num_cached_prompt_tokens(r) for r in ("shared", "other", "same")] == [0, 0, 8]
    sched.check_invariants()
    drain(sched)

    prompt = cached_scheduler(engine_type=EngineType.PROMPT)
    prompt.add_sequence("a", A, 8, key_seed=salted)
    step(prompt)
    assert list(prompt.block_keys("a")) == list(compute_block_keys(A, 4, salted))
    assert list(prompt.block_keys("a")) != list(compute_block_keys(A, 4, SEED))
    prompt.release_handed_off("a")

    completion = completion_scheduler()
    tokens = A + [108, 109, 110, 111]
    keys = compute_block_keys(tokens, 4, salted)
    completion.allocate_prompted("a", tokens, 7, 2, block_keys=keys, key_seed=salted)
    completion.commit_prompted("a")
    drain(completion)
    # The same handle keys under another seed: the chain's first parent differs, no hit.
    miss = completion.allocate_prompted("b", tokens, 7, 2, block_keys=keys)
    hit = completion.allocate_prompted("c", tokens, 7, 2, block_keys=keys, key_seed=salted)
    assert (miss.num_cached_blocks, hit.num_cached_blocks) == (0, 2)
    for rid in ("b", "c"):
        assert completion.free_prompted(rid)
    completion.check_invariants()
