"""Scheduler decode step in instructions and simulated cache misses: noise-free on a shared machine.

Run: .venv/bin/python bench/scheduler_instructions.py [--running 1024]
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


def _loop(num_seqs: int, steps: int) -> None:
    import numpy as np
    from scheduler_bench import decode_step, decoding_scheduler

    sched = decoding_scheduler(num_seqs)
    tokens = np.full(num_seqs, 7, dtype=np.int32)
    for _ in range(steps):
        decode_step(sched, tokens)


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
    parser.add_argument("--child-steps", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_steps is not None:
        _loop(args.running, args.child_steps)
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
                            "--running", str(args.running), "--child-steps", str(steps)],
                           check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=600)
            totals.append(_totals(out))
    per_step = {k: (totals[1][k] - totals[0][k]) / (_STEPS[1] - _STEPS[0]) for k in totals[0]}
    print(f"decode step at {args.running} running, per step:")
    print(f"  instructions      {per_step['Ir']:>10.0f}")
    print(f"  D1 misses         {per_step['D1mr'] + per_step['D1mw']:>10.0f}")
    print(f"  LL (L2) misses    {per_step['DLmr'] + per_step['DLmw']:>10.0f}")


if __name__ == "__main__":
    main()
