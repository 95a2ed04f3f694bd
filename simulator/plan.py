"""`baton plan`: which fleet shape of N engines serves a workload best, by simulation.

    baton plan TRACE.jsonl --profile P.json --engines 8 --goodput ttft:2000 tpot:100
    baton plan --dataset mix --request-rate 4 --profile P.json --engines 4 --goodput ttft:800

Shapes of the budget are simulated on the same workload (simulator/run.py, the real
scheduler over the profile's step times): the all-NORMAL fleet (every request co-located),
every prompt:completion split (every request disaggregated), and mixed fleets on a coarse grid
(a quarter, half or three quarters of the budget as normal engines, the rest split a quarter,
half or three quarters prompt; the router's path policy choosing each request's path from the
profile's predicted costs, as `baton up --profile`). Shapes are ranked by goodput (requests
per second meeting every SLO), ties by p90 TTFT; the table names each shape's path policy. A budget no shape can meet (fewer
than `--min-good-fraction` of the requests within the SLOs) gets a plan that says so and names
the nearest feasible SLO: the p90 TTFT and the p90 TPOT of the shape that comes closest (the
one whose p90s exceed the SLOs by the smallest factor).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from baton.engine.config import SERVE_MAX_NUM_BATCHED_TOKENS
from baton.perf.profile import Profile, ProfileError
from baton.perf.profile import load as load_profile
from baton.workload.args import add_workload_arguments, workload_from_args
from baton.workload.results import parse_slos
from baton.workload.synthetic import WorkloadConfig
from baton.workload.trace import TraceConfig, TraceError
from simulator.fleet import FleetConfig
from simulator.run import SimConfig, simulate

logger = logging.getLogger(__name__)

FEASIBLE_PERCENTILE = "p90"  # the nearest feasible SLO: what 90% of requests met


@dataclass(frozen=True)
class Shape:
    num_normal: int
    num_prompt: int
    num_completion: int

    @property
    def name(self) -> str:
        split = f"{self.num_prompt}P:{self.num_completion}D"
        if not self.num_normal:
            return split
        return f"{self.num_normal} normal" + (f" + {split}" if self.num_prompt else "")

    @property
    def path_policy(self) -> str:
        if self.num_normal and self.num_prompt:
            return "per request"  # router/path.py PredictedPath on the profile
        return "co-located" if self.num_normal else "disaggregated"


GRID = (0.25, 0.5, 0.75)  # the mixed grid's shares: of the budget normal, of the rest prompt


def _coarse(n: int, lo: int, hi: int) -> list[int]:
    """The grid's shares of `n`, rounded, within [lo, hi], each once."""
    return list(dict.fromkeys(min(hi, max(lo, round(f * n))) for f in GRID)) if lo <= hi else []


def shapes(num_engines: int) -> list[Shape]:
    """Every fleet of `num_engines` the sweep tries: all NORMAL, each P:D split, then the
    mixed shapes of the coarse grid (at least one engine of each role)."""
    if num_engines < 1:
        raise ValueError(f"--engines must be >= 1, got {num_engines}")
    mixed = [Shape(n, p, num_engines - n - p)
             for n in _coarse(num_engines, 1, num_engines - 2)
             for p in _coarse(num_engines - n, 1, num_engines - n - 1)]
    return [Shape(num_engines, 0, 0)] + [Shape(0, p, num_engines - p)
                                         for p in range(1, num_engines)] + mixed


@dataclass
class ShapeResult:
    shape: Shape
    goodput: float  # req/s meeting every SLO
    good_fraction: float  # of the issued requests
    request_throughput: float
    output_throughput: float
    ttft_p90_ms: float
    tpot_p90_ms: float
    num_failed: int

    def row(self) -> str:
        return (f"{self.shape.name:<19}{self.shape.path_policy:<15}{self.goodput:>9.3f}"
                f"{100 * self.good_fraction:>6.0f}%{self.request_throughput:>9.3f}"
                f"{self.output_throughput:>9.1f}{self.ttft_p90_ms:>10.0f}"
                f"{self.tpot_p90_ms:>10.1f}{self.num_failed:>8}")


HEADER = (f"{'shape':<19}{'path':<15}{'goodput':>9}{'good':>7}{'req/s':>9}{'tok/s':>9}"
          f"{'TTFT p90':>10}{'TPOT p90':>10}{'failed':>8}")
PATHS = {"co-located": "co-located path for every request",
         "disaggregated": "disaggregated path for every request",
         "per request": "the path chosen per request from the profile's predicted costs "
                        "(the router's default with --profile)"}


def evaluate(profile: Profile, shape: Shape, base: SimConfig, workload: WorkloadConfig,
             trace: TraceConfig | None) -> ShapeResult:
    fleet = replace(base.fleet, num_normal=shape.num_normal, num_prompt=shape.num_prompt,
                    num_completion=shape.num_completion)
    record = simulate(profile, replace(base, fleet=fleet, label=shape.name), workload, trace)
    s = record["summary"]
    return ShapeResult(shape, s["goodput"], s["num_good"] / max(1, s["num_issued"]),
                       s["request_throughput"], s["output_throughput"],
                       s["ttft_ms"][FEASIBLE_PERCENTILE], s["tpot_ms"][FEASIBLE_PERCENTILE],
                       s["num_failed"])


def plan(profile: Profile, num_engines: int, base: SimConfig, workload: WorkloadConfig,
         trace: TraceConfig | None, min_good_fraction: float = 0.9) -> dict:
    """The sweep's record: every shape's result, best first, and the verdict."""
    if not base.slos_ms:
        raise ValueError("--goodput needs at least one SLO (ttft:MS, tpot:MS or e2e:MS)")
    if not 0 < min_good_fraction <= 1:
        raise ValueError(f"--min-good-fraction must be in (0, 1], got {min_good_fraction}")
    results = [evaluate(profile, s, base, workload, trace) for s in shapes(num_engines)]
    results.sort(key=lambda r: (-r.goodput, r.ttft_p90_ms))
    best = results[0]
    feasible = best.good_fraction >= min_good_fraction
    record = {"engines": num_engines, "slos_ms": base.slos_ms,
              "min_good_fraction": min_good_fraction, "feasible": feasible,
              "best": {"shape": asdict(best.shape), "name": best.shape.name,
                       "path_policy": best.shape.path_policy},
              "shapes": [{**asdict(r), "shape": asdict(r.shape), "name": r.shape.name,
                          "path_policy": r.shape.path_policy} for r in results]}
    if not feasible:
        record["nearest_feasible_slos_ms"] = nearest_feasible(results, base.slos_ms)
    return record


def nearest_feasible(results: list[ShapeResult], slos_ms: dict[str, float]) -> dict:
    """The shape whose p90 latencies exceed the SLOs by the least factor, and those p90s."""
    def p90(r: ShapeResult) -> dict[str, float]:
        return {"ttft": r.ttft_p90_ms, "tpot": r.tpot_p90_ms}

    def excess(r: ShapeResult) -> float:
        return max((p90(r)[k] / v if v > 0 else math.inf) for k, v in slos_ms.items()
                   if k in ("ttft", "tpot")) if set(slos_ms) & {"ttft", "tpot"} else 0.0

    closest = min((r for r in results if r.request_throughput > 0), key=excess,
                  default=results[0])
    slos = {k: math.ceil(v) for k, v in p90(closest).items() if k in slos_ms}
    return {"shape": closest.shape.name, **slos}


def format_plan(record: dict) -> str:
    slos = " ".join(f"{k}<={v:g}ms" for k, v in record["slos_ms"].items())
    lines = [f"== plan: {record['engines']} engines, SLOs {slos} ==", HEADER]
    fields = set(ShapeResult.__dataclass_fields__) - {"shape"}
    for r in record["shapes"]:
        result = ShapeResult(shape=Shape(**r["shape"]), **{k: r[k] for k in fields})
        lines.append(result.row())
    best = record["best"]
    if record["feasible"]:
        lines.append(f"best: {best['name']} ({PATHS[best['path_policy']]})")
        runners = [f"{r['name']} {r['goodput']:.3f} req/s ({r['path_policy']})"
                   for r in record["shapes"][1:3]]
        if runners:
            lines.append("then: " + ", ".join(runners))
    else:
        near = record["nearest_feasible_slos_ms"]
        given = " ".join(f"{k}:{v:g}" for k, v in near.items() if k != "shape")
        lines.append(f"no shape of {record['engines']} engines meets {slos} for "
                     f"{100 * record['min_good_fraction']:.0f}% of requests; nearest feasible "
                     f"SLO: --goodput {given} ({near['shape']}'s p90 of each)")
    return "\n".join(lines)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="sweep fleet shapes of N engines through the simulator")
    p.add_argument("trace_file", nargs="?", default="", metavar="TRACE",
                   help="a Mooncake jsonl trace (same as --trace)")
    p.add_argument("--profile", required=True, help="profile JSON (`baton profile --out`)")
    p.add_argument("--engines", type=int, required=True, help="the budget: engines in all")
    p.add_argument("--goodput", nargs="+", required=True, metavar="KEY:MS",
                   help="SLOs, e.g. ttft:2000 tpot:100")
    p.add_argument("--min-good-fraction", type=float, default=0.9,
                   help="a shape is feasible when at least this share meets every SLO")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="synthetic workloads: requests/s (Poisson)")
    p.add_argument("--num-requests", type=int, default=200,
                   help="synthetic: requests (multi-turn: conversations); a trace: the first N")
    p.add_argument("--num-blocks", type=int, default=0,
                   help="KV blocks per engine (default: the profiled engine's)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=SERVE_MAX_NUM_BATCHED_TOKENS,
                   help="a prompt step's token budget (default: `baton engine`'s)")
    add_workload_arguments(p)
    p.add_argument("--out", default="", help="write the plan's JSON here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # A sweep builds engines by the dozen: their start-up lines would bury the plan.
    logging.getLogger("baton.engine").setLevel(max(logging.WARNING,
                                                   logging.getLogger().getEffectiveLevel()))
    try:
        if args.trace_file:
            if args.trace:
                raise ValueError("give the trace once: TRACE or --trace")
            args.trace = args.trace_file
        profile = load_profile(args.profile)
        workload, trace = workload_from_args(args)
        fleet = FleetConfig(num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs,
                            max_num_batched_tokens=args.max_num_batched_tokens)
        base = SimConfig(fleet=fleet, request_rate=args.request_rate,
                         num_requests=args.num_requests, slos_ms=parse_slos(args.goodput),
                         label="plan")
        record = plan(profile, args.engines, base, workload, trace, args.min_good_fraction)
    except (ProfileError, TraceError, ValueError) as exc:
        print(f"baton plan: {exc}", file=sys.stderr)
        return 2
    print(format_plan(record))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))
        print(f"wrote {args.out}")
    return 0 if record["feasible"] else 1
