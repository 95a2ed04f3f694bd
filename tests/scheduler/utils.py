"""Helpers for scheduler tests: no model, hand-made step outputs."""

from __future__ import annotations

import numpy as np

from baton.engine.scheduler import Scheduler, SchedulerConfig

EOS = 2


def create_scheduler(all_reduce_min=None, **overrides) -> Scheduler:
    """A small scheduler; every rule's knob can be overridden."""
    fields = dict(num_blocks=256, block_size=16, max_num_seqs=16, max_num_batched_tokens=2048,
                  max_model_len=4096, enable_chunked_prefill=True, stop_preempted_request=False,
                  prefill_attempt_interval=1, prefill_any_attempt_interval=100)
    fields.update(overrides)
    return Scheduler(SchedulerConfig(**fields), all_reduce_min=all_reduce_min)


def create_caching_scheduler(seed: int, num_blocks: int = 8, **overrides) -> Scheduler:
    """A small scheduler with prefix caching on (blocks of 4 tokens, key seed `seed`)."""
    return create_scheduler(**{"enable_prefix_caching": True, "prefix_cache_seed": seed,
                               "num_blocks": num_blocks, "block_size": 4, **overrides})


def create_requests(n: int, prompt_len: int = 32, max_tokens: int = 16, prefix: str = "r",
                    start_token: int = 10) -> list[tuple[str, list[int]]]:
    """`n` (request_id, prompt) pairs; token ids avoid EOS."""
    return [(f"{prefix}{i}", [start_token + (i + j) % 1000 for j in range(prompt_len)])
            for i in range(n)]


def add_requests(sched: Scheduler, requests, max_tokens: int = 16, **kwargs) -> None:
    for rid, prompt in requests:
        sched.add_sequence(rid, prompt, max_tokens, **kwargs)


def sampled(out, token: int = 7) -> np.ndarray:
    return np.full(len(out), token, dtype=np.int32)


def trace_samples(num_rows: int, seed: int, width: int, num_tokens: int,
                  eos_every: int) -> np.ndarray:
    """A random trace's sampled rows: token 7 + seed % num_tokens, draft columns accepted (8)
    or rejected (-1) by turns, and EOS on row 0 when seed % eos_every == 0."""
    rows = np.full((num_rows, width), 7 + seed % num_tokens, dtype=np.int32)
    if width > 1:
        rows[:, 1:] = np.where((np.arange(width - 1) + seed) % 2 == 0, 8, -1)
    if seed % eos_every == 0 and num_rows:
        rows[0, 0] = EOS
    return rows


def step(sched: Scheduler, token: int = 7):
    """One schedule() + process_outputs() with every sequence sampling `token`."""
    out = sched.schedule()
    res = sched.process_outputs(out, sampled(out, token))
    return out, res


def drain(sched: Scheduler, max_steps: int = 50) -> None:
    """Abort every live request, book until idle; every block must be free again."""
    for rid in sched.live_request_ids():
        sched.abort_sequence(rid)
    for _ in range(max_steps):
        sched.check_invariants()
        if not sched.has_unfinished() and sched.num_free_blocks() == sched.num_total_blocks():
            break
        step(sched)
    sched.check_invariants()
    assert not sched.has_unfinished()
    assert sched.num_free_blocks() == sched.num_total_blocks()
    assert sched.num_free_state_slots() == sched.num_total_state_slots()
