"""S33-S40: step type, data-parallel voting, step outputs, prefill cadence."""

from __future__ import annotations

import threading

import numpy as np

from .utils import create_scheduler, drain, sampled, step


def _running_plus_waiting(**overrides):
    sched = create_scheduler(**overrides)
    sched.add_sequence("old", [10] * 16, 1000)
    step(sched)
    sched.add_sequence("new", [10] * 16, 1000)
    return sched


def test_s33_attempt_points() -> None:
    sched = _running_plus_waiting(prefill_attempt_interval=3, prefill_any_attempt_interval=100)
    kinds = []
    for _ in range(4):
        out, _ = step(sched)
        kinds.append(out.prompt_run)
    # decode_step 0 is an ALL point: prefill "new"; then 0 (no waiting), 1, 2 decode
    assert kinds == [True, False, False, False]
    sched.add_sequence("late", [10] * 16, 1000)
    out, _ = step(sched)  # decode_step 3: ALL point
    assert out.prompt_run and out.request_ids == ["late"]
    drain(sched)


def test_s40_decode_steps_between_prompt_steps() -> None:
    """A burst of prompts alternates with decode steps: after each prompt step, the running
    sequence gets `prefill_min_decode_steps` decode steps before the next prompt is tried;
    with 0 (the seed's rule) the burst runs back to back."""
    def kinds(gap: int) -> list[bool]:
        sched = create_scheduler(prefill_attempt_interval=1, prefill_any_attempt_interval=1,
                                 prefill_min_decode_steps=gap, max_num_batched_tokens=16)
        sched.add_sequence("old", [10] * 16, 1000)
        step(sched)
        for i in range(3):
            sched.add_sequence(f"burst-{i}", [11] * 16, 1000)
        seen = []
        for _ in range(9):
            out, _ = step(sched)
            seen.append(bool(out.prompt_run))
        drain(sched)
        return seen

    assert kinds(0) == [True, True, True] + [False] * 6
    assert kinds(2) == [False, False, True, False, False, True, False, False, True]


def test_s40_votes_stay_on_the_shared_counter() -> None:
    """Ranks vote only at decode-step counts every rank shares: a rank with nothing running
    skips the same attempt points as one with running sequences (no collective is missed)."""
    calls = []

    def reducer(v: int) -> int:
        calls.append(v)
        return v

    sched = create_scheduler(all_reduce_min=reducer, prefill_attempt_interval=1,
                             prefill_any_attempt_interval=1, prefill_min_decode_steps=3)
    sched.add_sequence("a", [10] * 16, 10)
    out, _ = step(sched)  # a prompt step: decode_step resets to 0
    assert out.prompt_run
    calls.clear()
    for _ in range(3):
        step(sched)  # decode_step 0, 1, 2: below the gap, no vote
    assert calls == []
    step(sched)  # decode_step 3: an attempt point again
    assert calls
    drain(sched)


def test_s33_any_wins_when_points_coincide() -> None:
    calls = []

    def reducer(v: int) -> int:
        calls.append(v)
        return v

    sched = _running_plus_waiting(all_reduce_min=reducer, prefill_attempt_interval=2,
                                  prefill_any_attempt_interval=2)
    out, _ = step(sched)  # decode_step 0: ALL only (ANY never at 0): want -> 1
    assert calls[:2] == [1, 0] and out.prompt_run
    calls.clear()
    step(sched)  # decode_step 0 again: ALL point, waiting empty: want -> 0, decode
    step(sched)  # decode_step 1: no point
    sched.add_sequence("x", [10] * 16, 100)
    calls.clear()
    out, _ = step(sched)  # decode_step 2: ANY and ALL: ANY sends want ? 0 : 1
    assert calls == [0, 0] and out.prompt_run
    drain(sched)


def test_s34_vote_1_min_semantics() -> None:
    # ALL point: another rank does not want prefill (sends 0): min 0, no prefill
    sched = _running_plus_waiting(all_reduce_min=lambda v: min(v, 0))
    out, _ = step(sched)
    assert not out.prompt_run and sched.waiting_ids() == ["old", "new"]
    drain(sched)
    # ANY point: another rank wants (sends 0): this rank, without work, joins with an empty step
    sched = create_scheduler(all_reduce_min=lambda v: min(v, 0), prefill_attempt_interval=1000,
                             prefill_any_attempt_interval=1)
    sched.add_sequence("a", [10] * 16, 100)
    out = sched.schedule()  # decode_step 0: ALL point, the other rank forbids
    assert not out.prompt_run
    sched.process_outputs(out, sampled(out))
    out = sched.schedule()  # decode_step 1: ANY point: someone wants -> prefill
    assert out.prompt_run and out.request_ids == ["a"]
    sched.process_outputs(out, sampled(out))
    drain(sched)


def test_s35_vote_2_empty_prompt_step_or_fallback() -> None:
    # Another rank scheduled something (sends 0): an empty prompt step keeps step types aligned
    script: list[int] = []
    sched = create_scheduler(all_reduce_min=lambda v: script.pop(0) if script else v,
                             max_num_seqs=1)
    sched.add_sequence("old", [10] * 16, 1000)
    step(sched)
    sched.add_sequence("new", [10] * 16, 1000)  # max_num_seqs reached: cannot schedule
    script += [1, 0]  # everyone wants prefill; another rank scheduled
    out = sched.schedule()
    assert out.prompt_run and len(out) == 0
    sched.process_outputs(out, sampled(out))
    drain(sched)
    # Nobody scheduled: fall back to decode
    sched = create_scheduler(max_num_seqs=1)
    sched.add_sequence("old", [10] * 16, 1000)
    step(sched)
    sched.add_sequence("new", [10] * 16, 1000)
    out = sched.schedule()
    assert not out.prompt_run and out.request_ids == ["old"]
    sched.process_outputs(out, sampled(out))
    drain(sched)


def test_s36_decode_step_counter_and_info_slots() -> None:
    sched = create_scheduler(prefill_attempt_interval=1000, num_speculative_tokens=1)
    sched.add_sequence("a", [10] * 16, 100)
    sched.add_sequence("b", [10] * 16, 100)
    step(sched)
    assert sched.decode_step() == 0
    for i in range(3):
        step(sched)
        assert sched.decode_step() == i + 1
        assert sched.num_used_info_slots() == sched.num_running() == 2
    sched.abort_sequence("a")
    step(sched)
    assert sched.num_used_info_slots() == sched.num_running() == 1
    drain(sched)


class _BarrierMin:
    """A real MIN all-reduce across threads."""

    def __init__(self, n: int) -> None:
        self.values = [0] * n
        self.barrier = threading.Barrier(n)
        self.done = threading.Barrier(n)

    def for_rank(self, rank: int):
        def reduce(v: int) -> int:
            self.values[rank] = v
            self.barrier.wait()
            result = min(self.values)
            self.done.wait()
            return result
        return reduce


def test_s37_single_rank_and_threaded_ranks() -> None:
    sched = create_scheduler(all_reduce_min=None)
    sched.add_sequence("a", [10] * 16, 4)
    out, _ = step(sched)
    assert out.prompt_run
    drain(sched)

    reducer = _BarrierMin(3)
    kinds: list[list[bool]] = [[] for _ in range(3)]
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            s = create_scheduler(all_reduce_min=reducer.for_rank(r), prefill_attempt_interval=4,
                                 prefill_any_attempt_interval=6)
            s.add_sequence(f"seed{r}", [10] * 16, 1000)
            for i in range(14):
                if r == 0 and i == 2:
                    s.add_sequence("only_rank0", [10] * 16, 1000)
                out, _ = step(s)
                kinds[r].append(out.prompt_run)
            drain(s)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            reducer.barrier.abort()
            reducer.done.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    assert kinds[0] == kinds[1] == kinds[2]  # every rank ran the same kind of step
    # rank 0's request waits out the ALL point (others don't want) and goes at ANY (decode_step 6)
    assert kinds[0][:1] == [True] and kinds[0].count(True) == 2


def test_s38_step_outputs() -> None:
    sched = create_scheduler(block_size=4, prefill_attempt_interval=1000)
    sched.add_sequence("a", list(range(10, 16)), 10)
    sched.add_sequence("b", list(range(20, 23)), 10)
    out = sched.schedule()
    assert out.prompt_run and out.num_batched_tokens == 9
    assert list(out.seqlens_q) == [6, 3] and list(out.seqlens_k) == [6, 3]
    assert out.block_tables.shape == (2, 2) and out.block_tables[1, 1] == 0  # padded with null
    assert list(out.input_ids) == list(range(10, 16)) + [20, 21, 22]
    assert list(out.positions) == [0, 1, 2, 3, 4, 5, 0, 1, 2]
    bt = out.block_tables
    assert out.slot_mapping[5] == bt[0, 1] * 4 + 1 and out.slot_mapping[8] == bt[1, 0] * 4 + 2
    assert out.sum_seqlen_qxk == 36 + 9 and out.max_seqlen_k == 6 and out.min_seqlen_k == 3
    assert out.clone_blocks.shape == (0, 2)
    sched.process_outputs(out, np.array([30, 40], dtype=np.int32))
    out = sched.schedule()
    assert list(out.seqlens_q) == [1, 1] and list(out.seqlens_k) == [4, 7]  # b then a (youngest first)
    assert list(out.input_ids) == [40, 30] and list(out.positions) == [3, 6]
    assert list(out.seq_ids) == [1, 0] and out.seq_ids.dtype == np.int64
    sched.process_outputs(out, sampled(out))
    drain(sched)


def test_s39_zero_copy_views() -> None:
    sched = create_scheduler()
    sched.add_sequence("a", [10] * 16, 4)
    out = sched.schedule()
    arr = out.seqlens_q
    assert not arr.flags.owndata and arr.base is not None
    assert arr.dtype == np.int32 and out.slot_mapping.dtype == np.int64
    assert out.request_ids == ["a"]
    res = sched.process_outputs(out, np.array([7], dtype=np.int32))
    assert not res.num_accepted.flags.owndata
    drain(sched)
