"""S15-S25: the prefill loop."""

from __future__ import annotations

import numpy as np
import pytest

from baton.engine.scheduler import EngineType

from .utils import EOS, add_requests, create_requests, create_scheduler, drain, sampled, step

IMG, PAD = 100, 101


def test_s15_unschedulable_head_blocks_the_queue() -> None:
    sched = create_scheduler()
    sched.add_sequence("img", [10] * 8, 4, schedulable=False)
    sched.add_sequence("txt", [10] * 8, 4)
    out, _ = step(sched)
    assert out.request_ids == [] and sched.waiting_ids() == ["img", "txt"]
    sched.set_schedulable("img")
    out, _ = step(sched)
    assert out.prompt_run and out.request_ids == ["img", "txt"]
    drain(sched)


def test_s16_fork_of_finished_prompt_goes_through_prompted() -> None:
    sched = create_scheduler(prefill_attempt_interval=70)
    sched.add_sequence("parent", [10] * 40, 8)
    step(sched)
    parent_table = sched.sequence_info("parent")["block_table"]
    assert len(parent_table) == 3
    sched.fork_seq("parent", "child", "b1")
    assert sched.prompted_ids() == ["child"]
    assert [sched.ref_count(b) for b in parent_table] == [2, 2, 2]  # pinned, not copied
    out = sched.schedule()
    tail, new = out.clone_blocks[0]
    assert tail == parent_table[-1]  # half written (40 % 16): cloned to a private block
    child_table = sched.sequence_info("child")["block_table"]
    assert child_table[:2] == parent_table[:2] and child_table[2] == new
    assert sched.ref_count(tail) == 2  # the child's ref now belongs to the step ...
    sched.check_invariants()
    sched.process_outputs(out, sampled(out))
    assert sched.ref_count(tail) == 1  # ... which gave it back when booked
    assert sorted(out.request_ids) == ["child", "parent"]
    sched.abort_sequence("parent")
    step(sched)
    assert [sched.ref_count(b) for b in parent_table[:2]] == [1, 1]  # still the child's
    drain(sched)


def test_s16_fork_with_its_own_last_token() -> None:
    """n > 1: each forked choice feeds its own first token; blocks pinned, tail cloned,
    every block back after; a choice whose own token stops it never runs."""
    sched = create_scheduler(prefill_attempt_interval=70)
    sched.add_sequence("p", [10] * 40, 8, eos_token_ids=[EOS])
    step(sched, token=7)
    table = sched.sequence_info("p")["block_table"]
    sched.fork_seq("p", "c1", "n", last_token_id=8)
    sched.fork_seq("p", "c2", "n", last_token_id=EOS)  # its own first token is EOS
    assert [sched.ref_count(b) for b in table] == [3, 3, 3]
    assert sched.sequence_info("c1")["token_ids"][-2:] == [10, 8]
    assert sched.sequence_info("p")["token_ids"][-1] == 7  # the parent keeps its own
    out = sched.schedule()
    assert dict(out.finished) == {"c2": "stop"}  # dropped at admission, its pins returned
    rows = dict(zip(out.request_ids, np.asarray(out.input_ids).tolist(), strict=True))
    assert rows == {"p": 7, "c1": 8}  # each row feeds its own token
    assert [list(p) for p in out.clone_blocks] == [
        [table[-1], sched.sequence_info("c1")["block_table"][-1]]]
    sched.process_outputs(out, sampled(out))
    assert [sched.ref_count(b) for b in table] == [2, 2, 1]  # c1 has its own tail now
    sched.check_invariants()
    sched.add_sequence("q", [10] * 8, 8)
    with pytest.raises(ValueError, match="only token without KV"):
        sched.fork_seq("q", "c3", last_token_id=9)  # q has no output to replace yet
    drain(sched)


def test_s16_fork_with_max_num_seqs_waits() -> None:
    sched = create_scheduler(prefill_attempt_interval=70, max_num_seqs=1)
    sched.add_sequence("parent", [10] * 32, 8)
    step(sched)
    sched.fork_seq("parent", "child")
    out, _ = step(sched)
    assert out.request_ids == ["parent"] and sched.prompted_ids() == ["child"]
    drain(sched)


def test_s18_fork_of_unfinished_prompt_is_a_prefix_hit() -> None:
    sched = create_scheduler(max_num_batched_tokens=40)
    sched.add_sequence("parent", [10] * 100, 8)
    step(sched)  # parent's first chunk: 40 tokens of KV in 3 blocks
    parent_table = sched.sequence_info("parent")["block_table"]
    sched.fork_seq("parent", "child", "b")
    assert sched.waiting_ids() == ["child", "parent"]
    assert sched.sequence_info("child")["branch_id"] == "_b"
    out = sched.schedule()
    assert out.request_ids == ["child"] and list(out.seqlens_q) == [40]  # starts at token 40
    info = sched.sequence_info("child")
    assert info["branch_id"] == "b"
    # 2 full blocks shared, the tail cloned, the rest new: ceil(100/16) - 40//16 = 5 allocated
    assert info["block_table"][:2] == parent_table[:2]
    assert len(info["block_table"]) == 7
    assert [list(p) for p in out.clone_blocks] == [[parent_table[2], info["block_table"][2]]]
    sched.process_outputs(out, sampled(out))
    sched.check_invariants()
    drain(sched)


def test_s17_prompt_limit_with_and_without_chunking() -> None:
    sched = create_scheduler(max_model_len=1000, max_num_batched_tokens=256)
    sched.add_sequence("b", [10] * 1001, 1)
    sched.add_sequence("a", [10] * 1000, 1)
    out, _ = step(sched)
    assert out.ignored == [("b", "prompt_length_exceeded")]
    assert out.request_ids == ["a"] and list(out.seqlens_q) == [256]  # chunked: up to max_model_len
    drain(sched)
    sched = create_scheduler(max_model_len=1000, max_num_batched_tokens=256,
                             enable_chunked_prefill=False)
    sched.add_sequence("a", [10] * 256, 1)
    sched.add_sequence("b", [10] * 257, 1)
    out, _ = step(sched)
    assert out.request_ids == ["a"] and out.ignored == [("b", "prompt_length_exceeded")]
    drain(sched)


def test_s19_three_limits_in_order() -> None:
    sched = create_scheduler(max_num_seqs=2)
    add_requests(sched, create_requests(3, prompt_len=8))
    out, _ = step(sched)
    assert out.request_ids == ["r0", "r1"]  # sequence count
    drain(sched)
    sched = create_scheduler(prefill_max_sum_seqlen_k=20)
    add_requests(sched, create_requests(3, prompt_len=8))
    out, _ = step(sched)
    assert out.request_ids == ["r0", "r1"]  # 8 + 8 <= 20 < 8 + 8 + 8
    drain(sched)
    sched = create_scheduler(max_num_batched_tokens=20, enable_chunked_prefill=False)
    add_requests(sched, create_requests(3, prompt_len=8))
    out, _ = step(sched)
    assert out.request_ids == ["r0", "r1"] and out.num_batched_tokens == 16  # token budget
    drain(sched)


def test_s19_counts_prompts_admitted_by_an_unbooked_step() -> None:
    # Two prefill steps scheduled before either is booked (the engine schedules ahead): the
    # second may admit only up to max_num_seqs counting the first step's prompts, which join
    # `running` at booking. Counting `running` alone admitted 6 of max 4.
    sched = create_scheduler(max_num_seqs=4, prefill_attempt_interval=2)
    add_requests(sched, create_requests(2, prefix="a"))
    for _ in range(3):
        step(sched)
    add_requests(sched, create_requests(4, prefix="b", start_token=300))
    first, second = sched.schedule(), sched.schedule()
    assert first.prompt_run and len(first) == 2
    assert sched.num_used_info_slots() == 4
    sched.process_outputs(first, sampled(first))
    sched.process_outputs(second, sampled(second))
    assert sched.num_running() == 4 and sched.num_waiting() == 2
    step(sched)
    sched.check_invariants()
    drain(sched)


def test_s20_cp_alignment() -> None:
    sched = create_scheduler(cp_size=2, max_num_batched_tokens=2047)
    sched.add_sequence("a", [10] * 3000, 1)
    out, _ = step(sched)
    assert list(out.seqlens_q) == [2044]  # a multiple of 2 * cp_size
    drain(sched)
    sched = create_scheduler(cp_size=2, max_num_batched_tokens=12)
    sched.add_sequence("a", [10] * 3, 1)
    sched.add_sequence("b", [10] * 9, 1)
    out, _ = step(sched)
    # a is charged 4, leaving 8: b is cut to 8
    assert list(out.seqlens_q) == [3, 8] and out.num_batched_tokens == 11 + 1
    drain(sched)


def test_s21_chunk_checkpoints() -> None:
    sched = create_scheduler()
    sched.add_sequence("a", [10] * 100, 1, chunk_checkpoints=[70, 40, 5])
    qs = []
    for _ in range(3):
        out, _ = step(sched)
        qs.append(list(out.seqlens_q))
    assert qs == [[5], [35], [30]]  # cut at each checkpoint: 5, 40, 70
    out, res = step(sched)
    assert out.prompt_run and list(out.seqlens_q) == [30]  # then the rest
    assert res.finished == [("a", "length")]
    drain(sched)


def test_s22_image_pad_runs_are_never_split() -> None:
    prompt = [10] * 10 + [IMG] + [PAD] * 20 + [10] * 10
    sched = create_scheduler(max_num_batched_tokens=20, image_token_id=IMG, image_pad_token_id=PAD)
    sched.add_sequence("a", prompt, 1)
    out, _ = step(sched)
    assert list(out.seqlens_q) == [10]  # moved back before the image start token
    drain(sched)
    prompt = [IMG] + [PAD] * 30 + [10] * 10
    sched = create_scheduler(max_num_batched_tokens=40, image_token_id=IMG, image_pad_token_id=PAD,
                             lookahead_tokens=0, prefill_max_sum_seqlen_k=0)
    sched.add_sequence("a", prompt, 1, chunk_checkpoints=[20])
    out, _ = step(sched)
    assert list(out.seqlens_q) == [31]  # nothing left before it: moved past the run
    drain(sched)


def test_s23_minimum_chunk() -> None:
    sched = create_scheduler(max_num_batched_tokens=2048, lookahead_tokens=8)
    sched.add_sequence("a", [10] * 2043, 1)
    sched.add_sequence("b", [10] * 100, 1)
    out, _ = step(sched)
    assert out.request_ids == ["a"]  # b's chunk would be 5 < 8
    out, _ = step(sched)
    assert out.request_ids == ["b"]
    drain(sched)


def test_s24_side_effects_and_one_chunk_per_step() -> None:
    sched = create_scheduler()
    sched.add_sequence("a", [10] * 100, 4, chunk_checkpoints=[40])
    sched.add_sequence("b", [10] * 10, 4)
    out = sched.schedule()
    assert out.request_ids == ["a"]  # NORMAL: stop after a chunk
    info = sched.sequence_info("a")
    assert info["status"] == 0 and info["chunked_rest_len"] == 60 and len(info["block_table"]) == 7
    assert sched.waiting_ids() == ["b"]
    sched.process_outputs(out, sampled(out))
    assert sched.waiting_ids() == ["a", "b"]
    drain(sched)
    sched = create_scheduler(engine_type=EngineType.PROMPT)
    sched.add_sequence("a", [10] * 100, 4, chunk_checkpoints=[40])
    sched.add_sequence("b", [10] * 10, 4)
    out = sched.schedule()
    assert out.request_ids == ["a", "b"]  # PROMPT: the loop goes on
    assert sched.sequence_info("b")["status"] == 1 and sched.sequence_info("b")["info_slot"] >= 0
    sched.process_outputs(out, sampled(out))
    drain(sched)


def test_s25_return_value() -> None:
    sched = create_scheduler(engine_type=EngineType.PROMPT)
    out = sched.schedule()
    assert out.prompt_run and len(out) == 0  # PROMPT: always a prefill output
    sched.process_outputs(out, sampled(out))
    sched = create_scheduler()
    out = sched.schedule()
    assert not out.prompt_run  # NORMAL: nothing to prefill falls back to decode
    sched.process_outputs(out, sampled(out))
    drain(sched)
