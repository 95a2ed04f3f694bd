"""TTFT and TPOT against request rate for several fleet shapes, from `baton sim`.

    .venv/bin/python bench/sim_sweep.py --profile tests/data/profile_test.json \
        --shapes 4n 2p2c 1p3c --rates 2 4 8 12 16 20 24 --num-requests 400

A shape is `<N>n` (N co-located engines) or `<P>p<C>c` (P prompt + C completion engines). Each
point is one simulated run of the synthetic workload (`--dataset`, default mix: chat turns with
10% ~1500-token documents) at that Poisson rate, same seed for every point. Prints a table;
writes bench/results/sim_sweep.json and sim_sweep.png (TTFT p50/p90 and TPOT p50 against rate,
one line per shape; goodput beside them when --goodput is given).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
from pathlib import Path

from baton.perf.profile import load as load_profile
from baton.workload.results import parse_slos
from baton.workload.synthetic import DATASETS, WorkloadConfig
from simulator.fleet import FleetConfig
from simulator.run import SimConfig, simulate

ROOT = Path(__file__).resolve().parents[1]
SHAPE = re.compile(r"^(?:(\d+)n|(\d+)p(\d+)c)$")


def parse_shape(text: str) -> FleetConfig:
    m = SHAPE.match(text)
    if m is None:
        raise argparse.ArgumentTypeError(f"a shape is <N>n or <P>p<C>c, got {text!r}")
    if m.group(1):
        return FleetConfig(num_normal=int(m.group(1)))
    return FleetConfig(num_normal=0, num_prompt=int(m.group(2)), num_completion=int(m.group(3)))


def shape_name(fleet: FleetConfig) -> str:
    return (f"{fleet.num_normal} normal" if fleet.num_normal else
            f"{fleet.num_prompt} prompt + {fleet.num_completion} completion")


def point(profile, fleet: FleetConfig, rate: float, args: argparse.Namespace) -> dict:
    cfg = SimConfig(fleet=fleet, request_rate=rate, num_requests=args.num_requests,
                    slos_ms=parse_slos(args.goodput), label="sweep")
    rec = simulate(profile, cfg, WorkloadConfig(dataset=args.dataset, seed=args.seed))
    s = rec["summary"]
    busy = [e["busy_fraction"] for e in rec["fleet"]["engines"]]
    return {"rate": rate, "ttft_p50_ms": s["ttft_ms"]["median"], "ttft_p90_ms": s["ttft_ms"]["p90"],
            "tpot_p50_ms": s["tpot_ms"]["median"], "e2e_mean_ms": s["e2e_ms"]["mean"],
            "goodput": s["goodput"], "throughput": s["request_throughput"],
            "num_completed": s["num_completed"], "mean_busy": sum(busy) / len(busy),
            "sim_wall_s": rec["sim_wall_s"]}


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("ttft_p50_ms", "TTFT p50 (ms)"), ("ttft_p90_ms", "TTFT p90 (ms)"),
              ("tpot_p50_ms", "TPOT p50 (ms)")]
    if record["slos_ms"]:
        panels.append(("goodput", "goodput (req/s meeting the SLOs)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    for ax, (key, title) in zip(axes, panels, strict=True):
        for shape in record["shapes"]:
            pts = shape["points"]
            ax.plot([p["rate"] for p in pts], [p[key] for p in pts], marker="o", ms=3,
                    label=shape["name"])
        ax.set_title(title)
        ax.set_xlabel("request rate (req/s)")
        if key.startswith("ttft"):
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"baton sim: {record['dataset']} workload, {record['num_requests']} requests "
                 f"a point, profile {record['profile']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", default=str(ROOT / "tests/data/profile_test.json"))
    p.add_argument("--shapes", nargs="+", type=parse_shape,
                   default=[parse_shape(s) for s in ("4n", "2p2c", "1p3c")])
    p.add_argument("--rates", nargs="+", type=float, default=[2, 4, 8, 12, 16, 20, 24, 28])
    p.add_argument("--num-requests", type=int, default=400)
    p.add_argument("--dataset", default="mix", choices=DATASETS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--goodput", nargs="*", default=["ttft:1000", "tpot:50"], metavar="KEY:MS")
    p.add_argument("--out", default=str(ROOT / "bench/results/sim_sweep.json"))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    profile = load_profile(args.profile)
    record = {"profile": os.path.relpath(Path(args.profile).resolve(), ROOT),
              "dataset": args.dataset, "num_requests": args.num_requests, "seed": args.seed,
              "slos_ms": parse_slos(args.goodput), "load_average": list(os.getloadavg()),
              "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "shapes": []}
    print(f"{'fleet':<26}{'rate':>6}{'TTFT p50':>10}{'TTFT p90':>10}{'TPOT p50':>10}"
          f"{'goodput':>9}{'busy':>6}")
    for fleet in args.shapes:
        pts = []
        for rate in args.rates:
            pts.append(point(profile, fleet, rate, args))
            q = pts[-1]
            print(f"{shape_name(fleet):<26}{rate:>6g}{q['ttft_p50_ms']:>10.0f}"
                  f"{q['ttft_p90_ms']:>10.0f}{q['tpot_p50_ms']:>10.1f}{q['goodput']:>9.2f}"
                  f"{100 * q['mean_busy']:>5.0f}%", flush=True)
        record["shapes"].append({"name": shape_name(fleet), "fleet": vars(fleet), "points": pts})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    out.write_text(json.dumps(record, indent=1))
    plot(record, out.with_suffix(".png"))
    print(f"wrote {os.path.relpath(out, ROOT)} and {os.path.relpath(out.with_suffix('.png'), ROOT)}"
          f" (load average {os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
