"""Scheduler decode step in instructions and simulated cache misses: noise-free on a shared machine.

Run: .venv/bin/python bench/scheduler_instructions.py [--running 1024] [--prefix-caching]
     [--kv-events]   (caching on, the KV event log on and drained every step, as an engine
                     does while a router subscribes for cache-aware routing)
Needs valgrind. Runs the decode loop of scheduler_bench.py under cachegrind twice (100 and 300
steps; D1 32 KiB, LL 512 KiB like one core's L2 here) and prints the difference over 200 steps:
what one step costs, without the setup. About 40 seconds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

_STEPS = (100, 300)


def _loop(num_seqs: int, steps: int, prefix_caching: bool, kv_events: bool) -> None:
    import numpy as np
    from scheduler_bench import decode_step, decoding_scheduler

    sched = decoding_scheduler(num_seqs, prefix_caching=prefix_caching or kv_events)
    if kv_events:
        sched.set_kv_event_capacity(4 * sched.num_total_blocks())
    tokens = np.full(num_seqs, 7, dtype=np.int32)
    for _ in range(steps):
        decode_step(sched, tokens)
        if kv_events:
            sched.drain_kv_events()


def _totals(path: Path) -> dict[str, int]:
    events: list[str] = []
    for line in path.read_text().splitlines():
        if line.startswith("events:"):
            events = line.split()[1:]
        elif line.startswith("summary:"):
            return dict(zip(events, map(int, line.split()[1:]), strict=True))
    raise RuntimeError(f"no summary in {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", type=int, default=1024)
    parser.add_argument("--prefix-caching", action="store_true")
    parser.add_argument("--kv-events", action="store_true", help="implies --prefix-caching")
    parser.add_argument("--child-steps", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_steps is not None:
        _loop(args.running, args.child_steps, args.prefix_caching, args.kv_events)
        return
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not installed")
    # numpy's idle BLAS threads would count; a fixed hash seed keeps Python's dict work the same
    # from run to run (randomized, it moved the count by a few thousand).
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    totals = []
    with tempfile.TemporaryDirectory() as tmp:
        for steps in _STEPS:
            out = Path(tmp) / f"cg.{steps}"
            subprocess.run(["valgrind", "--tool=cachegrind", "--cache-sim=yes", "--D1=32768,8,64",
                            "--LL=524288,8,64", f"--cachegrind-out-file={out}", sys.executable, __file__,
                            "--running", str(args.running), "--child-steps", str(steps),
                            *(["--prefix-caching"] if args.prefix_caching else []),
                            *(["--kv-events"] if args.kv_events else [])],
                           check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=600)
            totals.append(_totals(out))
    per_step = {k: (totals[1][k] - totals[0][k]) / (_STEPS[1] - _STEPS[0]) for k in totals[0]}
    mode = "kv events" if args.kv_events else "prefix caching" if args.prefix_caching else "plain"
    print(f"decode step at {args.running} running ({mode}), per step:")
    print(f"  instructions      {per_step['Ir']:>10.0f}")
    print(f"  D1 misses         {per_step['D1mr'] + per_step['D1mw']:>10.0f}")
    print(f"  LL (L2) misses    {per_step['DLmr'] + per_step['DLmw']:>10.0f}")


if __name__ == "__main__":
    main()
