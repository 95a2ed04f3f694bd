"""S42 and P9: a sliding window releases the blocks no query still to come can see (no model)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baton.engine.scheduler import (
    AllocStatus,
    EngineType,
    SequenceStatus,
    compute_block_keys,
    kv_window,
)

from .utils import EOS, create_scheduler, drain, sampled, step, trace_samples

BS, W = 4, 8  # a window of two blocks


def _released(num_tokens: int) -> int:
    """S42's count, written out: blocks wholly before position num_tokens + 1 - W, never the
    block of the newest KV token."""
    return max(0, min((num_tokens + 1 - W) // BS, (num_tokens - 1) // BS))


def _held(info: dict) -> int:
    return sum(1 for b in info["block_table"] if b)


def test_s42_blocks_freed_as_the_window_moves() -> None:
    sched = create_scheduler(block_size=BS, num_blocks=32, sliding_window=W)
    sched.add_sequence("a", list(range(10, 20)), 20)
    out, _ = step(sched)  # the 10-token prompt: 3 blocks; KV for 10, window from 3: none out
    assert out.prompt_run
    info = sched.sequence_info("a")
    assert info["block_table"] == [1, 2, 3] and info["swa_valid_start"] == 0
    out, _ = step(sched)  # KV for 11: the next query (11) sees [4, 11], block 0 is behind
    info = sched.sequence_info("a")
    assert info["block_table"] == [0, 2, 3] and info["swa_valid_start"] == 4
    assert sched.num_free_blocks() == 31 - 2
    held = []
    for _ in range(12):
        out, _ = step(sched)
        info = sched.sequence_info("a")
        # The step's rows carry the null entries, and no new token lands in a released block.
        assert 0 not in np.asarray(out.slot_mapping) // BS
        num_tokens = info["num_tokens"]
        n = _released(num_tokens)
        assert info["block_table"][:n] == [0] * n and 0 not in info["block_table"][n:]
        assert info["swa_valid_start"] == n * BS
        assert len(info["block_table"]) == -(-num_tokens // BS)  # the layout is kept
        assert sched.num_free_blocks() == 31 - _held(info)
        held.append(_held(info))
        sched.check_invariants()
    # 23 tokens of KV in 2-3 blocks instead of 6.
    assert num_tokens == 23 and set(held) == {2, 3}
    assert sched.sequence_info("a")["block_table"] == [0, 0, 0, 0, 5, 6]
    drain(sched)


def test_s42_no_window_or_a_full_attention_layer_releases_nothing() -> None:
    assert kv_window([]) == 0
    assert kv_window([8, 8, 8]) == 8
    assert kv_window([8, 16]) == 16  # outside the widest window is outside every window
    assert kv_window([8, None, 8]) == 0  # Gemma 2: a global layer reads everything
    with pytest.raises(ValueError, match="layer windows"):
        kv_window([8, 0])
    with pytest.raises(ValueError, match="sliding_window=-1"):
        create_scheduler(sliding_window=-1)
    sched = create_scheduler(block_size=BS, num_blocks=32, sliding_window=0)
    sched.add_sequence("a", list(range(10, 20)), 20)
    for _ in range(14):
        step(sched)
    info = sched.sequence_info("a")
    assert info["num_tokens"] == 23 and info["block_table"] == [1, 2, 3, 4, 5, 6]
    assert sched.num_free_blocks() == 31 - 6
    drain(sched)


def test_s42_chunked_prefill_releases_between_chunks() -> None:
    """A 20-token prompt in chunks of 8: each booked chunk frees what the next one cannot see."""
    sched = create_scheduler(block_size=BS, num_blocks=32, sliding_window=W,
                             max_num_batched_tokens=8)
    sched.add_sequence("a", list(range(10, 30)), 4)
    out, _ = step(sched)  # tokens 0-7; all 5 blocks allocated on the first chunk (S24)
    assert list(out.seqlens_q) == [8]
    assert sched.sequence_info("a")["block_table"] == [1, 2, 3, 4, 5]  # 8 + 1 - 8 = 1: none
    out, _ = step(sched)  # tokens 8-15: the next chunk starts at 16 and sees [9, 16]
    assert list(out.seqlens_q) == [8]
    info = sched.sequence_info("a")
    assert info["block_table"] == [0, 0, 3, 4, 5] and info["swa_valid_start"] == 8
    out, _ = step(sched)  # tokens 16-19: the prompt is done, KV for 20, next query sees [13, 20]
    assert list(out.seqlens_q) == [4] and out.prompt_run
    assert sched.sequence_info("a")["block_table"] == [0, 0, 0, 4, 5]
    assert sched.num_running() == 1
    drain(sched)


def test_s42_preemption_recomputes_a_sequence_with_released_blocks() -> None:
    """Three 16-token prompts in 8 blocks: each holds 2-3 blocks once its prompt is booked, so
    the first decode step that needs three more preempts the oldest while it holds null entries;
    it is recomputed from its whole history (every block again) and released anew."""
    sched = create_scheduler(block_size=BS, num_blocks=9, sliding_window=W, max_num_seqs=3,
                             max_model_len=32)
    for rid in "abc":
        sched.add_sequence(rid, list(range(10, 26)), 14)
    step(sched)  # a and b (8 blocks), then 2 each after booking
    step(sched)  # c
    assert [sched.sequence_info(r)["block_table"][:2] for r in "abc"] == [[0, 0]] * 3
    assert sched.sequence_info("a")["swa_valid_start"] == 8
    out, _ = step(sched)  # every sequence needs its fifth block (position 16): 3 > 2 free
    assert sched.num_preemptions() == 1 and len(out) == 2
    info = sched.sequence_info("a")
    assert info["status"] == SequenceStatus.WAITING and sched.waiting_ids() == ["a"]
    assert info["block_table"] == [] and info["swa_valid_start"] == 0 and info["num_tokens"] == 0
    sched.check_invariants()
    while "a" not in sched.running_ids():  # back once b and c finish
        step(sched)
        sched.check_invariants()
    info = sched.sequence_info("a")
    assert info["num_tokens"] == 17 and info["block_table"][:2] == [0, 0]  # 5 allocated, 2 freed
    assert info["swa_valid_start"] == 8 and sched.num_free_blocks() == 8 - 3
    drain(sched)


def test_s42_abort_and_fork_with_released_blocks() -> None:
    sched = create_scheduler(block_size=BS, num_blocks=32, sliding_window=W)
    sched.add_sequence("a", list(range(10, 30)), 30)
    for _ in range(3):
        step(sched)
    parent = sched.sequence_info("a")
    assert parent["block_table"][:3] == [0, 0, 0]
    sched.fork_seq("a", "child", "b", last_token_id=9)  # shares only the blocks it still holds
    for b in parent["block_table"][3:]:
        assert sched.ref_count(b) == 2
    sched.check_invariants()
    out, _ = step(sched)  # the child joins: its own copy of the half-written last block
    assert set(sched.running_ids()) == {"a", "child"}
    child = sched.sequence_info("child")
    assert child["block_table"][:3] == [0, 0, 0] and child["swa_valid_start"] >= 12
    sched.abort_sequence("a")
    step(sched)
    sched.check_invariants()
    assert sched.num_free_blocks() == 31 - _held(sched.sequence_info("child"))
    drain(sched)


def test_s42_completion_allocates_only_in_window_blocks() -> None:
    """A 20-token prompt: the first decode query (20) sees [13, 20], so blocks 0-2 are neither
    allocated nor pulled; the table leads with them as null entries."""
    sched = create_scheduler(engine_type=EngineType.COMPLETION, stop_preempted_request=True,
                             block_size=BS, num_blocks=32, sliding_window=W)
    alloc = sched.allocate_prompted("a", list(range(10, 30)), 7, 10)
    assert alloc.status == AllocStatus.OK
    assert list(alloc.block_ids[:3]) == [0, 0, 0] and 0 not in alloc.block_ids[3:]
    assert len(alloc.block_ids) == 5 and alloc.num_cached_blocks == 3
    assert alloc.num_out_of_window_blocks == 3
    assert sched.num_free_blocks() == 31 - 2
    assert sched.sequence_info("a")["swa_valid_start"] == 12
    sched.commit_prompted("a")
    for _ in range(6):
        out, _ = step(sched)
        assert 0 not in np.asarray(out.slot_mapping) // BS
        sched.check_invariants()
    info = sched.sequence_info("a")
    assert info["num_tokens"] == 26 and info["block_table"][:_released(26)] == [0] * 4
    # A short prompt is pulled whole: its window reaches back to token 0.
    short = sched.allocate_prompted("b", list(range(40, 46)), 7, 10)
    assert short.num_cached_blocks == 0 and 0 not in short.block_ids
    sched.free_prompted("b")
    drain(sched)


def test_s42_prompt_engine_hands_off_every_block() -> None:
    sched = create_scheduler(engine_type=EngineType.PROMPT, block_size=BS, num_blocks=32,
                             sliding_window=W, max_num_batched_tokens=8)
    sched.add_sequence("a", list(range(10, 30)), 10)
    handed = []
    for _ in range(3):
        _, res = step(sched)
        handed += res.handed_off
    assert [(rid, list(ids)) for rid, ids in handed] == [("a", [1, 2, 3, 4, 5])]
    assert sched.num_free_blocks() == 31 - 5
    sched.release_handed_off("a")
    drain(sched)


def test_p9_released_blocks_stay_cached_and_hit() -> None:
    sched = create_scheduler(block_size=BS, num_blocks=32, sliding_window=W,
                             enable_prefix_caching=True)
    prompt = list(range(10, 26))  # 16 tokens: KV for 16, the next query sees [9, 16]
    sched.add_sequence("a", prompt, 10)
    step(sched)
    assert sched.sequence_info("a")["block_table"][:2] == [0, 0]
    assert sched.num_cached_blocks() == 2  # keyed, then freed: cached-free
    sched.add_sequence("b", prompt, 10)
    step(sched)
    # Blocks 0-1 from the cache (released by a), block 2 still owned by a: 12 tokens hit.
    assert sched.num_cached_prompt_tokens("b") == 12
    info = sched.sequence_info("b")
    assert info["block_table"][:2] == [0, 0]  # released again after b's prompt step
    assert sched.num_cached_blocks() == 2
    sched.check_invariants()
    drain(sched)


def test_p9_completion_hits_start_at_the_window() -> None:
    """A second pull of the same 20-token prompt: block 3 (the first inside the window) is a
    local hit although blocks 0-2 were never held here."""
    sched = create_scheduler(engine_type=EngineType.COMPLETION, stop_preempted_request=True,
                             block_size=BS, num_blocks=32, sliding_window=W,
                             enable_prefix_caching=True)
    prompt = list(range(10, 30))
    keys = compute_block_keys(prompt, BS, 0)  # the config's prefix_cache_seed
    first = sched.allocate_prompted("a", prompt, 7, 10, block_keys=keys)
    sched.commit_prompted("a")
    second = sched.allocate_prompted("b", prompt, 7, 10, block_keys=keys)
    assert second.status == AllocStatus.OK
    assert list(second.block_ids[:4]) == [0, 0, 0, first.block_ids[3]]
    assert second.num_cached_blocks == 4 and second.num_out_of_window_blocks == 3
    assert sched.ref_count(int(first.block_ids[3])) == 2
    sched.commit_prompted("b")
    sched.check_invariants()
    drain(sched)


OPS = ["add", "add", "step", "step", "step", "schedule", "book", "abort", "fork", "drafts", "prompted",
       "prompted", "commit", "commit"]
trace = st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 10_000)), min_size=10, max_size=50)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=trace, completion=st.booleans(), caching=st.booleans(), window=st.sampled_from([1, 5, 8]))
def test_s42_window_traces(ops, completion: bool, caching: bool, window: int) -> None:
    """Random traces (two steps in flight, drafts, forks, aborts, pulls, preemption in a small
    pool) keep every invariant, and after every booking no live sequence holds a block
    that S42 says is behind its window."""
    mode = EngineType.COMPLETION if completion else EngineType.NORMAL
    sched = create_scheduler(engine_type=mode, num_blocks=14, block_size=BS, max_num_seqs=4,
                             max_num_batched_tokens=12, max_model_len=64, sliding_window=window,
                             stop_preempted_request=completion, num_speculative_tokens=2,
                             enable_prefix_caching=caching, prefill_any_attempt_interval=3)
    pending, allocated, n = [], [], 0

    def check_windows():
        live = set(sched.live_request_ids())  # running keeps finished ones until a decode step
        for rid in [r for r in sched.running_ids() if r in live]:
            info = sched.sequence_info(rid)
            nt, table = info["num_tokens"], info["block_table"]
            released = 0 if nt <= 0 else max(0, min((nt + 1 - window) // BS, (nt - 1) // BS))
            if info["total_inflight_tokens"] == 0:
                assert table[:released] == [0] * released, (rid, nt, table)
            assert 0 not in table[info["swa_valid_start"] // BS:], (rid, table)

    for op, seed in ops:
        live = sched.live_request_ids()
        pick = live[seed % len(live)] if live else None
        if op == "add" and not completion:
            sched.add_sequence(f"q{n}", [10 + seed % 50] * (1 + seed % 40), 1 + seed % 12,
                               eos_token_ids=[EOS])
            n += 1
        elif op == "step" and not pending:
            out = sched.schedule()
            sched.process_outputs(out, trace_samples(len(out), seed, 1 + seed % 3, 5, 7))
        elif op == "schedule" and len(pending) < 2:
            pending.append(sched.schedule())
        elif op == "book" and pending:
            out = pending.pop(0)
            sched.process_outputs(out, sampled(out, 7 + seed % 5))
        elif op == "abort" and pick:
            sched.abort_sequence(pick)
            allocated[:] = [a for a in allocated if a != pick]
        elif op == "fork" and pick and pick not in allocated:
            try:
                sched.fork_seq(pick, f"f{n}", "b")
                n += 1
            except ValueError:
                pass  # finished, or a step in flight
        elif op == "drafts" and pick:
            sched.set_draft_tokens(pick, [8, 8][: seed % 3])
        elif op == "prompted" and completion:
            alloc = sched.allocate_prompted(f"c{n}", [11] * (1 + seed % 40), 12, 1 + seed % 12,
                                            eos_token_ids=[EOS])
            if alloc.status == AllocStatus.OK:
                allocated.append(f"c{n}")
            n += 1
        elif op == "commit" and allocated:
            sched.commit_prompted(allocated.pop(seed % len(allocated)))
        sched.check_invariants()
        check_windows()
    while pending:
        out = pending.pop(0)
        sched.process_outputs(out, sampled(out))
    for rid in allocated:
        sched.free_prompted(rid)
    drain(sched)
