"""A fleet of mock engines behind one router, replaying a trace: does the router keep up, and
what does the live path add to what the simulator predicts for the same requests?

    .venv/bin/python bench/mock_fleet.py --profile tests/data/profile_test.json \
        --normal-engines 16 --num-requests 200 --time-scale 0.5 --length-scale 0.0625

1. `baton up --mock PROFILE` starts Redis, the mock engines (the real engine loop, scheduler,
   ZMQ, registry and KV transfer; only the model replaced by the profile's step times) and the
   router, all processes on this host.
2. bench/serve_bench.py replays the trace through /v1/completions (no chat template, so a
   prompt has the token count the simulator gives it), on the trace's own arrival times.
3. `baton sim` runs the same requests over the same fleet shape in virtual time. Per request,
   measured TTFT (and end-to-end) minus predicted is what the live path adds: the router,
   the wires, and this host's process scheduling (the simulator has none of them).

Reports: the sustained request rate (completed / wall time) against the offered one, failures
(must be 0), and the added latency p50/p99. Writes bench/results/mock_fleet_<label>_<time>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_bench as sb  # noqa: E402 - a sibling script, not a package

from baton.ops.redis_server import free_port  # noqa: E402
from baton.perf.profile import load as load_profile  # noqa: E402
from baton.workload.synthetic import WorkloadConfig  # noqa: E402
from baton.workload.trace import TraceConfig  # noqa: E402
from simulator.fleet import FleetConfig  # noqa: E402
from simulator.run import SimConfig, simulate  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def start_fleet(args: argparse.Namespace, port: int) -> subprocess.Popen:
    fleet = (["--normal-engines", str(args.normal_engines)] if args.normal_engines else
             ["--prompt-engines", str(args.prompt_engines),
              "--completion-engines", str(args.completion_engines)])
    proc = subprocess.Popen(
        [sys.executable, "-m", "baton_cli", "up", "--port", str(port), "--mock", args.profile,
         "--no-cpu-pinning", "--no-metrics", *fleet, "--", "--num-blocks", str(args.num_blocks),
         "--max-num-seqs", str(args.max_num_seqs)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    deadline = time.monotonic() + args.ready_timeout
    for line in proc.stdout:  # the banner's last line says it is up
        if "Ctrl-C stops" in line:
            return proc
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise SystemExit(f"baton up --mock did not come up within {args.ready_timeout:g} s")


def stop_fleet(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


def compare(live: dict, sim: dict) -> dict:
    """Per request (by index), measured minus predicted TTFT and end-to-end, in ms."""
    predicted = {r["idx"]: r for r in sim["requests"] if r["ok"]}
    d_ttft, d_e2e = [], []
    for r in live["requests"]:
        p = predicted.get(r["idx"])
        if r["ok"] and p is not None:
            d_ttft.append(1e3 * (r["ttft_s"] - p["ttft_s"]))
            d_e2e.append(1e3 * (r["e2e_s"] - p["e2e_s"]))
    return {"num_compared": len(d_ttft),
            "added_ttft_ms": {"p50": pct(d_ttft, 50), "p99": pct(d_ttft, 99)},
            "added_e2e_ms": {"p50": pct(d_e2e, 50), "p99": pct(d_e2e, 99)}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", default=str(ROOT / "tests/data/profile_test.json"))
    p.add_argument("--trace", default=str(ROOT / "tests/data/mooncake_conversation_window.jsonl"))
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--length-scale", type=float, default=1 / 16)
    p.add_argument("--normal-engines", type=int, default=16)
    p.add_argument("--prompt-engines", type=int, default=0)
    p.add_argument("--completion-engines", type=int, default=0)
    # Over 10% of the pool free for the trace's longest prompt: a prompt past the watermark
    # (0.9) of its engine's pool stalls there (the scheduler's, so real engines too).
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--label", default="")
    p.add_argument("--results-dir", default=str(ROOT / "bench/results"))
    args = p.parse_args(argv)
    if args.prompt_engines or args.completion_engines:
        args.normal_engines = 0
    shape = (f"normal{args.normal_engines}" if args.normal_engines else
             f"pd{args.prompt_engines}x{args.completion_engines}")
    label = args.label or f"mock_{shape}"
    trace = TraceConfig(args.trace, num_requests=args.num_requests, time_scale=args.time_scale,
                        length_scale=args.length_scale)
    workload = WorkloadConfig()  # with a trace only its seed is used

    port = free_port()
    t0 = time.monotonic()
    proc = start_fleet(args, port)
    up_s = time.monotonic() - t0
    try:
        cfg = sb.BenchConfig(base_url=f"http://127.0.0.1:{port}", endpoint="completions",
                             num_requests=args.num_requests, label=label, progress=False)
        live = asyncio.run(sb.run_async(cfg, workload, trace))
    finally:
        stop_fleet(proc)

    fleet = FleetConfig(num_normal=args.normal_engines, num_prompt=args.prompt_engines,
                        num_completion=args.completion_engines, num_blocks=args.num_blocks,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=1024)
    out = Path(args.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (out / f"mock_fleet_{label}_{stamp}_live.json").write_text(json.dumps(live, default=str))
    sim = simulate(load_profile(args.profile),
                   SimConfig(fleet=fleet, num_requests=args.num_requests, label=label),
                   workload, trace)
    s = live["summary"]
    arrivals = [r["start_s"] for r in live["requests"]]
    span = max(arrivals) - min(arrivals) if arrivals else 0.0
    record = {"label": label, "shape": shape, "num_engines": args.normal_engines
              + args.prompt_engines + args.completion_engines, "up_s": up_s,
              "offered_rate": (len(arrivals) - 1) / span if span else math.inf,
              "sustained_rate": s["num_completed"] / s["duration_s"],
              "num_completed": s["num_completed"], "num_failed": s["num_failed"],
              "errors": s["errors"], "live": {k: s[k] for k in ("ttft_ms", "e2e_ms", "tpot_ms")},
              "sim": {k: sim["summary"][k] for k in ("ttft_ms", "e2e_ms", "tpot_ms")},
              **compare(live, sim), "trace": vars(trace)}
    print(f"{shape}: {record['num_completed']} completed, {record['num_failed']} failed; "
          f"offered {record['offered_rate']:.1f} req/s, sustained "
          f"{record['sustained_rate']:.1f} req/s (fleet up in {up_s:.0f} s)")
    print(f"{'':<14}{'live p50':>10}{'sim p50':>10}{'added p50':>11}{'added p99':>11}")
    for key, added in (("ttft_ms", "added_ttft_ms"), ("e2e_ms", "added_e2e_ms")):
        print(f"{key:<14}{record['live'][key]['median']:>10.1f}"
              f"{record['sim'][key]['median']:>10.1f}{record[added]['p50']:>11.1f}"
              f"{record[added]['p99']:>11.1f}")
    path = out / f"mock_fleet_{label}_{stamp}.json"
    path.write_text(json.dumps(record, indent=1, default=str))
    print(f"wrote {path}")
    return 0 if record["num_failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
