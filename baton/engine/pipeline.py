"""The two-beat pipeline (`--async-scheduling`): step N+1 is built while step N runs.

A decode step's life with it on (docs/scheduler.md S3, "In-flight steps"):
1. Step N runs on the forward thread: the runner's backend prepare, the forward, sampling.
2. Meanwhile the engine's loop calls `schedule()` for N+1: each sequence of N gets its next
   row with input id -1 (its token is being sampled by N, S3), and blocks N may still read
   stay allocated until N is booked (S8).
3. When N's samples are in, N+1's -1 ids are filled from them (by sequence id), its outputs so
   far are N's booked ones plus that token, and N+1 goes to the forward thread; the runner
   prepares N+1 only after N's `finish_step` (the thread runs steps in order).
4. The loop then books N (process_outputs, grammar, stops, outputs), overlapping N+1's forward.
   A sequence N finished has a wasted row in N+1, booked as nothing; one preempted or aborted
   meanwhile is voided by its epoch (S29) or booked as finished.
Two beats only where N+1 cannot depend on more than N's sampled tokens: a step runs one beat
(booked before the next is scheduled) when it is a prompt step (n > 1 choices split there, a
prompt may hand off), verifies drafts, has a grammar-constrained row (the next mask needs this
token consumed), has a request that may speculate (its drafts are proposed from the tokens
booked, and a row scheduled after an unbooked verify step would start at an unknown
position), or has a row at the model length (it has no next position).
Plain decode steps beside them run two beats again once those finish.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)


@dataclass
class StepLaunch:
    """One scheduled step, ready for the runner: its rows' requests and the runner's
    arguments (`args`: `Runner.execute`'s positional ones)."""

    sched_out: Any  # the scheduler's SchedulerOutputs (what process_outputs books)
    seq_ids: np.ndarray
    reqs: list
    seqlens_q: np.ndarray
    verified: bool  # a decode step whose rows carry drafts
    args: tuple
    kwargs: dict = field(default_factory=dict)

    def run(self, runner) -> tuple[Any, float]:
        """(samples, seconds) of the runner's execute."""
        started = time.perf_counter()
        samples = runner.execute(*self.args, **self.kwargs)
        return samples, time.perf_counter() - started


class FilledStep:
    """A scheduled step whose -1 input ids are filled from the step before it; every other
    attribute reads through to the scheduler's output."""

    def __init__(self, sched_out, input_ids: np.ndarray) -> None:
        self._out = sched_out
        self.input_ids = input_ids

    def __getattr__(self, name: str):
        return getattr(self._out, name)


def fill_placeholders(sched_out, seq_ids: np.ndarray, prev: StepLaunch,
                      prev_tokens: np.ndarray) -> tuple[Any, dict[int, int]]:
    """(the step to run, seq id -> token) for a step scheduled while `prev` was in flight: each
    -1 input id (always a row's first token) is the token `prev` sampled for that sequence."""
    input_ids = np.asarray(sched_out.input_ids)
    if not (input_ids < 0).any():
        return sched_out, {}
    sampled = {int(s): int(t) for s, t in zip(prev.seq_ids, prev_tokens, strict=True)}
    filled = input_ids.copy()
    seqlens_q = np.asarray(sched_out.seqlens_q)
    starts = np.cumsum(seqlens_q) - seqlens_q
    used = {}
    for i in np.flatnonzero(filled[starts] < 0):
        seq_id = int(seq_ids[i])
        assert seq_id in sampled, f"row {i}: seq {seq_id} waits on no step in flight"
        filled[starts[i]] = used[seq_id] = sampled[seq_id]
    assert (filled >= 0).all(), "a -1 input id past a row's first token"
    return FilledStep(sched_out, filled), used


class TwoBeat:
    """Runs an engine's steps on a forward thread, one step ahead where it may (see the module
    docstring). `step()` returns what `LLMEngine.step` would; `drain()` books the step still in
    flight; `close()` does that and stops the thread."""

    def __init__(self, engine, step_timeout_s: float = 600.0) -> None:
        self.engine = engine
        self.step_timeout_s = step_timeout_s
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="baton-forward")
        self._inflight: tuple[StepLaunch, Future] | None = None
        self._closed = False
        self._lock = threading.Lock()  # close() from another thread than the loop's
        self.num_two_beat_steps = 0  # steps launched while the one before was in flight

    @property
    def in_flight(self) -> bool:
        return self._inflight is not None

    def _submit(self, launch: StepLaunch) -> tuple[StepLaunch, Future]:
        with self._lock:
            if self._closed:
                raise RuntimeError("the engine's two-beat pipeline is closed")
            return launch, self._pool.submit(launch.run, self.engine.runner)

    def _wait(self, future: Future):
        try:
            return future.result(timeout=self.step_timeout_s)
        except FutureTimeout:
            raise RuntimeError(f"a step ran past {self.step_timeout_s:.0f} s on the forward "
                               "thread") from None

    def can_overlap(self, launch: StepLaunch) -> bool:
        """Whether the next step may be scheduled before this one is booked."""
        if launch.sched_out.prompt_run or launch.verified:
            return False
        # A row at the model length has no next position (S38 would refuse the next step).
        if int(np.asarray(launch.sched_out.seqlens_k).max()) >= self.engine.max_model_len:
            return False
        speculating = self.engine.speculator is not None
        return not any(r.matcher is not None or (speculating and r.params.speculative)
                       for r in launch.reqs)

    def step(self) -> list:
        engine = self.engine
        outputs, engine._pending = engine._pending, []
        current, self._inflight = self._inflight, None
        if current is None:
            launch = engine._launch(engine._schedule(outputs))
            if launch is None:
                return outputs
            current = self._submit(launch)
        launch, future = current
        ahead, dropped = None, []
        if self.can_overlap(launch):
            ahead = engine._schedule(dropped)  # N+1 while N runs
        samples, seconds = self._wait(future)
        if ahead is not None:
            tokens = samples.token_ids if samples.token_ids.ndim == 1 else samples.token_ids[:, 0]
            nxt = engine._launch(ahead, after=(launch, tokens))
            if nxt is not None:
                self._inflight = self._submit(nxt)
                self.num_two_beat_steps += 1
        outputs += engine._book(launch, samples, seconds)
        outputs += dropped  # what N+1's schedule dropped (aborted, too long), after N's tokens
        return outputs

    def drain(self) -> list:
        """Book the step in flight, if any (nothing new is scheduled)."""
        current, self._inflight = self._inflight, None
        if current is None:
            return []
        launch, future = current
        samples, seconds = self._wait(future)
        return self.engine._book(launch, samples, seconds)

    def close(self) -> None:
        """Book the step in flight (its blocks return, S8) and stop the forward thread."""
        try:
            self.drain()
        finally:
            with self._lock:
                self._closed = True
            self._pool.shutdown(wait=True, cancel_futures=True)
