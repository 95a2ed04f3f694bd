"""The planner against every fixed split, in the simulator's virtual time.

    .venv/bin/python bench/planner_sim.py [--budget 16] [--rate 6] [--phase-s 150]

Three workloads on one engine budget (the profile's step times, tests/data/profile_test.json
unless --profile): a long-prompt retrieval mix, a short-prompt chat mix, and a workload that
shifts from chat to retrieval half-way. For each: every fixed prompt:completion split of the
budget (the sweep), then the planner (planner/core.py) starting from the middle split, which
no workload here favours, so it has to move.
Prints goodput per split and the planner's, the planner's ratio to the best fixed split, its
role changes (and changes per 10 simulated minutes after the first decision window); writes
bench/results/planner_sim.json and draws bench/results/planner_sim.png (roles over time).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from baton.perf.profile import load
from baton.workload.synthetic import RequestSpec
from baton.workload.words import WORDS
from planner.core import Planner, PlannerConfig
from simulator.fleet import FleetConfig
from simulator.run import SimConfig, simulate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from repo_paths import relative_args  # noqa: E402 - a sibling script, not a package

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
KINDS = {"chat": ((50, 200), (100, 300)), "retrieval": ((1500, 3000), (10, 40))}


def workload(phases: list[str], rate: float, phase_s: float, seed: int) -> list[RequestSpec]:
    """Poisson arrivals at `rate`, each phase `phase_s` long, lengths of the phase's kind."""
    rng = random.Random(seed)
    specs, t = [], 0.0
    for i, kind in enumerate(phases):
        end = (i + 1) * phase_s
        (lo_in, hi_in), (lo_out, hi_out) = KINDS[kind]
        while True:
            t += rng.expovariate(rate)
            if t >= end:
                t = end
                break
            n_in = rng.randint(lo_in, hi_in)
            specs.append(RequestSpec(len(specs), kind, " ".join(rng.choices(WORDS, k=n_in)),
                                     n_in, rng.randint(lo_out, hi_out), arrival_s=t))
    return specs


def run(profile, specs, split: tuple[int, int], slos: dict, planner=None) -> dict:
    fleet = FleetConfig(num_normal=0, num_prompt=split[0], num_completion=split[1])
    cfg = SimConfig(fleet=fleet, slos_ms=slos, label=f"{split[0]}P:{split[1]}D")
    return simulate(profile, cfg, None, specs=specs, planner=planner)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=str(ROOT / "tests" / "data" / "profile_test.json"))
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--rate", type=float, default=6.0, help="requests/s")
    ap.add_argument("--phase-s", type=float, default=150.0, help="seconds of each phase")
    ap.add_argument("--goodput", default="ttft:2000,tpot:100")
    ap.add_argument("--interval", type=float, default=30.0)
    ap.add_argument("--window", type=float, default=30.0)
    ap.add_argument("--cooldown", type=float, default=120.0)
    ap.add_argument("--candidates", type=int, default=6)
    ap.add_argument("--workloads", default="retrieval,chat,shifting")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=str(HERE / "results" / "planner_sim.json"))
    args = ap.parse_args()
    profile = load(args.profile)
    slos = {k: float(v) for k, v in (item.split(":") for item in args.goodput.split(","))}
    shapes = {"retrieval": ["retrieval", "retrieval"], "chat": ["chat", "chat"],
              "shifting": ["chat", "retrieval"]}
    report = {"args": relative_args(vars(args)) | {"out": None}, "workloads": {}}
    print(f"{'workload':<10}{'best fixed':>12}{'goodput':>9}{'middle':>9}{'planner':>9}"
          f"{'ratio':>7}{'changes':>9}{'per 10 min':>11}{'sim s':>7}")
    for name in args.workloads.split(","):
        specs = workload(shapes[name], args.rate, args.phase_s, args.seed)
        wall0 = time.perf_counter()
        fixed = {}
        for p in range(1, args.budget):
            rec = run(profile, specs, (p, args.budget - p), slos)
            fixed[f"{p}P:{args.budget - p}D"] = rec["summary"]["goodput"]
        best = max(fixed, key=fixed.get)
        middle = (args.budget // 2, args.budget - args.budget // 2)
        planner = Planner(profile, PlannerConfig(
            slos_ms=slos, interval_s=args.interval, window_s=args.window,
            cooldown_s=args.cooldown, max_candidates=args.candidates))
        rec = run(profile, specs, middle, slos, planner)
        good = rec["summary"]["goodput"]
        changes = [d for d in rec["fleet"]["planner_decisions"] if d["action"] == "change"]
        span_min = max(1e-9, (rec["fleet"]["virtual_s"] - args.window) / 60)
        report["workloads"][name] = {
            "num_requests": len(specs), "fixed_goodput": fixed, "best_fixed": best,
            "planner_goodput": good, "ratio": good / fixed[best] if fixed[best] else None,
            "changes": changes, "changes_per_10_min": 10 * len(changes) / span_min,
            "roles_over_time": rec["fleet"]["roles_over_time"],
            "decisions": rec["fleet"]["planner_decisions"],
            "wall_s": time.perf_counter() - wall0}
        w = report["workloads"][name]
        print(f"{name:<10}{best:>12}{fixed[best]:>9.2f}{fixed[f'{middle[0]}P:{middle[1]}D']:>9.2f}"
              f"{good:>9.2f}{w['ratio']:>7.2f}{len(changes):>9}{w['changes_per_10_min']:>11.1f}"
              f"{w['wall_s']:>7.0f}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    plot(report, Path(args.out).with_suffix(".png"))
    print(f"wrote {args.out}")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["workloads"])
    fig, axes = plt.subplots(len(names), 1, figsize=(8, 2.6 * len(names)), squeeze=False)
    for ax, name in zip(axes[:, 0], names, strict=True):
        roles = report["workloads"][name]["roles_over_time"]
        t = [r["t"] for r in roles]
        ax.step(t, [r["prompt"] for r in roles], where="post", label="prompt engines")
        ax.step(t, [r["completion"] for r in roles], where="post", label="completion engines")
        ax.set_title(f"{name}: planner goodput {report['workloads'][name]['ratio']:.2f}x the "
                     "best fixed split")
        ax.set_xlabel("simulated s")
        ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
