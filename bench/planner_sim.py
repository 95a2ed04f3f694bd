"""The planner against every fixed split, in the simulator's virtual time.

    .venv/bin/python bench/planner_sim.py [--budget 16] [--phase-s 600] [--workloads ...]

Three workloads on one engine budget (the profile's step times, tests/data/profile_test.json
unless --profile), each two phases of --phase-s (5 minutes: a stationary workload is 10
simulated minutes, the span of the steady-load target, and the planner's first decisions are a
fair part of a run, not half of it):
  - retrieval: long prompts (1500-3000 tokens), short answers (10-40), at --retrieval-rate;
    its prefill load needs most of the budget as prompt engines,
  - chat: short prompts (100-400 tokens), answers of a few hundred tokens (200-800), at
    --chat-rate; its decode load needs most of the budget as completion engines,
  - shifting: the chat phase, then the retrieval phase: no one split serves both.
For each: the fixed prompt:completion splits of the budget (every odd split, then the
neighbours of the best: the goodput of a split rises to one peak and falls; --full-sweep runs
every split), then the planner (planner/core.py) starting from the middle split, which no
workload here favours, so it has to move.
Prints goodput per workload for the best fixed split, the middle one and the planner, the
planner's ratio to the best, its role changes, and changes per 10 simulated minutes after its
first change (the warm-up); writes bench/results/planner_sim.json after each workload and draws
bench/results/planner_sim.png (roles over time).
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

# (prompt tokens, output tokens) ranges, uniform (--chat-lengths, --retrieval-lengths)
KINDS: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {}
SHAPES = {"retrieval": ["retrieval", "retrieval"], "chat": ["chat", "chat"],
          "shifting": ["chat", "retrieval"]}


def workload(phases: list[str], rates: dict[str, float], phase_s: float,
             seed: int) -> list[RequestSpec]:
    """Poisson arrivals, each phase `phase_s` long at its kind's rate and lengths."""
    rng = random.Random(seed)
    specs, t = [], 0.0
    for i, kind in enumerate(phases):
        end = (i + 1) * phase_s
        (lo_in, hi_in), (lo_out, hi_out) = KINDS[kind]
        while True:
            t += rng.expovariate(rates[kind])
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


def sweep(profile, specs, budget: int, slos: dict, full: bool,
          only: list[int] | None = None) -> dict[str, float]:
    """Goodput of fixed splits: every one if `full`, else every odd number of prompt engines
    and then the untried neighbours of the best; `only`: these numbers of prompt engines."""
    fixed: dict[int, float] = {}

    def try_split(p: int) -> None:
        if 1 <= p < budget and p not in fixed:
            fixed[p] = run(profile, specs, (p, budget - p), slos)["summary"]["goodput"]

    for p in only or range(1, budget, 1 if full else 2):
        try_split(p)
    if only is None:
        best = max(fixed, key=fixed.get)
        try_split(best - 1)
        try_split(best + 1)
    return {f"{p}P:{budget - p}D": fixed[p] for p in sorted(fixed)}


def changes_per_10_min(changes: list[dict], end_s: float) -> float | None:
    """Changes after the first one (the warm-up), per 10 minutes of the rest of the run."""
    if len(changes) < 1:
        return 0.0
    span = end_s - changes[0]["t"]
    return 10 * 60 * (len(changes) - 1) / span if span > 0 else None


def recorded_sweep(path: str, name: str, profile, specs, args, slos: dict) -> dict[str, float]:
    """The fixed splits' goodput from an earlier result of this same workload: the simulator
    is deterministic in virtual time, so the recorded best split is run again and must give
    the recorded goodput, or the record is refused."""
    recorded = json.loads(Path(path).read_text())["workloads"]
    if name not in recorded:  # not in that run: swept here
        return sweep(profile, specs, args.budget, slos, args.full_sweep, None)
    fixed = recorded[name]["fixed_goodput"]
    best = max(fixed, key=fixed.get)
    p = int(best.split("P:")[0])
    again = run(profile, specs, (p, args.budget - p), slos)["summary"]["goodput"]
    if abs(again - fixed[best]) > 1e-9 * max(1.0, again):
        raise SystemExit(f"{path}: {name} {best} recorded {fixed[best]}, now {again}: "
                         "another workload or simulator; run the sweep")
    return fixed


def lengths(text: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """'100-400:200-800' -> ((100, 400), (200, 800)): prompt and output token ranges."""
    prompt, output = ((int(a), int(b)) for a, b in (r.split("-") for r in text.split(":")))
    return prompt, output


def one_workload(profile, name: str, args, slos: dict) -> dict:
    rates = {"chat": args.chat_rate, "retrieval": args.retrieval_rate}
    specs = workload(SHAPES[name], rates, args.phase_s, args.seed)
    wall0 = time.perf_counter()
    fixed = (recorded_sweep(args.fixed_from, name, profile, specs, args, slos)
             if args.fixed_from else sweep(profile, specs, args.budget, slos, args.full_sweep,
                                           args.splits and [int(p) for p in args.splits.split(",")]))
    sweep_wall_s = time.perf_counter() - wall0
    best = max(fixed, key=fixed.get)
    middle = (args.budget // 2, args.budget - args.budget // 2)
    planner = Planner(profile, PlannerConfig(
        slos_ms=slos, interval_s=args.interval, window_s=args.window,
        cooldown_s=args.cooldown, max_candidates=args.candidates))
    rec = run(profile, specs, middle, slos, planner)
    good = rec["summary"]["goodput"]
    decisions = rec["fleet"]["planner_decisions"]
    changes = [d for d in decisions if d["action"] == "change"]
    end_s = 2 * args.phase_s
    phases = {}  # steady stretches: changes after warm-up per phase
    for i, kind in enumerate(SHAPES[name]):
        in_phase = [d for d in changes if i * args.phase_s <= d["t"] < (i + 1) * args.phase_s]
        phases[f"{i}:{kind}"] = {"changes": len(in_phase),
                                 "after_first_per_10_min": changes_per_10_min(
                                     in_phase, (i + 1) * args.phase_s)}
    return {
        "num_requests": len(specs), "fixed_goodput": fixed, "best_fixed": best,
        "middle": f"{middle[0]}P:{middle[1]}D", "planner_goodput": good,
        "ratio": good / fixed[best] if fixed[best] else None,
        "planner_summary": {k: rec["summary"][k] for k in ("num_completed", "num_failed")},
        "changes": changes, "changes_per_10_min_after_warmup": changes_per_10_min(changes, end_s),
        "phases": phases, "num_replays": sum(not d["reason"].startswith("load within")
                                             for d in decisions if d["action"] == "hold"),
        "roles_over_time": rec["fleet"]["roles_over_time"], "decisions": decisions,
        "sweep_wall_s": sweep_wall_s, "wall_s": time.perf_counter() - wall0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=str(ROOT / "tests" / "data" / "profile_test.json"))
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--chat-rate", type=float, default=12.0, help="requests/s")
    ap.add_argument("--retrieval-rate", type=float, default=6.0, help="requests/s")
    ap.add_argument("--phase-s", type=float, default=300.0, help="seconds of each phase")
    ap.add_argument("--goodput", default="ttft:2000,tpot:100")
    ap.add_argument("--interval", type=float, default=20.0)
    ap.add_argument("--window", type=float, default=40.0)
    ap.add_argument("--cooldown", type=float, default=300.0)
    ap.add_argument("--candidates", type=int, default=8)
    ap.add_argument("--chat-lengths", default="100-400:200-800",
                    help="prompt:output token ranges of a chat request")
    ap.add_argument("--retrieval-lengths", default="1500-3000:10-40",
                    help="prompt:output token ranges of a retrieval request")
    ap.add_argument("--full-sweep", action="store_true", help="every fixed split")
    ap.add_argument("--splits", help="only these numbers of prompt engines, e.g. 11,12,13 "
                    "(where a coarser run put the best)")
    ap.add_argument("--fixed-from", help="an earlier result JSON of these same workloads: its "
                    "fixed splits' goodput instead of a sweep (its best split is re-run)")
    ap.add_argument("--workloads", default="retrieval,chat,shifting")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=str(HERE / "results" / "planner_sim.json"))
    args = ap.parse_args()
    KINDS.update(chat=lengths(args.chat_lengths), retrieval=lengths(args.retrieval_lengths))
    profile = load(args.profile)
    slos = {k: float(v) for k, v in (item.split(":") for item in args.goodput.split(","))}
    report = {"args": relative_args(vars(args)) | {"out": None}, "workloads": {}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"{'workload':<10}{'best fixed':>12}{'goodput':>9}{'middle':>9}{'planner':>9}"
          f"{'ratio':>7}{'changes':>9}{'per 10 min':>11}{'wall s':>8}")
    for name in args.workloads.split(","):
        w = report["workloads"][name] = one_workload(profile, name, args, slos)
        per10 = w["changes_per_10_min_after_warmup"]
        print(f"{name:<10}{w['best_fixed']:>12}{w['fixed_goodput'][w['best_fixed']]:>9.2f}"
              f"{w['fixed_goodput'].get(w['middle'], float('nan')):>9.2f}"
              f"{w['planner_goodput']:>9.2f}{w['ratio']:>7.2f}{len(w['changes']):>9}"
              f"{per10 if per10 is not None else float('nan'):>11.2f}{w['wall_s']:>8.0f}",
              flush=True)
        out.write_text(json.dumps(report, indent=1))  # a partial run keeps what it finished
        plot(report, out.with_suffix(".png"), args.phase_s)
    print(f"wrote {args.out}")


def plot_roles(ax, roles: list[dict], phase_s: float, phase_label: str = "") -> None:
    """Engines of each role over time (`roles`: {"t", "prompt", "completion"} samples) and the
    phase change, on one matplotlib axis (bench/live_planner.py draws its live run with it)."""
    t = [r["t"] for r in roles]
    ax.step(t, [r["prompt"] for r in roles], where="post", label="prompt engines")
    ax.step(t, [r["completion"] for r in roles], where="post", label="completion engines")
    ax.axvline(phase_s, color="grey", linestyle=":", linewidth=1, label=phase_label or None)


def plot(report: dict, path: Path, phase_s: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["workloads"])
    fig, axes = plt.subplots(len(names), 1, figsize=(8, 2.6 * len(names)), squeeze=False)
    for ax, name in zip(axes[:, 0], names, strict=True):
        w = report["workloads"][name]
        plot_roles(ax, w["roles_over_time"], phase_s)
        best = w["best_fixed"].split("P:")[0]
        ax.axhline(int(best), color="C0", linestyle="--", linewidth=0.8,
                   label=f"best fixed split {w['best_fixed']} (prompt)")
        ax.set_title(f"{name}: planner goodput {w['ratio']:.2f}x the best fixed split, "
                     f"{len(w['changes'])} change" + "s" * (len(w["changes"]) != 1))
        ax.set_xlabel("simulated s")
        ax.set_ylim(0, None)
        ax.legend(loc="best", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
