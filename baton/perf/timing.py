"""Timing an engine's steps: what `baton profile`'s grid (baton/perf/measure.py), its
contention phase (baton/perf/contention.py) and the step check (baton/perf/check.py) share."""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np


class ExecuteCall(NamedTuple):
    """One call of a runner's `execute`: the step's shape and its forward time."""

    prompt_run: bool
    seqlens_q: np.ndarray  # per sequence: tokens computed, and context after the step
    seqlens_k: np.ndarray
    seq_ids: np.ndarray
    num_sampled: int
    forward_ms: float


class TimedRunner:
    """Wraps a runner's `execute`: an `ExecuteCall` per call, in `calls` (`baton profile`'s
    grid, and baton/perf/check.py's steps of a workload)."""

    def __init__(self, runner) -> None:
        self.inner = runner.execute
        self.calls: list[ExecuteCall] = []
        runner.execute = self

    def __call__(self, sched_out, seq_ids, params, *args, **kw):
        q = np.array(sched_out.seqlens_q, copy=True)
        k = np.array(sched_out.seqlens_k, copy=True)
        ids = np.array(seq_ids, copy=True)
        t0 = time.perf_counter()
        out = self.inner(sched_out, seq_ids, params, *args, **kw)
        ms = (time.perf_counter() - t0) * 1e3
        self.calls.append(ExecuteCall(bool(sched_out.prompt_run), q, k, ids,
                                      sum(p is not None for p in params), ms))
        return out


def random_prompt(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(100, vocab - 1, size=n).tolist()


def decode_steps(engine, timed: TimedRunner, batch: int):
    """Step the engine until its requests finish; (context per row, sampled rows, forward ms,
    whole step ms) of each decode-only step of all `batch` rows but the first. The first one is
    left out: it fills the CPU backend's decode rows from the pool (sized up when the batch or
    context outgrows them: 5-10x a step here), a once-per-request cost, not a step's."""
    out, first = [], True
    while engine.has_unfinished():
        timed.calls.clear()
        ts = time.perf_counter()
        engine.step()
        step_ms = (time.perf_counter() - ts) * 1e3
        call = timed.calls[0] if len(timed.calls) == 1 else None
        if call is not None and not call.prompt_run and len(call.seqlens_k) == batch:
            if not first:
                out.append((call.seqlens_k, call.num_sampled, call.forward_ms, step_ms))
            first = False
    return out
