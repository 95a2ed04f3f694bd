"""Property tests: random traces keep every pool and queue invariant (S9, S13)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baton.engine.scheduler import AllocStatus, EngineType

from .utils import EOS, create_scheduler, drain, trace_samples

OPS = ["add", "step", "schedule", "book", "abort", "fork", "drafts", "release", "prompted",
       "commit", "free_prompted"]

trace = st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 10_000)), max_size=40)


def _run(mode: EngineType, ops, stop_preempted: bool, state_slots: int, production: bool) -> None:
    """production: block size 16 and no speculation, as the engines run; otherwise block size 4
    with two drafts, so that a short trace crosses many block boundaries and verifies drafts."""
    sched = create_scheduler(
        engine_type=mode, num_blocks=24, block_size=16 if production else 4, max_num_seqs=4,
        max_num_batched_tokens=24, max_model_len=64,
        stop_preempted_request=stop_preempted or mode == EngineType.COMPLETION,
        num_state_slots=state_slots, num_speculative_tokens=0 if production else 2,
        prefill_attempt_interval=2, prefill_any_attempt_interval=3)
    pending = []  # at most one step in flight besides the one being booked
    handed, allocated = [], []
    n = 0

    def book(out, seed):
        width = 1 if production else 1 + (seed % 3)
        res = sched.process_outputs(out, trace_samples(len(out), seed, width, 5, 7))
        handed.extend(rid for rid, _ in res.handed_off)

    for op, seed in ops:
        live = sched.live_request_ids()
        pick = live[seed % len(live)] if live else None
        if op == "add" and mode != EngineType.COMPLETION:
            sched.add_sequence(f"q{n}", [10 + seed % 50] * (1 + seed % 40), 1 + seed % 12,
                               eos_token_ids=[EOS], structured_output=seed % 5 == 0,
                               chunk_checkpoints=[seed % 17] if seed % 3 == 0 else [])
            n += 1
        elif op == "step" and not pending:
            book(sched.schedule(), seed)
        elif op == "schedule" and len(pending) < 2:
            pending.append(sched.schedule())
        elif op == "book" and pending:
            book(pending.pop(0), seed)
        elif op == "abort" and pick:
            sched.abort_sequence(pick)
            handed[:] = [h for h in handed if h != pick]
            allocated[:] = [a for a in allocated if a != pick]
        elif op == "fork" and pick and pick not in handed and pick not in allocated:
            try:
                sched.fork_seq(pick, f"f{n}", "b")
                n += 1
            except ValueError:
                pass  # finished, or a step in flight
        elif op == "drafts" and pick and not production:
            sched.set_draft_tokens(pick, [8, 8][: seed % 3])
        elif op == "release" and handed:
            sched.release_handed_off(handed.pop(seed % len(handed)))
        elif op == "prompted" and mode == EngineType.COMPLETION:
            status, *_ = sched.allocate_prompted(f"c{n}", [11] * (1 + seed % 40), 12, 1 + seed % 12,
                                                eos_token_ids=[EOS])
            if status == AllocStatus.OK:
                allocated.append(f"c{n}")
            n += 1
        elif op == "commit" and allocated:
            sched.commit_prompted(allocated.pop(seed % len(allocated)))
        elif op == "free_prompted" and allocated:
            sched.free_prompted(allocated.pop(seed % len(allocated)))
        sched.check_invariants()
    while pending:
        book(pending.pop(0), 1)
    for rid in handed:
        sched.release_handed_off(rid)
    drain(sched)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=trace, stop_preempted=st.booleans(), state_slots=st.sampled_from([0, 3]),
       production=st.booleans())
def test_s9_s13_normal_traces(ops, stop_preempted, state_slots, production) -> None:
    _run(EngineType.NORMAL, ops, stop_preempted, state_slots, production)


@settings(max_examples=40, deadline=None)
@given(ops=trace, state_slots=st.sampled_from([0, 3]), production=st.booleans())
def test_s9_s13_prompt_traces(ops, state_slots, production) -> None:
    _run(EngineType.PROMPT, ops, False, state_slots, production)


@settings(max_examples=40, deadline=None)
@given(ops=trace, state_slots=st.sampled_from([0, 3]), production=st.booleans())
def test_s9_s13_completion_traces(ops, state_slots, production) -> None:
    _run(EngineType.COMPLETION, ops, True, state_slots, production)
