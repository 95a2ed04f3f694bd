"""PROMPT and COMPLETION engines (S30, CONTRACTS.md) and abort in every state."""

from __future__ import annotations

import pytest

from baton.engine.scheduler import AllocStatus, EngineType

from .utils import EOS, create_scheduler, drain, sampled, step


def test_s30_prompt_mode_hands_off_with_blocks() -> None:
    sched = create_scheduler(engine_type=EngineType.PROMPT)
    sched.add_sequence("a", [10] * 40, 16)
    sched.add_sequence("eos", [10] * 8, 16, eos_token_ids=[EOS])
    out = sched.schedule()
    res = sched.process_outputs(out, sampled(out, token=EOS))
    assert res.finished == [("eos", "stop")]  # done on its first token: nothing to hand off
    [(rid, blocks)] = res.handed_off
    assert rid == "a" and len(blocks) == 3
    assert sched.num_free_blocks() == sched.num_total_blocks() - 3
    assert sched.num_handed_off() == 1 and not sched.has_unfinished()
    sched.release_handed_off("a")
    assert sched.num_free_blocks() == sched.num_total_blocks()
    with pytest.raises(KeyError, match="a"):
        sched.release_handed_off("a")
    drain(sched)


def test_completion_mode_allocate_commit_and_first_position() -> None:
    sched = create_scheduler(engine_type=EngineType.COMPLETION, stop_preempted_request=True,
                             num_blocks=6)
    status, blocks, *_ = sched.allocate_prompted("a", [10] * 40, 99, 8)
    assert status == AllocStatus.OK and len(blocks) == 3
    assert sched.allocate_prompted("b", [10] * 40, 99, 8)[0] == AllocStatus.LATER  # never partial
    assert sched.num_free_blocks() == 2
    assert sched.allocate_prompted("c", [10] * 100, 99, 8)[0] == AllocStatus.NEVER
    assert sched.allocate_prompted("d", [10] * 5000, 99, 8)[0] == AllocStatus.NEVER  # > max_model_len
    sched.commit_prompted("a")
    out = sched.schedule()
    assert list(out.input_ids) == [99] and list(out.positions) == [40]  # the first token at prompt_len
    assert list(out.seqlens_k) == [41]
    sched.process_outputs(out, sampled(out))
    assert sched.sequence_info("a")["output_len"] == 2
    with pytest.raises(KeyError, match="zzz"):
        sched.commit_prompted("zzz")
    drain(sched)


def test_completion_mode_free_prompted_and_first_token_stop() -> None:
    sched = create_scheduler(engine_type=EngineType.COMPLETION, stop_preempted_request=True)
    sched.allocate_prompted("a", [10] * 40, 99, 8)
    assert sched.free_prompted("a") is True
    assert sched.free_prompted("a") is False  # idempotent
    assert sched.num_free_blocks() == sched.num_total_blocks()
    sched.allocate_prompted("e", [10] * 40, EOS, 8, eos_token_ids=[EOS])
    sched.commit_prompted("e")
    out, _ = step(sched)
    assert out.finished == [("e", "stop")] and len(out) == 0
    sched.allocate_prompted("one", [10] * 40, 5, 1)
    sched.commit_prompted("one")
    out, _ = step(sched)
    assert out.finished == [("one", "length")]
    drain(sched)


@pytest.mark.parametrize("state", ["waiting", "chunking", "running", "in_flight", "handed_off",
                                   "allocated", "prompted"])
def test_abort_in_every_state(state: str) -> None:
    mode = {"handed_off": EngineType.PROMPT, "allocated": EngineType.COMPLETION,
            "prompted": EngineType.COMPLETION}.get(state, EngineType.NORMAL)
    sched = create_scheduler(engine_type=mode, stop_preempted_request=True,
                             max_num_batched_tokens=32, prefill_attempt_interval=1000)
    pending = None
    if mode == EngineType.COMPLETION:
        sched.allocate_prompted("x", [10] * 40, 9, 8)
        if state == "prompted":
            sched.commit_prompted("x")
    else:
        sched.add_sequence("x", [10] * 40, 8)
        if state != "waiting":
            step(sched)  # 32 of 40 tokens
        if state in ("running", "in_flight", "handed_off"):
            step(sched)
        if state == "in_flight":
            pending = sched.schedule()
    sched.abort_sequence("x")
    if pending is not None:
        sched.process_outputs(pending, sampled(pending))
    with pytest.raises(KeyError):
        for _ in range(3):
            step(sched)
            sched.abort_sequence("x")  # unknown once its finish was reported
    drain(sched)


def test_errors_name_the_bad_value() -> None:
    sched = create_scheduler()
    with pytest.raises(KeyError, match="nope"):
        sched.abort_sequence("nope")
    with pytest.raises(KeyError, match="nope"):
        sched.fork_seq("nope", "child")
    with pytest.raises(ValueError, match="num_blocks=1"):
        create_scheduler(num_blocks=1)
    with pytest.raises(ValueError, match="watermark=1.5"):
        create_scheduler(watermark=1.5)
    with pytest.raises(ValueError, match="block_size=-16"):
        create_scheduler(block_size=-16)
    with pytest.raises(ValueError, match="first_token_id=-1"):
        create_scheduler(engine_type=EngineType.COMPLETION, stop_preempted_request=True) \
            .allocate_prompted("a", [1], -1, 4)
