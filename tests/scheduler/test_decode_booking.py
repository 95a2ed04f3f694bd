"""S26-S32: decode, preemption, booking."""

from __future__ import annotations

import numpy as np
import pytest

from baton.engine.scheduler import EngineType, SchedulerConfig

from .utils import EOS, add_requests, create_requests, create_scheduler, drain, sampled, step


def _prefilled(n: int, prompt_len: int = 16, **overrides):
    sched = create_scheduler(prefill_attempt_interval=1000, prefill_any_attempt_interval=1000,
                             **overrides)
    add_requests(sched, create_requests(n, prompt_len=prompt_len), max_tokens=500)
    step(sched)
    return sched


def test_s26_lcfs_order_and_preemption_from_the_head() -> None:
    # 3 x 16-token prompts: one block each, 4 usable blocks
    sched = _prefilled(3, num_blocks=5, stop_preempted_request=True)
    with pytest.raises(ValueError, match="exceed num_speculative_tokens=0"):
        sched.set_draft_tokens("r0", [5])  # drafts are off here
    assert sched.num_free_blocks() == 1
    assert sched.num_preemptions() == 0
    out, _ = step(sched)  # 17 tokens: each needs a second block; 1 free
    # youngest first from the tail: r2 takes the free block, r1 gets the block of
    # the oldest, r0, preempted from the head
    assert out.finished == [("r0", "insufficient_system_resource")]
    assert out.request_ids == ["r2", "r1"]
    assert sched.num_preemptions() == 1
    assert sched.running_ids() == ["r1", "r2"]
    drain(sched)


def test_s26_sort_by_output_length() -> None:
    sched = _prefilled(3, num_speculative_tokens=2)
    sched.set_draft_tokens("r1", [5, 6])
    out = sched.schedule()
    rows = np.full((3, 3), 7, dtype=np.int32)
    sched.process_outputs(out, rows)  # r1 accepts 2 drafts: output 4
    out, _ = step(sched)
    assert out.request_ids[-1] == "r1"  # longest output served last, preempted first
    drain(sched)


def test_s26_lcfs_order_kept_when_the_running_pass_is_skipped() -> None:
    """After a step where every running sequence took one token and none finished, the next
    decode step skips the pass that drops finished sequences and checks LCFS order; every event
    that could break either (a finish, an abort, drafts, an arrival, a step in flight booked
    after the next was scheduled) must bring the pass back. check_invariants verifies the order
    whenever the skip is allowed; the batch order is checked against the ledgers here."""
    sched = create_scheduler(num_speculative_tokens=2, prefill_attempt_interval=6,
                             prefill_any_attempt_interval=6)
    add_requests(sched, create_requests(6, prompt_len=16), max_tokens=500, eos_token_ids=[EOS])
    step(sched)
    sched.abort_sequence("r5")

    def expect_lcfs(out) -> None:
        ages = [(sched.sequence_info(rid)["output_len"], sched.sequence_info(rid)["seq_id"])
                for rid in out.request_ids]
        assert ages == sorted(ages, key=lambda a: (-a[0], a[1]))[::-1], ages  # youngest first

    eos_left = 2
    for i in range(40):
        if i == 3:
            sched.abort_sequence("r2")
        if i in (2, 11):  # joins `running` when a later prompt step books it
            add_requests(sched, create_requests(1, prefix=f"late{i}-"), max_tokens=500)
        if i == 7:
            sched.set_draft_tokens("r1", [5, 6])
        if i % 5 == 4:  # two steps in flight, the older booked after the newer is scheduled
            first = sched.schedule()
            second = sched.schedule()
            sched.check_invariants()
            tokens = sampled(first)
            if not first.prompt_run and len(first) and eos_left:
                tokens[0] = EOS  # one sequence finishes while the next step is in flight
                eos_left -= 1
            sched.process_outputs(first, tokens)
            sched.check_invariants()
            sched.process_outputs(second, sampled(second))
        else:
            out = sched.schedule()
            sched.check_invariants()
            if not out.prompt_run:
                expect_lcfs(out)
            width = 3 if i == 7 else 1
            rows = np.full((len(out), width), 7, dtype=np.int32)
            sched.process_outputs(out, rows if width > 1 else rows[:, 0])
        sched.check_invariants()
    drain(sched)


def test_s26_admission_counts_the_slots_of_a_prefill_step_in_flight() -> None:
    """A decode step scheduled beside an unbooked prefill step admits from `prompted` only into
    the info slots left (the prompts of that step hold theirs): counting `running` admitted a
    fifth sequence under max_num_seqs 4, and the next full batch then dropped the oldest from
    `running` without finishing it (found by test_s42_window_traces)."""
    sched = create_scheduler(max_num_seqs=4, block_size=4, num_blocks=32)
    add_requests(sched, create_requests(2, prompt_len=4, prefix="a"), max_tokens=10)
    step(sched)
    sched.fork_seq("a0", "c", "b1")  # a prompt done: the child waits in `prompted`
    add_requests(sched, create_requests(2, prompt_len=4, prefix="d"), max_tokens=10)
    prefill = sched.schedule()
    assert prefill.prompt_run and len(prefill) == 2 and sched.num_used_info_slots() == 4
    decode = sched.schedule()  # two steps in flight: every slot is taken, c must wait
    assert not decode.prompt_run and len(decode) == 2 and sched.prompted_ids() == ["c"]
    assert sched.num_used_info_slots() == 4
    sched.process_outputs(prefill, sampled(prefill))
    full = sched.schedule()
    assert len(full) == 4 and sorted(sched.running_ids()) == ["a0", "a1", "d0", "d1"]
    sched.process_outputs(decode, sampled(decode))
    sched.process_outputs(full, sampled(full))
    done = set()
    for _ in range(30):  # every sequence runs to max_tokens, c included
        sched.check_invariants()
        out, res = step(sched)
        done |= {rid for rid, _ in [*out.finished, *res.finished]}
        if not sched.has_unfinished():
            break
    assert done == {"a0", "a1", "c", "d0", "d1"}
    drain(sched)


def test_s27_terminate_or_recompute() -> None:
    sched = _prefilled(2, num_blocks=3)  # 2 blocks, both used
    out, _ = step(sched)
    assert out.request_ids == ["r1"] and out.finished == []
    assert sched.waiting_ids() == ["r0"]  # recompute: back to the head of waiting
    info = sched.sequence_info("r0")
    assert info["status"] == 0 and info["num_tokens"] == 0 and info["block_table"] == []
    drain(sched)
    sched = create_scheduler(num_blocks=3, prefill_attempt_interval=1000)
    sched.add_sequence("so", [10] * 16, 50, structured_output=True)
    sched.add_sequence("b", [10] * 16, 50)
    step(sched)
    out, _ = step(sched)
    assert out.finished == [("so", "insufficient_system_resource")]  # never recomputed
    drain(sched)
    with pytest.raises(ValueError, match="stop_preempted_request"):
        SchedulerConfig(engine_type=EngineType.COMPLETION, stop_preempted_request=False)


def test_s28_append_slot_grows_and_shrinks() -> None:
    sched = _prefilled(1, prompt_len=14, num_speculative_tokens=4)
    assert len(sched.sequence_info("r0")["block_table"]) == 1
    sched.set_draft_tokens("r0", [1, 2, 3, 4])  # 15 + 4 = 19 tokens: 2 blocks
    out = sched.schedule()
    assert len(sched.sequence_info("r0")["block_table"]) == 2
    sched.process_outputs(out, np.array([[7, -1, -1, -1, -1]], dtype=np.int32))
    out = sched.schedule()  # all drafts rejected: 16 tokens fit one block again
    assert len(sched.sequence_info("r0")["block_table"]) == 1
    assert sched.sequence_info("r0")["num_blocks_needed"] == 2  # this step's token now in flight
    sched.process_outputs(out, sampled(out))
    drain(sched)


def test_s29_void_outputs_are_skipped() -> None:
    sched = _prefilled(2, num_blocks=5)
    out = sched.schedule()
    sched.abort_sequence("r0")
    res = sched.process_outputs(out, sampled(out))
    assert dict(zip(out.request_ids, res.num_accepted, strict=True))["r0"] == 0
    assert ("r0", "abort") in res.finished
    drain(sched)
    # preempted for recompute while a step is in flight: that step's output is void
    sched = _prefilled(2, prompt_len=15, num_blocks=3)
    first = sched.schedule()  # both decode at position 15, then both need a second block
    second = sched.schedule()
    assert second.request_ids == ["r1"] and sched.waiting_ids() == ["r0"]
    assert second.finished == []  # preempted for recompute, not finished
    res = sched.process_outputs(first, sampled(first))
    assert dict(zip(first.request_ids, res.num_accepted, strict=True)) == {"r0": 0, "r1": 1}
    assert sched.sequence_info("r0")["token_ids"][15:] == [7]  # only the prefill's token
    assert len(sched.sequence_info("r1")["block_table"]) == 2  # r0's block went to r1 at once

    sched.process_outputs(second, sampled(second))
    drain(sched)


def test_s30_prefill_done_joins_running_chunk_returns_to_waiting() -> None:
    sched = create_scheduler(max_num_batched_tokens=64)
    sched.add_sequence("a", [10] * 100, 4)
    out, res = step(sched)
    assert sched.waiting_ids() == ["a"] and list(res.num_accepted) == [0]
    out, res = step(sched)
    assert sched.running_ids() == ["a"] and list(res.num_accepted) == [1]
    drain(sched)


def test_s31_drafts_and_stop_checks() -> None:
    sched = _prefilled(1, num_speculative_tokens=3)
    sched.set_draft_tokens("r0", [20, 21, 22])
    out = sched.schedule()
    res = sched.process_outputs(out, np.array([[9, 20, -1, 22]], dtype=np.int32))
    assert list(res.num_accepted) == [2]  # stops at the first -1
    assert sched.sequence_info("r0")["token_ids"][-2:] == [20, 9]
    drain(sched)

    def finish(token, **kwargs):
        s = create_scheduler(max_model_len=kwargs.pop("max_model_len", 4096))
        s.add_sequence("x", [10] * 16, kwargs.pop("max_tokens", 100), **kwargs)
        reasons = []
        for _ in range(5):
            _, r = step(s, token=token)
            reasons += r.finished
        drain(s)
        return reasons

    assert finish(EOS, eos_token_ids=[EOS]) == [("x", "stop")]
    assert finish(EOS, eos_token_ids=[EOS], ignore_eos=True) == []
    assert finish(EOS, eos_token_ids=[EOS], ignore_eos=True, stop_token_ids=[EOS]) == [("x", "stop")]
    assert finish(7, max_tokens=3) == [("x", "length")]
    assert finish(7, max_model_len=18) == [("x", "length")]  # length 19 > 18


def test_s31_eos_among_accepted_drafts_stops_there() -> None:
    sched = _prefilled(1, num_speculative_tokens=3)
    sched.set_draft_tokens("r0", [20, 21, 22])
    out = sched.schedule()
    res = sched.process_outputs(out, np.array([[9, 20, 21, 22]], dtype=np.int32))
    assert list(res.num_accepted) == [4]
    drain(sched)
    sched = create_scheduler(num_speculative_tokens=3, prefill_attempt_interval=1000)
    sched.add_sequence("e", [10] * 16, 50, eos_token_ids=[EOS])
    step(sched)
    sched.set_draft_tokens("e", [20, EOS, 22])
    out = sched.schedule()
    res = sched.process_outputs(out, np.array([[9, 20, EOS, 22]], dtype=np.int32))
    assert list(res.num_accepted) == [2] and res.finished == [("e", "stop")]
    drain(sched)


def test_s32_ttft_and_pushed_tokens() -> None:
    sched = create_scheduler()
    sched.add_sequence("a", [10] * 16, 3)
    _, res = step(sched)
    [(rid, ttft)] = res.first_token_latencies
    assert rid == "a" and ttft >= 0.0
    assert sched.sequence_info("a")["first_token_latency"] == pytest.approx(ttft)
    step(sched)
    _, res = step(sched)
    assert res.finished == [("a", "length")] and res.pushed_tokens_before_finish == [("a", 3)]
    sched.add_sequence("b", [10] * 16, 3)
    out = sched.schedule()
    with pytest.raises(ValueError, match="2 sampled rows for 1"):
        sched.process_outputs(out, np.zeros(2, dtype=np.int32))
    sched.process_outputs(out, sampled(out))
    with pytest.raises(ValueError, match="already booked"):
        sched.process_outputs(out, sampled(out))
    drain(sched)


def _check_decode_rows(sched, out) -> None:
    """Every array of a decode step against the sequences' own ledgers after schedule()."""
    bs = sched.config.block_size
    n = len(out)
    q = np.asarray(out.seqlens_q)
    k = np.asarray(out.seqlens_k)
    tables = [sched.sequence_info(rid)["block_table"] for rid in out.request_ids]
    assert out.block_tables.shape == (n, max((len(t) for t in tables), default=0))
    t = 0
    for i, rid in enumerate(out.request_ids):
        info = sched.sequence_info(rid)
        pos = info["num_tokens"] + info["total_inflight_tokens"] - q[i]
        assert k[i] == pos + q[i]
        assert out.seq_ids[i] == info["seq_id"]
        row = list(out.block_tables[i])
        assert row == tables[i] + [0] * (len(row) - len(tables[i]))
        for j in range(q[i]):
            p = pos + j
            assert out.positions[t + j] == p
            assert out.slot_mapping[t + j] == tables[i][p // bs] * bs + p % bs
        tok = info["token_ids"]
        assert out.input_ids[t] == (tok[pos] if pos < len(tok) else -1)
        t += q[i]
    assert len(out.input_ids) == t == int(q.sum())
    if n:
        assert out.max_seqlen_q == q.max() and out.min_seqlen_k == k.min() and out.max_seqlen_k == k.max()
        assert out.sum_seqlen_qxk == int((q.astype(np.int64) * k).sum())


@pytest.mark.parametrize("block_size", [4, 5])
def test_s38_decode_rows_written_while_scheduling(block_size: int) -> None:
    """The decode rows are written as sequences are picked: staggered lengths
    (tables widen and the widest one leaves), drafts on some rows, a pool tight
    enough to preempt, and a step left in flight while the next is scheduled."""
    sched = create_scheduler(block_size=block_size, num_blocks=90, max_num_seqs=12,
                             num_speculative_tokens=2, prefill_attempt_interval=3,
                             prefill_any_attempt_interval=1000)
    rng = np.random.default_rng(0)
    for i in range(14):
        sched.add_sequence(f"s{i}", [10 + i] * int(rng.integers(3, 20)), int(rng.integers(4, 40)))
    pending = None
    for n_step in range(80):
        if n_step % 4 == 1:
            live = set(sched.live_request_ids())
            for rid in [r for r in sched.running_ids() if r in live][::3]:
                sched.set_draft_tokens(rid, [30, 31][: int(rng.integers(1, 3))])
        out = sched.schedule()
        if not out.prompt_run:
            _check_decode_rows(sched, out)
        width = max(1, out.max_seqlen_q)
        tokens = np.full((len(out), width), 7, dtype=np.int32)
        tokens[:, width - 1:] = np.where(rng.random((len(out), 1)) < 0.5, -1, 7) if width > 1 else 7
        if pending is not None:  # book the older step first, two in flight
            sched.process_outputs(*pending)
            pending = None
        if n_step % 5 == 0 and not out.prompt_run:
            pending = (out, tokens)
        else:
            sched.process_outputs(out, tokens)
        sched.check_invariants()
    if pending is not None:
        sched.process_outputs(*pending)
    drain(sched)


def test_s31_negative_sampled_token_is_refused_and_nothing_booked() -> None:
    sched = _prefilled(2)
    out = sched.schedule()
    before = [sched.sequence_info(rid)["token_ids"] for rid in out.request_ids]
    with pytest.raises(ValueError, match="negative sampled token id -3"):
        sched.process_outputs(out, np.array([7, -3], dtype=np.int32))
    assert [sched.sequence_info(rid)["token_ids"] for rid in out.request_ids] == before
    sched.process_outputs(out, sampled(out))  # the same step books once the tokens are valid
    drain(sched)


def test_s38_plain_decode_rows_over_many_steps() -> None:
    """The fast paths of a decode step (rows and booking written without the
    general code) against the ledgers: 48 sequences of staggered lengths cross
    block boundaries at different steps, outgrow their token reservation, stop
    on eos, on one of many stop ids (more than the inline stop set holds) and
    on length, while the caller keeps the previous step's output alive (so two
    output objects alternate, each with its own row cache) and new requests
    join. Every committed token must be the one sampled for that row."""
    sched = create_scheduler(num_blocks=2048, max_num_seqs=64, max_model_len=400,
                             prefill_attempt_interval=7, prefill_any_attempt_interval=1000)
    rng = np.random.default_rng(1)
    outputs: dict[str, list[int]] = {}

    def add(i: int) -> None:
        rid = f"p{i}"
        stop = [int(x) for x in rng.integers(2000, 2010, size=int(rng.integers(0, 6)))]
        sched.add_sequence(rid, [10 + i] * int(rng.integers(1, 40)), int(rng.integers(1, 600)),
                           eos_token_ids=[EOS], stop_token_ids=stop)
        outputs[rid] = []

    for i in range(48):
        add(i)
    previous = None
    for n_step in range(420):
        if n_step % 60 == 30:
            for i in range(48 + n_step, 52 + n_step):
                add(i)
        out = sched.schedule()
        if not out.prompt_run:
            _check_decode_rows(sched, out)
        draw = rng.random(len(out))
        tokens = np.where(draw < 0.0015, EOS, np.where(draw < 0.003, 2000 + (n_step % 10), 100 + n_step % 50))
        tokens = tokens.astype(np.int32)
        res = sched.process_outputs(out, tokens)
        for rid, tok, accepted in zip(out.request_ids, tokens, res.num_accepted, strict=True):
            if accepted:
                outputs[rid].append(int(tok))
        previous = out  # noqa: F841 - held like a caller that still reads the last step
        if n_step % 20 == 0:
            sched.check_invariants()
            for rid in sched.live_request_ids():
                info = sched.sequence_info(rid)
                assert info["token_ids"][info["prompt_len"]:] == outputs[rid]
    sched.check_invariants()
    drain(sched)
