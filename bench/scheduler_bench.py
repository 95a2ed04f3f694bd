"""Scheduler step cost: median microseconds of schedule() + process_outputs().

Run: .venv/bin/python bench/scheduler_bench.py
Writes bench/results/scheduler.json.

Each case runs ROUNDS times (a fresh scheduler each time, the cases in turn) and reports the
lowest median: on a shared machine a neighbour's burst inflates a whole round, never deflates it.
For a noise-free comparison count instructions instead, for example
valgrind --tool=callgrind on two runs with different step counts.
"""

from __future__ import annotations

import os

# numpy's OpenBLAS threads spin for a while after any BLAS call and were seen in callgrind
# profiles of this process; nothing here uses BLAS, so give them no thread to spin on.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from baton.engine.scheduler import EngineType, Scheduler, SchedulerConfig  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "scheduler.json"
ROUNDS = 5


def decoding_scheduler(num_seqs: int, prompt_len: int = 128, steps: int = 1000,
                       prefix_caching: bool = False) -> Scheduler:
    """num_seqs sequences prefilled and running, with blocks for `steps` more decode steps."""
    # Enough blocks that nothing is preempted while the sequences grow.
    blocks_per_seq = (prompt_len + steps + 32) // 16 + 2
    cfg = SchedulerConfig(num_blocks=num_seqs * blocks_per_seq + 16, block_size=16, max_num_seqs=num_seqs,
                          max_num_batched_tokens=num_seqs * prompt_len, max_model_len=8192,
                          prefill_attempt_interval=1 << 30, prefill_any_attempt_interval=1 << 30,
                          enable_prefix_caching=prefix_caching)
    sched = Scheduler(cfg)
    for i in range(num_seqs):
        sched.add_sequence(f"req-{i}", np.full(prompt_len, 10 + i % 100, dtype=np.int32), 100_000)
    out = sched.schedule()
    sched.process_outputs(out, np.full(len(out), 7, dtype=np.int32))
    assert sched.num_running() == num_seqs
    return sched


def decode_step(sched: Scheduler, tokens: np.ndarray) -> None:
    """One decode step as a model runner drives it: the arrays it reads, then the booking."""
    out = sched.schedule()
    _ = out.block_tables, out.input_ids, out.positions, out.slot_mapping, out.seqlens_k
    sched.process_outputs(out, tokens)


def _decode_step_us(num_seqs: int, prompt_len: int = 128, iters: int = 1000,
                    prefix_caching: bool = False) -> float:
    sched = decoding_scheduler(num_seqs, prompt_len, iters, prefix_caching)
    tokens = np.full(num_seqs, 7, dtype=np.int32)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        decode_step(sched, tokens)
        times.append(time.perf_counter() - t0)
    assert sched.num_running() == num_seqs
    return statistics.median(times) * 1e6


def _prefill_step_us(num_prompts: int = 16, prompt_len: int = 512, iters: int = 300) -> float:
    cfg = SchedulerConfig(engine_type=EngineType.PROMPT, num_blocks=num_prompts * 40 + 16,
                          block_size=16, max_num_seqs=num_prompts,
                          max_num_batched_tokens=num_prompts * prompt_len, max_model_len=8192)
    sched = Scheduler(cfg)
    tokens = np.full(num_prompts, 7, dtype=np.int32)
    prompt = np.full(prompt_len, 11, dtype=np.int32)
    times = []
    n = 0
    for _ in range(iters):
        ids = []
        for _ in range(num_prompts):
            ids.append(f"p-{n}")
            sched.add_sequence(ids[-1], prompt, 64)
            n += 1
        t0 = time.perf_counter()
        out = sched.schedule()
        _ = out.block_tables, out.input_ids, out.positions, out.slot_mapping, out.seqlens_k
        res = sched.process_outputs(out, tokens)
        times.append(time.perf_counter() - t0)
        assert len(res.handed_off) == num_prompts
        for rid in ids:
            sched.release_handed_off(rid)
    return statistics.median(times) * 1e6


def main() -> None:
    cases = [(f"decode, {n} running", _decode_step_us, (n,)) for n in (64, 256, 1024)]
    cases.append(("prefill, 16 x 512-token prompts", _prefill_step_us, ()))
    # Keys registered as decode fills blocks (P5): one block in 16 steps per sequence.
    cases.append(("decode, 1024 running, prefix caching", _decode_step_us, (1024, 128, 1000, True)))
    # Rounds go case by case in turn, so one noisy stretch of the machine slows one round of
    # every case instead of every round of one case.
    medians: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    for _ in range(ROUNDS):
        for name, measure, args in cases:
            medians[name].append(measure(*args))
    rows = [(name, min(values)) for name, values in medians.items()]
    print(f"{'step':<36}{'median us':>12}")
    for name, us in rows:
        print(f"{name:<36}{us:>12.1f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "unit": "microseconds, median of schedule() + process_outputs() incl. block tables",
        "rounds": ROUNDS,  # lowest median of this many rounds
        "decode_64": round(rows[0][1], 2),
        "decode_256": round(rows[1][1], 2),
        "decode_1024": round(rows[2][1], 2),
        "prefill_16x512": round(rows[3][1], 2),
        "decode_1024_prefix_caching": round(rows[4][1], 2),
        "machine": platform.processor() or platform.machine(),
        "python": platform.python_version(),
    }, indent=2) + "\n")


if __name__ == "__main__":
    main()
