"""The article's end-to-end walk-through: a long prompt, a decode step, a preemption."""

from __future__ import annotations

import numpy as np

from .utils import create_scheduler, drain, sampled


def test_article_walkthrough() -> None:
    sched = create_scheduler(max_num_seqs=4, max_num_batched_tokens=2048, block_size=16,
                             num_blocks=256, max_model_len=4096, enable_chunked_prefill=True,
                             stop_preempted_request=True, num_speculative_tokens=1,
                             prefill_attempt_interval=70, prefill_any_attempt_interval=100)
    sched.add_sequence("A", [11] * 3000, 2000)

    # Step 1: A is cut to the budget and stays WAITING with 952 tokens to go.
    out = sched.schedule()
    assert out.prompt_run and list(out.seqlens_q) == [2048]
    assert sched.sequence_info("A")["chunked_rest_len"] == 952
    assert len(sched.sequence_info("A")["block_table"]) == 188
    res = sched.process_outputs(out, sampled(out))
    assert list(res.num_accepted) == [0]
    assert sched.waiting_ids() == ["A"]

    # Step 2: A's rest and B, C whole in one prompt step.
    sched.add_sequence("B", [12] * 500, 2000)
    sched.add_sequence("C", [13] * 500, 2000)
    out = sched.schedule()
    assert out.prompt_run and list(out.seqlens_q) == [952, 500, 500]
    assert out.request_ids == ["A", "B", "C"]
    assert out.num_batched_tokens == 1952
    sched.process_outputs(out, sampled(out))
    assert sched.running_ids() == ["A", "B", "C"]
    assert sched.num_free_blocks() == 255 - 188 - 32 - 32

    # Step 3: a decode step, youngest first; A also verifies one draft so its
    # output is the longest (the article assumes so).
    sched.set_draft_tokens("A", [21])
    out = sched.schedule()
    assert not out.prompt_run
    assert sorted(out.seqlens_q) == [1, 1, 2]
    rows = np.full((3, 2), 7, dtype=np.int32)
    rows[:, 1] = -1
    rows[out.request_ids.index("A"), 1] = 21
    res = sched.process_outputs(out, rows)
    assert sorted(res.num_accepted) == [1, 1, 2]
    assert sched.sequence_info("A")["output_len"] == 3

    # Steps 4-5: decode until the pool runs dry; above the watermark no prefill is wanted.
    for _ in range(40):
        usage = sched.get_gpu_cache_usage()
        out = sched.schedule()
        if out.finished:
            break
        sched.process_outputs(out, sampled(out))
    assert usage > 0.9 and sched.num_free_blocks() > 0
    assert sched.sequence_info("B")["output_len"] == sched.sequence_info("C")["output_len"]
    assert out.finished == [("A", "insufficient_system_resource")]
    assert out.request_ids == ["C", "B"]
    assert list(out.seqlens_q) == [1, 1]
    sched.process_outputs(out, sampled(out))
    assert sched.running_ids() == ["B", "C"]  # kept oldest first for the next LCFS sort
    drain(sched)
