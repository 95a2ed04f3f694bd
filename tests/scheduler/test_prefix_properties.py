"""Property tests for prefix caching (P1-P8): random traces with shared prefixes, a small pool
(eviction, preemption), aborts, resets; every step keeps the pool invariants, and a KV oracle
(which token each slot was last written with) checks that every hit block holds the prompt's
tokens."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baton.engine.scheduler import AllocStatus, EngineType, compute_block_keys

from .utils import EOS, create_scheduler, drain, trace_samples

BS = 4
SEED = 77
# Prompts are drawn from a few shared stems, so hits (whole, partial, mid-block) are common.
STEMS = [[20 + (i * 7 + j) % 30 for j in range(24)] for i in range(3)]

OPS = ["add", "step", "schedule", "book", "abort", "drafts", "fork", "release", "prompted", "commit",
       "free_prompted", "reset"]
trace = st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 10_000)), max_size=50)


def _prompt(seed: int) -> list[int]:
    stem = STEMS[seed % len(STEMS)]
    cut = 1 + (seed // 3) % len(stem)
    tail = [60 + (seed // 7) % 5] * ((seed // 11) % 6)
    return stem[:cut] + tail


class KvOracle:
    """slot -> the token last written there by a scheduled step (or a pull); unknown slots
    (a token still in flight, a failed pull) are absent."""

    def __init__(self) -> None:
        self.slots: dict[int, int] = {}

    def record(self, out) -> None:
        for src, dst in out.clone_blocks.tolist():  # S16: copied before the step runs
            for j in range(BS):
                if dst and src * BS + j in self.slots:
                    self.slots[dst * BS + j] = self.slots[src * BS + j]
                elif dst:
                    self.slots.pop(dst * BS + j, None)
        for token, slot in zip(out.input_ids.tolist(), out.slot_mapping.tolist(), strict=True):
            if token >= 0:
                self.slots[slot] = token
            else:
                self.slots.pop(slot, None)

    def write_blocks(self, blocks, tokens, first_block: int) -> None:
        for b in range(first_block, len(blocks)):
            for j in range(BS):
                pos = b * BS + j
                if pos < len(tokens):
                    self.slots[int(blocks[b]) * BS + j] = tokens[pos]

    def forget_blocks(self, blocks) -> None:
        for b in blocks:
            for j in range(BS):
                self.slots.pop(int(b) * BS + j, None)

    def check_hit(self, sched, rid: str, num_hit_tokens: int, table) -> None:
        """A hit slot must hold the prompt's token: an unknown one (never written, or written by
        a token in flight or a failed pull) is a hit on garbage."""
        tokens = sched.sequence_info(rid)["token_ids"]
        for pos in range(num_hit_tokens):
            slot = int(table[pos // BS]) * BS + pos % BS
            held = self.slots.get(slot)
            assert held == tokens[pos], (rid, pos, held, tokens[pos])


def _run(mode: EngineType, ops, small_pool: bool) -> None:
    sched = create_scheduler(
        engine_type=mode, num_blocks=10 if small_pool else 40, block_size=BS, max_num_seqs=4,
        max_num_batched_tokens=24, max_model_len=64, stop_preempted_request=mode == EngineType.COMPLETION,
        num_speculative_tokens=2, prefill_attempt_interval=2, prefill_any_attempt_interval=3,
        enable_prefix_caching=True, prefix_cache_seed=SEED)
    kv = KvOracle()
    pending = []
    allocated: dict[str, tuple] = {}
    handed: list[str] = []
    n = 0

    def schedule():
        out = sched.schedule()
        kv.record(out)
        if out.prompt_run:
            for i, rid in enumerate(out.request_ids):
                start = int(out.seqlens_k[i] - out.seqlens_q[i])
                cached = sched.num_cached_prompt_tokens(rid)
                assert cached % BS == 0 and cached <= start
                kv.check_hit(sched, rid, start, out.block_tables[i])
        return out

    def book(out, seed):
        res = sched.process_outputs(out, trace_samples(len(out), seed, 1 + seed % 3, 3, 5))
        handed.extend(rid for rid, _ in res.handed_off)

    for op, seed in ops:
        live = sched.live_request_ids()
        pick = live[seed % len(live)] if live else None
        if op == "add" and mode != EngineType.COMPLETION:
            sched.add_sequence(f"q{n}", _prompt(seed), 1 + seed % 10, eos_token_ids=[EOS])
            n += 1
        elif op == "step" and not pending:
            book(schedule(), seed)
        elif op == "schedule" and len(pending) < 2:
            pending.append(schedule())
        elif op == "book" and pending:
            book(pending.pop(0), seed)
        elif op == "abort" and pick:
            sched.abort_sequence(pick)
            handed[:] = [h for h in handed if h != pick]
            if pick in allocated:
                blocks, _, num_cached = allocated.pop(pick)
                kv.forget_blocks(blocks[num_cached:])  # its cache hits stay valid for others
        elif op == "fork" and mode == EngineType.NORMAL and pick:
            try:
                sched.fork_seq(pick, f"f{n}", "b")  # S16 pins the parent's blocks, keyed or not
                n += 1
            except ValueError:
                pass  # finished, or a step in flight
        elif op == "release" and handed:
            sched.release_handed_off(handed.pop(seed % len(handed)))  # P7: into the cache
        elif op == "drafts" and pick and pick not in allocated:
            sched.set_draft_tokens(pick, [8, 8][: seed % 3])
        elif op == "prompted" and mode == EngineType.COMPLETION:
            prompt = _prompt(seed)
            keys = compute_block_keys(prompt, BS, SEED)
            alloc = sched.allocate_prompted(f"c{n}", prompt, 12, 1 + seed % 10, eos_token_ids=[EOS],
                                            block_keys=keys)
            if alloc.status == AllocStatus.OK:
                assert 0 <= alloc.num_cached_blocks < len(alloc.block_ids)
                assert sched.num_cached_prompt_tokens(f"c{n}") == alloc.num_cached_blocks * BS
                kv.check_hit(sched, f"c{n}", alloc.num_cached_blocks * BS, alloc.block_ids)
                allocated[f"c{n}"] = (np.array(alloc.block_ids), prompt, alloc.num_cached_blocks)
            n += 1
        elif op == "commit" and allocated:
            rid = sorted(allocated)[seed % len(allocated)]
            blocks, prompt, num_cached = allocated.pop(rid)
            kv.write_blocks(blocks, prompt, num_cached)  # the pull landed in the fresh blocks
            sched.commit_prompted(rid)
        elif op == "free_prompted" and allocated:
            rid = sorted(allocated)[seed % len(allocated)]
            blocks, _, num_cached = allocated.pop(rid)
            kv.forget_blocks(blocks[num_cached:])  # a failed pull may have written anything there
            assert sched.free_prompted(rid)
        elif op == "reset":
            assert sched.reset_prefix_cache() == (not allocated)
            if not allocated:
                assert sched.num_cached_blocks() == 0
        sched.check_invariants()
        assert sched.num_free_blocks() >= sched.num_cached_blocks()
    while pending:
        book(pending.pop(0), 1)
    for rid in list(allocated):
        sched.free_prompted(rid)
    for rid in handed:
        sched.release_handed_off(rid)
    drain(sched)
    stats = sched.prefix_cache_stats()
    assert 0 <= stats["hit_tokens"] <= stats["query_tokens"]
    return stats


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=trace, small_pool=st.booleans())
def test_p1_p8_normal_traces(ops, small_pool) -> None:
    _run(EngineType.NORMAL, ops, small_pool)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=trace, small_pool=st.booleans())
def test_p1_p8_prompt_traces(ops, small_pool) -> None:
    _run(EngineType.PROMPT, ops, small_pool)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=trace, small_pool=st.booleans())
def test_p1_p8_completion_traces(ops, small_pool) -> None:
    _run(EngineType.COMPLETION, ops, small_pool)
