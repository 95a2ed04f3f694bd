"""S1-S14: sequence ledgers, statuses, pools and queues."""

from __future__ import annotations

import numpy as np
import pytest

from baton.engine.scheduler import (
    FINISH_REASONS,
    AllocStatus,
    BlockManager,
    EngineType,
    SequenceStatus,
)

from .utils import EOS, add_requests, create_requests, create_scheduler, drain, sampled, step


def test_s1_sequence_data_keeps_drafts_apart() -> None:
    sched = create_scheduler(num_speculative_tokens=2)
    sched.add_sequence("a", [10] * 20, 8)
    step(sched)
    info = sched.sequence_info("a")
    assert (info["prompt_len"], info["output_len"], len(info["token_ids"])) == (20, 1, 21)
    sched.set_draft_tokens("a", [30, 31])
    info = sched.sequence_info("a")
    assert len(info["token_ids"]) == 21  # drafts are not committed tokens
    assert info["num_blocks_needed"] == 2  # but they count for blocks: ceil(23 / 16)
    drain(sched)


def test_s2_kv_cache_state_advance_and_commit() -> None:
    sched = create_scheduler(num_speculative_tokens=2)
    sched.add_sequence("a", [10] * 32, 8)
    step(sched)
    assert sched.sequence_info("a")["num_tokens"] == 32
    sched.set_draft_tokens("a", [30, 31])
    out = sched.schedule()
    assert list(out.seqlens_q) == [3]
    res = sched.process_outputs(out, np.array([[7, 30, -1]], dtype=np.int32))
    # advanced by q=3, committed by the accepted count: 1 draft + the sampled token
    assert list(res.num_accepted) == [2]
    assert sched.sequence_info("a")["num_tokens"] == 34
    assert sched.sequence_info("a")["token_ids"][-2:] == [30, 7]
    drain(sched)


def test_s3_inflight_two_beat_pipeline() -> None:
    sched = create_scheduler(prefill_attempt_interval=70)
    sched.add_sequence("a", [10] * 16, 8)
    step(sched)
    first = sched.schedule()
    assert sched.sequence_info("a")["total_inflight_tokens"] == 1
    second = sched.schedule()  # scheduled before the first step is booked
    assert sched.sequence_info("a")["total_inflight_tokens"] == 2
    assert list(first.seqlens_k) == [17] and list(second.seqlens_k) == [18]
    assert list(second.input_ids) == [-1]  # sampled by the step still in flight
    assert list(second.positions) == [17]
    assert len(sched.sequence_info("a")["block_table"]) == 2
    sched.process_outputs(first, sampled(first))
    assert sched.sequence_info("a")["total_inflight_tokens"] == 1
    sched.process_outputs(second, sampled(second))
    assert sched.sequence_info("a")["total_inflight_tokens"] == 0
    assert sched.sequence_info("a")["num_tokens"] == 18
    drain(sched)


def test_s4_draft_and_structured_output_state() -> None:
    sched = create_scheduler(num_speculative_tokens=3)
    sched.add_sequence("a", [10] * 16, 8, structured_output=True)
    step(sched)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        sched.set_draft_tokens("a", [1, 2, 3, 4])
    sched.set_draft_tokens("a", [1, 2])
    out = sched.schedule()
    assert list(out.seqlens_q) == [3] and list(out.input_ids) == [7, 1, 2]
    sched.process_outputs(out, np.array([[9, 1, 2]], dtype=np.int32))
    assert sched.sequence_info("a")["accepted_tokens"] == [1, 2]
    assert sched.sequence_info("a")["info_slot"] >= 0
    drain(sched)


def test_s5_num_blocks_and_reserved_capacity() -> None:
    sched = create_scheduler()
    sched.add_sequence("a", [10] * 33, 100)
    info = sched.sequence_info("a")
    assert info["num_blocks_needed"] == 3  # ceil(33 / 16)
    assert info["block_table_capacity"] >= (33 + 100 + 15) // 16 + 1
    assert info["block_table"] == []  # reserved, not allocated
    drain(sched)


def test_s6_status_order_and_finish_reasons() -> None:
    names = [s.name for s in SequenceStatus]
    assert names == ["WAITING", "RUNNING", "SWAPPED", "FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED",
                     "FINISHED_ABORTED", "FINISHED_IGNORED", "FINISHED_PREEMPTED",
                     "FINISHED_SO_FAILED", "FINISHED_VE_FAILED"]
    assert [s.is_finished() for s in SequenceStatus] == [False] * 3 + [True] * 7
    assert FINISH_REASONS[SequenceStatus.FINISHED_PREEMPTED] == "insufficient_system_resource"
    sched = create_scheduler(max_model_len=64)
    sched.add_sequence("long", [10] * 65, 4)
    sched.add_sequence("eos", [10] * 8, 4, eos_token_ids=[EOS])
    out, res = step(sched, token=EOS)
    assert out.ignored == [("long", "prompt_length_exceeded")]
    assert res.finished == [("eos", "stop")]
    drain(sched)


def test_s7_abort_only_marks_and_queues_drop_it() -> None:
    sched = create_scheduler(prefill_attempt_interval=70)
    sched.add_sequence("blocked", [10] * 8, 4, schedulable=False)
    sched.add_sequence("dead", [10] * 8, 4)
    sched.abort_sequence("dead")
    assert sched.waiting_ids() == ["blocked", "dead"]  # marked, still queued
    out = sched.schedule()  # behind a blocked head, the dead one is still dropped
    assert ("dead", "abort") in out.finished
    assert sched.waiting_ids() == ["blocked"]
    sched.process_outputs(out, sampled(out))
    with pytest.raises(KeyError, match="dead"):
        sched.abort_sequence("dead")
    drain(sched)


def test_s8_finished_and_freed_are_two_moments() -> None:
    sched = create_scheduler(prefill_attempt_interval=70)
    sched.add_sequence("a", [10] * 40, 8)
    step(sched)
    used = sched.num_total_blocks() - sched.num_free_blocks()
    out = sched.schedule()  # a decode step reads a's blocks
    sched.abort_sequence("a")
    nxt = sched.schedule()  # a leaves `running` now ...
    assert ("a", "abort") in nxt.finished and sched.num_running() == 0
    assert sched.num_total_blocks() - sched.num_free_blocks() == used  # ... its blocks stay
    res = sched.process_outputs(out, sampled(out))
    assert list(res.num_accepted) == [0]
    assert sched.num_free_blocks() == sched.num_total_blocks()  # freed after the step
    sched.process_outputs(nxt, sampled(nxt))
    drain(sched)


def test_s9_block_manager_free_list_and_refs() -> None:
    bm = BlockManager(5)
    assert bm.num_total_blocks() == 4 and bm.free_list() == [1, 2, 3, 4]
    a, b = bm.allocate(), bm.allocate()
    assert (a, b) == (1, 2) and bm.ref_count(a) == 1
    bm.pin_block(a)
    assert bm.ref_count(a) == 2
    bm.free(a)
    assert bm.ref_count(a) == 1 and a not in bm.free_list()
    with pytest.raises(RuntimeError, match="in use"):
        bm.reset()
    bm.free(a)
    bm.free(b)
    assert bm.free_list() == [3, 4, 1, 2]  # freed blocks go to the tail
    with pytest.raises(RuntimeError, match="not allocated"):
        bm.free(b)
    with pytest.raises(KeyError):
        bm.free(0)  # the null block is never owned
    bm.reset()
    assert bm.free_list() == [1, 2, 3, 4]
    with pytest.raises(ValueError):
        BlockManager(1)


def test_s10_can_allocate_ok_later_never() -> None:
    bm = BlockManager(5)
    assert bm.can_allocate(4) == AllocStatus.OK
    assert bm.can_allocate(5) == AllocStatus.NEVER  # n >= num_blocks
    bm.allocate()
    assert bm.can_allocate(4) == AllocStatus.LATER
    with pytest.raises(ValueError, match="-1"):
        bm.can_allocate(-1)
    bm.free(1)
    sched = create_scheduler(num_blocks=4, block_size=16)
    sched.add_sequence("huge", [10] * 64, 4)  # needs 4 blocks of 3 usable: NEVER
    out, _ = step(sched)
    assert out.ignored == [("huge", "ignored")]
    drain(sched)


def test_s11_state_pool_turns_ok_into_later() -> None:
    sched = create_scheduler(num_state_slots=1)
    add_requests(sched, create_requests(2, prompt_len=16))
    out, _ = step(sched)
    assert out.request_ids == ["r0"]  # blocks OK, no second slot: LATER
    assert sched.waiting_ids() == ["r1"]
    assert sched.num_free_state_slots() == 0
    sched.abort_sequence("r0")
    step(sched)  # decode drops r0 and frees its slot
    out, _ = step(sched)
    assert out.request_ids == ["r1"]
    drain(sched)


def test_s12_watermark_blocks_prefill() -> None:
    sched = create_scheduler(num_blocks=12, block_size=16, prefill_attempt_interval=1)
    sched.add_sequence("big", [10] * 150, 100)  # 10 of 11 blocks
    step(sched)
    assert sched.get_gpu_cache_usage() > 0.9
    sched.add_sequence("new", [10] * 4, 4)
    out = sched.schedule()
    assert not out.prompt_run  # not wanted above the watermark
    assert sched.get_gpu_cache_usage(1) == pytest.approx(1.0)
    assert sched.waiting_ids() == ["new"]
    sched.process_outputs(out, sampled(out))
    drain(sched)


def test_s13_queues_waiting_running_prompted() -> None:
    sched = create_scheduler(engine_type=EngineType.COMPLETION, stop_preempted_request=True)
    status, blocks, *_ = sched.allocate_prompted("p", [10] * 20, 7, 8)
    assert status == AllocStatus.OK and len(blocks) == 2
    sched.commit_prompted("p")
    assert sched.prompted_ids() == ["p"] and sched.num_running() == 0
    out, _ = step(sched)
    assert out.request_ids == ["p"] and sched.running_ids() == ["p"]
    drain(sched)


def test_s14_add_sequence_allocates_nothing() -> None:
    sched = create_scheduler(num_blocks=4)
    add_requests(sched, create_requests(100, prompt_len=1000))
    assert sched.num_waiting() == 100
    assert sched.num_free_blocks() == sched.num_total_blocks()
    with pytest.raises(ValueError, match="duplicate request id r0"):
        sched.add_sequence("r0", [1], 1)
    with pytest.raises(ValueError, match="empty prompt"):
        sched.add_sequence("e", [], 1)
    with pytest.raises(ValueError, match="max_tokens=-3"):
        sched.add_sequence("n", [1], -3)
    with pytest.raises(ValueError, match="-5"):
        sched.add_sequence("t", [1, -5], 1)
    drain(sched)
