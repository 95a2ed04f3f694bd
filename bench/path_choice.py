"""A mixed fleet's path policy against always co-located and always disaggregated, on the same
fleet and the same mixed-length workload (router/path.py), on mock engines and in the simulator:

    .venv/bin/python bench/path_choice.py --repeats 2 --request-rate 3
    .venv/bin/python bench/path_choice.py --sim-only --repeats 5   # the simulator alone

1. `baton up --mock PROFILE --normal-engines 1 --prompt-engines 1 --completion-engines 1`
   (mock engines: the real engine loop, scheduler, registry, router and KV transfer, the model
   replaced by the profile's step times), with the router's policy one of:
     colocated      `--pd-threshold-tokens 1000000`: every request on the normal engine
     disaggregated  `--pd-threshold-tokens 0`: every request prompted and completed
     predicted      `--profile PROFILE`: each request's path from the predicted cost
2. bench/serve_bench.py sends the `mix` workload (chat prompts of ~64 tokens, a fraction of
   ~1500-token documents) through /v1/completions at a Poisson rate, seeded per repeat, the
   policies interleaved within each repeat so a drift of this host's load hits all three.
3. `baton sim` runs the same fleet, policies, workload and seeds in virtual time: the same
   path policy class (router/path.py) chooses each request's path from the simulated router's
   books, over the real scheduler and the profile's step and KV pull times.
4. Per policy and source (mock, sim): goodput, TTFT and TPOT (median of the repeats, min-max
   across them) and the paths taken (the router's baton_router_path_total; the simulator's
   `fleet.path_total`).

Writes bench/results/path_choice.json (with --sim-only: path_choice_sim.json). Figures depend
on the profile: with the test profile the engines are the profile's idea of this host, not a
measurement of it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_bench as sb  # noqa: E402 - a sibling script, not a package
from repo_paths import relative_args  # noqa: E402

from baton.ops.up_process import UpError, UpProcess, start_up  # noqa: E402
from baton.perf.profile import load as load_profile  # noqa: E402
from baton.workload.synthetic import WorkloadConfig  # noqa: E402
from simulator.fleet import FleetConfig  # noqa: E402
from simulator.run import SimConfig, simulate  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("colocated", "disaggregated", "predicted")
SIM_THRESHOLDS = {"colocated": 1_000_000, "disaggregated": 0, "predicted": None}
MAX_NUM_BATCHED_TOKENS = 1024  # the engines' default (`baton up` passes none)


def policy_flags(policy: str, profile: str) -> list[str]:
    return {"colocated": ["--pd-threshold-tokens", "1000000"],
            "disaggregated": ["--pd-threshold-tokens", "0"],
            "predicted": ["--profile", profile]}[policy]


def start_fleet(args: argparse.Namespace, policy: str) -> UpProcess:
    """The mixed mock fleet with `policy`'s router flags, up (or SystemExit)."""
    try:
        return start_up(["--mock", args.profile, "--no-cpu-pinning", "--no-metrics",
                         "--normal-engines", "1", "--prompt-engines", "1",
                         "--completion-engines", "1", *policy_flags(policy, args.profile), "--",
                         "--num-blocks", str(args.num_blocks), "--max-num-seqs",
                         str(args.max_num_seqs)],
                        ready_timeout_s=args.ready_timeout, keep_stderr=False)
    except UpError as exc:
        raise SystemExit(f"baton up --mock ({policy}): {exc}") from exc


def path_counts(base_url: str) -> dict[str, float]:
    counts: dict[str, float] = {}
    for line in httpx.get(f"{base_url}/metrics", timeout=10).text.splitlines():
        if line.startswith("baton_router_path_total{"):
            labels, value = line[len("baton_router_path_total{"):].split("} ")
            path = dict(p.split("=") for p in labels.split(","))["path"].strip('"')
            counts[path] = counts.get(path, 0) + float(value)
    return counts


def one_run(args: argparse.Namespace, policy: str, seed: int) -> dict:
    fleet = start_fleet(args, policy)
    base_url = fleet.base_url
    try:
        cfg = sb.BenchConfig(base_url=base_url, endpoint="completions",
                             request_rate=args.request_rate, num_requests=args.num_requests,
                             slos_ms={"ttft": args.ttft_slo, "tpot": args.tpot_slo},
                             label=f"path_{policy}_{seed}", progress=False)
        workload = WorkloadConfig(dataset="mix", long_fraction=args.long_fraction, seed=seed)
        record = asyncio.run(sb.run_async(cfg, workload))
        paths = path_counts(base_url)
    finally:
        fleet.stop()
    return _figures("mock", policy, seed, paths, record["summary"])


def sim_run(args: argparse.Namespace, policy: str, seed: int) -> dict:
    """The same fleet, policy, workload and seed in the simulator (virtual time)."""
    fleet = FleetConfig(num_normal=1, num_prompt=1, num_completion=1, num_blocks=args.num_blocks,
                        max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS)
    cfg = SimConfig(fleet=fleet, request_rate=args.request_rate, num_requests=args.num_requests,
                    slos_ms={"ttft": args.ttft_slo, "tpot": args.tpot_slo},
                    label=f"path_sim_{policy}_{seed}",
                    pd_threshold_tokens=SIM_THRESHOLDS[policy])
    workload = WorkloadConfig(dataset="mix", long_fraction=args.long_fraction, seed=seed)
    record = simulate(load_profile(args.profile), cfg, workload)
    paths: dict[str, float] = {}
    for p in record["fleet"]["path_total"]:
        paths[p["path"]] = paths.get(p["path"], 0) + p["count"]
    return _figures("sim", policy, seed, paths, record["summary"])


def _figures(source: str, policy: str, seed: int, paths: dict, s: dict) -> dict:
    return {"source": source, "policy": policy, "seed": seed, "paths": paths,
            "num_failed": s["num_failed"], "goodput": s["goodput"],
            "ttft_median_ms": s["ttft_ms"]["median"], "ttft_p90_ms": s["ttft_ms"]["p90"],
            "tpot_median_ms": s["tpot_ms"]["median"], "tpot_p90_ms": s["tpot_ms"]["p90"]}


def spread(runs: list[dict], key: str) -> str:
    values = [r[key] for r in runs]
    return f"{np.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]" \
        if key == "goodput" else f"{np.median(values):.0f} [{min(values):.0f}-{max(values):.0f}]"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", default=str(ROOT / "tests/data/profile_test.json"))
    p.add_argument("--request-rate", type=float, default=3.0)
    p.add_argument("--num-requests", type=int, default=60)
    p.add_argument("--long-fraction", type=float, default=0.2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--ttft-slo", type=float, default=1500.0, help="goodput's TTFT SLO, ms")
    p.add_argument("--tpot-slo", type=float, default=40.0, help="goodput's TPOT SLO, ms")
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--sim-only", action="store_true",
                   help="only the simulator's runs (seconds), no mock fleet")
    p.add_argument("--results-dir", default=str(ROOT / "bench/results"))
    args = p.parse_args(argv)

    runs = []
    for seed in range(args.repeats):
        for policy in POLICIES:
            runs.append(sim_run(args, policy, seed))
            if not args.sim_only:
                runs.append(one_run(args, policy, seed))
    print(f"mixed fleet 1 normal + 1 prompt + 1 completion ({Path(args.profile).name}), "
          f"mix workload ({args.long_fraction:.0%} long), {args.num_requests} requests at "
          f"{args.request_rate:g} req/s, SLOs ttft<={args.ttft_slo:g} tpot<={args.tpot_slo:g} ms, "
          f"{args.repeats} repeats: median [min-max]; load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print("| policy | source | goodput req/s | TTFT median ms | TTFT p90 ms | TPOT median ms | "
          "TPOT p90 ms | co-located + disaggregated | failed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for policy in POLICIES:
        for source in ("mock", "sim"):
            mine = [r for r in runs if r["policy"] == policy and r["source"] == source]
            if not mine:
                continue
            split = "+".join(f"{sum(r['paths'].get(k, 0) for r in mine):.0f}"
                             for k in ("colocated", "disaggregated"))
            print(f"| {policy} | {source} | {spread(mine, 'goodput')} | "
                  f"{spread(mine, 'ttft_median_ms')} | {spread(mine, 'ttft_p90_ms')} | "
                  f"{spread(mine, 'tpot_median_ms')} | {spread(mine, 'tpot_p90_ms')} | {split} | "
                  f"{sum(r['num_failed'] for r in mine)} |")
    out = Path(args.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = "path_choice_sim.json" if args.sim_only else "path_choice.json"
    (out / name).write_text(json.dumps({"args": relative_args(vars(args)),
                                        "load_average": os.getloadavg(), "runs": runs},
                                       indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
