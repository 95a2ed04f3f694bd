"""Decode step time of this tree against another checkout of Baton (a commit before a change),
interleaved: each round runs `bench/decode_step.py --repeats 1` once in each tree (its own
.venv), alternating which goes first, so a shared machine's load falls on both alike. Prints a
table (median ms per step over the rounds, min-max, after / before) and writes JSON.

    .venv/bin/python bench/decode_before_after.py --before PATH_TO_OTHER_CHECKOUT \
        [--modes none,int4] [--batches 1,8] [--rounds 5] [--steps 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from repo_paths import ROOT  # noqa: E402 - a sibling script, not a package

RESULTS = ROOT / "bench" / "results" / "decode_before_after.json"


def run_tree(root: Path, args: argparse.Namespace) -> dict[tuple[str, int], float]:
    """(mode, batch) -> ms per step of one decode_step.py run in the checkout at `root`."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "decode_step.json"
        subprocess.run([str(root / ".venv" / "bin" / "python"), str(root / "bench" / "decode_step.py"),
                        "--modes", args.modes, "--batches", args.batches, "--repeats", "1",
                        "--steps", str(args.steps), "--out", str(out)],
                       cwd=root, check=True, timeout=1200, stdout=subprocess.DEVNULL)
        rows = json.loads(out.read_text())["rows"]
    return {(r["mode"], r["batch"]): r["ms_per_step"] for r in rows}


def git_head(root: Path) -> str:
    return subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="the other checkout (built: its .venv)")
    ap.add_argument("--modes", default="none,int4")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    trees = {"before": Path(args.before).resolve(), "after": ROOT}
    for root in trees.values():
        if not (root / ".venv" / "bin" / "python").is_file():
            sys.exit(f"--before: {root} has no .venv (run make install there)")
    times: dict[str, dict[tuple[str, int], list[float]]] = {n: {} for n in trees}
    loads = []
    for i in range(args.rounds):
        order = list(trees) if i % 2 == 0 else list(trees)[::-1]
        for name in order:
            for key, ms in run_tree(trees[name], args).items():
                times[name].setdefault(key, []).append(ms)
        loads.append(os.getloadavg()[0])
        print(f"round {i + 1}/{args.rounds} done, load {loads[-1]:.1f}", flush=True)
    rows = []
    print(f"{'mode':>6} {'batch':>5} {'before ms':>10} {'min-max':>15} {'after ms':>9} "
          f"{'min-max':>15} {'after/before':>12}")
    for key in times["before"]:
        b, a = times["before"][key], times["after"][key]
        mb, ma = statistics.median(b), statistics.median(a)
        rows.append({"mode": key[0], "batch": key[1], "before_ms": mb, "after_ms": ma,
                     "before_runs": b, "after_runs": a, "ratio": ma / mb})
        print(f"{key[0]:>6} {key[1]:>5} {mb:10.2f} {min(b):7.2f}-{max(b):7.2f} {ma:9.2f} "
              f"{min(a):7.2f}-{max(a):7.2f} {ma / mb:12.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "before": git_head(trees["before"]), "after": git_head(ROOT), "rounds": args.rounds,
        "steps": args.steps, "load_avg_per_round": loads, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
