"""The simulator against real runs on this machine: same workload, same seed, same fleet shape.

    .venv/bin/python bench/sim_validate.py --runs 3            # fits a profile first
    .venv/bin/python bench/sim_validate.py --profile P.json --runs 1 --num-requests 16

1. One profile, fitted once (`baton profile --out bench/results/sim_validate_profile.json`,
   `--quick` with --quick-profile), unless --profile names one: it must hold on both
   workloads below.
2. Workloads: a window of the Mooncake trace at reduced scale (tests/data's window,
   --length-scale, the first --num-requests lines, its arrivals scaled to the point's mean
   rate; each 3 s timestamp bin's requests spread evenly over it, --spread-bursts, unless
   --keep-bursts: kept, every bin is a burst and every rate an overload) and a synthetic one
   (--dataset, Poisson at the point's rate).
3. Setups: co-located (1 normal engine) and disaggregated (1 prompt + 1 completion engine),
   real engines (`baton up`, the default model) with the pool and batch limits the simulator
   is given, one torch thread each (the profile's).
4. Rates per setup and workload: light, near the knee and overloaded, as fractions
   (--load-fractions, default 0.3 0.75 1.5) of the capacity the simulator predicts for that
   setup (its throughput with every request sent at once).
5. Per point: the simulator's prediction, then --runs real runs (the prefix cache reset before
   each, as the simulator starts cold), reported as predicted vs the real runs' median
   [min-max] of TTFT p50/p90, TPOT p50, mean end-to-end latency and goodput; the error against
   the target (10%, or the real runs' spread where that is larger; 25% overloaded).
6. Before each real run, a speed probe (simulator/calibrate.py `speed_probe`, ~7 s; --no-probe
   skips it): fixed requests through the same fleet (lone prompts, one stream decoding alone,
   a burst that decodes together), the engines' busy seconds against the simulator's for the
   same requests, fitted with a prompt-step and a decode-step factor. This host's speed drifts
   by 10-30% within an hour, which is not the simulator's error: each point is also predicted
   with the profile scaled by the median of its probes' factors (`at_probe`).
   A point's rate is a fraction of the capacity at the speed one more probe finds just
   before the point (--rate-from probe, the default; `rate_basis`): "the knee" is 0.75 of
   what the host does now, not of what the profile said minutes ago (a host 15% slower
   than its profile puts a 0.75 point at 0.88, where queueing multiplies every error).
   Runs 1-10 took the raw profile's capacity (--rate-from profile; --no-probe's).
7. And at the runs' own speed (`at_run_speed`): the profile scaled by the real engines' busy
   seconds in prompt steps, and in decode steps, over the simulator's (runs 1-10's engines,
   which did not split them: per role disaggregated, one factor co-located). It reads the
   runs it is compared with, so it is no prediction: it is what the simulator gets wrong once
   it knows how fast the host ran, the host's speed set apart.
8. With --mock the fleet is mock engines of --profile (`baton up --mock`): the same points,
   rates and workloads against the real router, engine loop, scheduler and wires, every step a
   sleep of the profile's price: the simulator against the serving stack alone.

Writes bench/results/sim_validate.json (every run's summary, its requests one by one, and the
engines' busy time: the simulator's, and the real engines' from their /metrics) and prints the
table. A run on a loaded host measures the host's load too: the load average is recorded with
every run. With --step-check, first: each workload's prompts through one real engine in this
process, every step's time against the profile's prediction by kind of step
(baton/perf/check.py), what the fit gets wrong apart from the service around the engines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, replace
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_bench as sb  # noqa: E402 - a sibling script, not a package

from baton.ops.cpus import parse_cpus  # noqa: E402
from baton.ops.up_process import UpError, UpProcess  # noqa: E402
from baton.perf.check import check_steps, format_groups  # noqa: E402
from baton.perf.profile import load as load_profile  # noqa: E402
from baton.workload.args import build_specs  # noqa: E402
from baton.workload.results import RequestResult, parse_slos  # noqa: E402
from baton.workload.synthetic import DATASETS, WorkloadConfig  # noqa: E402
from baton.workload.trace import TraceConfig, build_trace_workload  # noqa: E402
from simulator.calibrate import (  # noqa: E402
    fit_speed,
    probe_of,
    probe_prediction,
    speed_probe,
)
from simulator.fleet import FleetConfig  # noqa: E402
from simulator.run import SimConfig, simulate  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# The real fleet, its router and this client share this machine's cores (those it may run on).
HOST_CORES = len(os.sched_getaffinity(0))
SETUPS = {"colo": FleetConfig(num_normal=1),
          "pd": FleetConfig(num_normal=0, num_prompt=1, num_completion=1)}
LEVELS = ("light", "knee", "overloaded")
METRICS = (("ttft_p50", "ttft_ms", "median"), ("ttft_p90", "ttft_ms", "p90"),
           ("tpot_p50", "tpot_ms", "median"), ("e2e_mean", "e2e_ms", "mean"))


def rel(path: str | Path) -> str:
    """A path in the repository relative to its root; outside it, the file's name only."""
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else p.name


def fit_profile(args: argparse.Namespace) -> str:
    out = ROOT / "bench/results/sim_validate_profile.json"
    cmd = [sys.executable, "-m", "baton_cli", "profile", "--out", str(out),
           *(["--quick"] if args.quick_profile else [])]
    print("fitting the profile:", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, timeout=3600)
    return str(out)


# --------------------------------------------------------------------------- workloads
def workload_at(kind: str, args: argparse.Namespace, rate: float):
    """(WorkloadConfig, TraceConfig | None, request_rate) of `kind` offered at `rate` req/s."""
    workload = WorkloadConfig(dataset=args.dataset, seed=args.seed, input_len=args.input_len,
                              output_len=args.output_len)
    if kind == "synthetic":
        return workload, None, rate
    # A record from before --keep-bursts (runs 1-4b) replayed the bins as bursts.
    base = TraceConfig(str(args.trace), args.num_requests, 1.0, args.length_scale,
                       spread_bursts=not getattr(args, "keep_bursts", True))
    arrivals = [s.arrival_s for s in build_trace_workload(base)]
    if max(arrivals) == min(arrivals):
        raise SystemExit(f"the first {args.num_requests} lines of {rel(args.trace)} arrive at "
                         "once: no rate to scale; take more (--num-requests)")
    native = (len(arrivals) - 1) / (max(arrivals) - min(arrivals))
    return workload, replace(base, time_scale=native / rate if math.isfinite(rate) else 1e-6), \
        math.inf


def sim_config(setup: str, args: argparse.Namespace, rate: float, profile) -> SimConfig:
    """The simulator's fleet and load for a point. The real fleet's engines share this host:
    disaggregated, the simulated ones do too (`engines_per_host` 2: each slows the other's
    steps by the profile's `contention`) when the profile has it measured and the engines are
    real (mock engines sleep: they do not slow each other); and the router and this client
    share its cores with them (`service_cores`: with two engines on two cores, their CPU comes
    out of the engines' steps; one engine leaves them a core) when the profile has their CPU
    measured (profiles before run 19 lack it)."""
    mock = getattr(args, "mock", False)
    shared = bool(SETUPS[setup].num_prompt and profile.contention is not None and not mock)
    fleet = replace(SETUPS[setup], num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs,
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    engines_per_host=2 if shared else 1,
                    service_cores=HOST_CORES if not mock and profile.service_cpu_ms(1) > 0
                    else 0)
    return SimConfig(fleet=fleet, request_rate=rate, num_requests=args.num_requests,
                     slos_ms=parse_slos(args.goodput), label=f"sim_{setup}")


def predict(profile, kind: str, setup: str, args: argparse.Namespace, rate: float) -> dict:
    """The simulator's record of this point (summary, requests, fleet)."""
    workload, trace, request_rate = workload_at(kind, args, rate)
    return simulate(profile, sim_config(setup, args, request_rate, profile), workload, trace)


def capacity(profile, kind: str, setup: str, args: argparse.Namespace) -> float:
    """Requests/s the simulator says this setup completes with all of them sent at once."""
    return predict(profile, kind, setup, args, math.inf)["summary"]["request_throughput"]


def requests_of(record: dict) -> list[dict]:
    """One line per request (sim or real), in milliseconds: what the summary hides."""
    out = []
    for r in (RequestResult(**d) for d in record["requests"]):
        out.append({"idx": r.idx, "kind": r.kind, "ok": r.ok,
                    "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
                    "output_tokens": r.output_tokens, "start_s": round(r.start_s, 4),
                    "ttft_ms": round(1e3 * r.ttft_s, 2), "tpot_ms": round(1e3 * r.tpot_s, 3),
                    "e2e_ms": round(1e3 * r.e2e_s, 2),
                    "itl0_ms": round(1e3 * r.itl_s[0], 2) if r.itl_s else None})
    return out


def predicted_side(level: str, sim: dict, runs: list[dict]) -> dict:
    """A point's simulated record (`predict`) and its comparison with the real runs'
    summaries."""
    return {"predicted": sim["summary"], "predicted_fleet": sim["fleet"],
            "predicted_requests": requests_of(sim),
            "compare": compare(level, sim["summary"], runs)}


def busy_of(fleet: dict | None) -> dict:
    """role -> (busy seconds, steps) summed over the engines of that role."""
    out: dict[str, list[float]] = {}
    for e in (fleet or {}).get("engines", []):
        acc = out.setdefault(e["role"], [0.0, 0])
        acc[0] += e.get("busy_s", 0.0)
        acc[1] += e.get("num_steps", 0)
    return out


def split_of(fleet: dict | None) -> tuple[float, float] | None:
    """(prompt steps' busy seconds, decode steps') over a record's engines; None where an
    engine does not split its busy time (the real engines of runs 1-10)."""
    engines = (fleet or {}).get("engines", [])
    if not engines or any("prefill_busy_s" not in e for e in engines):
        return None
    prompt = sum(e["prefill_busy_s"] for e in engines)
    return prompt, sum(e["busy_s"] for e in engines) - prompt


def splits_of(point: dict) -> tuple[tuple[float, float], tuple[float, float]] | None:
    """A point's (prompt steps', decode steps') busy seconds: the simulator's, and the median
    of its real runs'; None where either does not split them."""
    sim = split_of(point.get("predicted_fleet"))
    real = [s for s in map(split_of, point.get("runs_fleet") or []) if s]
    if sim is None or not real:
        return None
    return sim, (_median([s[0] for s in real]), _median([s[1] for s in real]))


def step_check(profile, kind: str, args: argparse.Namespace) -> dict:
    """`kind`'s prompts through one real engine here, its steps against the profile."""
    workload, trace, _ = workload_at(kind, args, 1.0)
    specs = build_specs(workload, trace, args.num_requests)
    return check_steps(profile, [(s.text, s.max_tokens) for s in specs],
                       num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens)


# --------------------------------------------------------------------------- real runs
class RealFleet:
    """`baton up` with real engines of this setup (with --mock, mock engines of the profile);
    stopped on exit."""

    def __init__(self, setup: str, args: argparse.Namespace) -> None:
        self.setup, self.args = setup, args
        self.up: UpProcess | None = None

    def pin_client(self, cpus: set[int]) -> None:
        """This process (the bench client) and the launcher's non-engine children (the router
        and its workers, redis) onto `cpus`; the engines keep the cores `baton up` gave them."""
        import psutil

        os.sched_setaffinity(0, cpus)
        launcher = psutil.Process(self.up.proc.pid)
        for child in launcher.children(recursive=True):
            try:
                if "--engine-id" not in child.cmdline():
                    child.cpu_affinity(sorted(cpus))
            except psutil.NoSuchProcess:
                continue
        launcher.cpu_affinity(sorted(cpus))

    def __enter__(self) -> RealFleet:
        f = SETUPS[self.setup]
        shape = (["--normal-engines", "1"] if f.num_normal else
                 ["--prompt-engines", "1", "--completion-engines", "1"])
        a = self.args
        # A mock engine loads no model: it takes no thread count (and refuses one by name).
        engines = ["--mock", a.profile] if a.mock else []
        threads = [] if a.mock else ["--num-threads", "1"]
        self.up = UpProcess.start(
            [*engines, *shape, "--", *threads, "--num-blocks", str(a.num_blocks),
             "--max-num-seqs", str(a.max_num_seqs), "--max-num-batched-tokens",
             str(a.max_num_batched_tokens), *a.engine_args.split()],
            ready_timeout_s=a.ready_timeout, keep_stderr=False)
        try:
            self.up.__enter__()
        except UpError as exc:
            raise SystemExit(f"baton up ({self.setup}): {exc}") from exc
        return self

    @property
    def url(self) -> str:
        return self.up.base_url

    @property
    def metrics_urls(self) -> list[str]:
        """The engines' /metrics, from the banner."""
        return list(self.up.metrics_urls.values())

    def reset_cache(self) -> None:
        req = urllib.request.Request(f"{self.url}/reset_prefix_cache", method="POST")
        with urllib.request.urlopen(req, timeout=30):
            pass

    def __exit__(self, *exc) -> None:
        self.up.stop()


def probe(fleet: RealFleet, profile, setup: str, args: argparse.Namespace) -> dict:
    """This host's speed now: the probe's requests through the fleet (its cache reset first,
    as the probe's prediction starts cold), busy seconds against the simulator's."""
    fleet.reset_cache()
    try:
        found = asdict(speed_probe(fleet.url, fleet.metrics_urls, profile,
                                   sim_config(setup, args, 1.0, profile).fleet))
    except (RuntimeError, OSError, ValueError, httpx.HTTPError) as exc:  # not a failed run
        print(f"speed probe failed: {exc}", file=sys.stderr, flush=True)
        found = {"error": str(exc)[:500]}
    return {**found, "load_average": list(os.getloadavg())}


def rate_basis(fleet: RealFleet, profile, kind: str, setup: str,
               args: argparse.Namespace) -> tuple[float, dict | None]:
    """The capacity a point's rate is a fraction of, and the probe it was found at: with
    --rate-from probe, the simulator's capacity at the speed a probe finds now (the raw
    profile's if the probe failed: said in its record); else the raw profile's, no probe."""
    if args.rate_from != "probe":
        return capacity(profile, kind, setup, args), None
    found = probe(fleet, profile, setup, args)
    if "error" in found:
        print("the point's rate from the raw profile's capacity", file=sys.stderr, flush=True)
        return capacity(profile, kind, setup, args), found
    return capacity(profile.scaled(*probe_factors(found)), kind, setup, args), found


def measure(fleet: RealFleet, kind: str, args: argparse.Namespace, rate: float) -> dict:
    """One real run's record: its summary (with the load average), requests and fleet."""
    workload, trace, request_rate = workload_at(kind, args, rate)
    fleet.reset_cache()
    cfg = sb.BenchConfig(base_url=fleet.url, endpoint="completions", request_rate=request_rate,
                         num_requests=args.num_requests, slos_ms=parse_slos(args.goodput),
                         label=f"real_{fleet.setup}", progress=False,
                         drain_timeout_s=args.drain_timeout, engine_metrics=fleet.metrics_urls)
    record = asyncio.run(sb.run_async(cfg, workload, trace))
    record["summary"]["load_average"] = list(os.getloadavg())
    return record


# --------------------------------------------------------------------------- the report
def figures(summary: dict) -> dict:
    out = {name: summary[key][stat] for name, key, stat in METRICS}
    out["goodput"] = summary["goodput"]
    out["num_failed"] = summary["num_failed"]
    return out


def compare(level: str, predicted: dict, runs: list[dict]) -> dict:
    """Per figure: predicted, the runs' median/min/max, the error and whether it is within the
    target (10%, or the runs' spread around their median where larger; 25% overloaded)."""
    target = 0.25 if level == "overloaded" else 0.10
    out = {}
    for key in (*(m[0] for m in METRICS), "goodput"):
        vals = sorted(figures(r)[key] for r in runs)
        med = _median(vals)
        pred = figures(predicted)[key]
        err = (pred - med) / med if med else math.nan
        spread = max(med - vals[0], vals[-1] - med) / med if med else math.nan
        out[key] = {"predicted": pred, "median": med, "min": vals[0], "max": vals[-1],
                    "error": err, "spread": spread,
                    "within": bool(abs(err) <= max(target, spread))}
    return out


def _median(values: list[float]) -> float:
    v = sorted(values)
    return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2


# The other predictions of a point beside the profile's as measured, and their names in print.
SIDES = (("at_probe", "the probes' speed"), ("at_run_speed", "the runs' own speed"))


def probe_factors(probe: dict) -> tuple[float, float]:
    """A recorded probe's (prompt-step, decode-step) factors. Run 7's probes, of one phase,
    found one factor for both; run 9's solved three (a decode step's fixed part apart from
    its part per row): refitted here with two, as `speed_probe` now fits."""
    if "predicted_decode_row_s" in probe:
        dec = np.add(probe["predicted_decode_s"], probe["predicted_decode_row_s"])
        fp, fd, _ = fit_speed(probe["predicted_prefill_s"], dec, probe["real_busy_s"])
        return fp, fd
    return probe.get("prefill_factor", probe["factor"]), probe.get("decode_factor", probe["factor"])


def reprobe(probe: dict | None, profile, setup: str, args: argparse.Namespace) -> dict | None:
    """A recorded probe against another profile of the same host (--repredict): the
    simulator's seconds for its phases again, the factors again from the engines' split. A
    probe from engines without the split (runs 7-10), or a failed one, is kept as recorded:
    its phases were not today's."""
    if not probe or "error" in probe or probe.get("real_prefill_s") is None:
        return probe
    pre, dec = probe_prediction(profile, sim_config(setup, args, 1.0, profile).fleet)
    return {**probe, **asdict(probe_of(pre, dec, probe["real_busy_s"],
                                       probe["real_prefill_s"]))}


def at_speed(profile, point: dict, args: argparse.Namespace, fp: float, fd: float) -> dict:
    """The point predicted with the profile at (prompt steps x fp, decode steps x fd),
    compared with the same real runs."""
    sim = predict(profile.scaled(fp, fd), point["workload"], point["setup"], args,
                  point["rate"])
    return {"prefill_factor": fp, "decode_factor": fd, "predicted": sim["summary"],
            "predicted_fleet": sim["fleet"],
            "compare": compare(point["level"], sim["summary"], point["runs"])}


def at_probe(profile, point: dict, args: argparse.Namespace) -> dict | None:
    """The point at the speed its probes found before its runs (the median of each factor);
    None without probes (runs 1-6)."""
    found = [probe_factors(p) for p in point.get("probes") or [] if "error" not in p]
    if not found:
        return None
    return at_speed(profile, point, args, _median([f[0] for f in found]),
                    _median([f[1] for f in found]))


def at_run_speed(profile, point: dict, args: argparse.Namespace) -> dict | None:
    """The point at the speed its real runs' engines ran: their seconds in prompt steps and in
    decode steps (the median run's, from /metrics) over the simulator's for the same
    requests. Engines that do not split their busy time (runs 1-10): per role disaggregated
    (the prompt engine's for prompt steps, the completion engine's for decode steps), one
    factor co-located. Not a prediction (it reads the runs it is compared with): what the
    simulator gets wrong when it knows the host's speed, apart from the speed itself. A
    planner correcting its profile from a live fleet's /metrics has the same figure
    (Dynamo's planner scales its profile by observed over predicted latency)."""
    split = splits_of(point)
    if split and min(split[0]) > 0:
        (sim_pre, sim_dec), (real_pre, real_dec) = split
        return at_speed(profile, point, args, real_pre / sim_pre, real_dec / sim_dec)
    real = [b for b in map(busy_of, point.get("runs_fleet") or []) if b]
    sim = busy_of(point.get("predicted_fleet"))
    if not real or not sim or min(v[0] for v in sim.values()) <= 0:
        return None  # no /metrics read during the runs

    def factor(roles: tuple[str, ...]) -> float:
        pred = sum(sim[r][0] for r in roles if r in sim)
        return _median([sum(b[r][0] for r in roles if r in b) for b in real]) / pred

    if "prompt" in sim and "completion" in sim:
        return at_speed(profile, point, args, factor(("prompt",)), factor(("completion",)))
    f = factor(tuple(sim))
    return at_speed(profile, point, args, f, f)


def _factors(a: dict) -> str:
    """An `at_probe`'s or `at_run_speed`'s factors: prompt steps / decode steps."""
    if "prefill_factor" not in a:  # run 7's: one
        return f"x{a['factor']:.2f}"
    return f"x{a['prefill_factor']:.2f}/x{a['decode_factor']:.2f}"


def _cells(compared: dict) -> list[str]:
    cells = []
    for key in ("ttft_p50", "ttft_p90", "tpot_p50", "e2e_mean", "goodput"):
        c = compared[key]
        cells.append(f"{key} {c['predicted']:.0f} vs {c['median']:.0f} [{c['min']:.0f}-"
                     f"{c['max']:.0f}] {100 * c['error']:+.0f}%{'' if c['within'] else '!'}"
                     if key != "goodput" else
                     f"goodput {c['predicted']:.2f} vs {c['median']:.2f}")
    return cells


def print_point(p: dict) -> None:
    head = f"{p['workload']:<9} {p['setup']:<4} {p['level']:<10} {p['rate']:>6.2f}/s"
    if p.get("rate_probe") and "error" not in p["rate_probe"]:
        fp, fd = probe_factors(p["rate_probe"])
        head += f" (speed x{fp:.2f}/x{fd:.2f})"
    busy = []
    for role, (sim_s, _) in busy_of(p.get("predicted_fleet")).items():
        real = [busy_of(f).get(role, [math.nan])[0] for f in p.get("runs_fleet") or []]
        if real:
            busy.append(f"{role} busy {sim_s:.1f} s vs {_median(real):.1f} s")
    split = splits_of(p)
    if split:
        busy.append(f"prompt steps {split[0][0]:.1f} s vs {split[1][0]:.1f} s")
    print(head + "  " + "; ".join(_cells(p["compare"]) + busy), flush=True)
    for side, name in SIDES:
        if p.get(side):
            print(f"{'':<34}at {name} ({_factors(p[side])}): "
                  + "; ".join(_cells(p[side]["compare"])), flush=True)


def num_within(record: dict, side: str = "") -> int:
    """Figures within target over the record's points: the raw profile's predictions, or with
    side="at_probe" or "at_run_speed" those at that speed (points without it count none)."""
    return sum(c["within"] for pt in record["points"]
               for k, c in ((pt.get(side) or {}).get("compare", {}) if side
                            else pt["compare"]).items()
               if k in ("ttft_p50", "tpot_p50", "e2e_mean"))


def _within_line(record: dict) -> str:
    n = 3 * len(record["points"])
    line = f"within target: {num_within(record)} of {n} (TTFT p50, TPOT p50, mean E2E)"
    for side, name in SIDES:
        if any(pt.get(side) for pt in record["points"]):
            line += f"; at {name}: {num_within(record, side)} of {n}"
    return line


def markdown(record: dict) -> str:
    """The README's table of a record: per point, predicted / real median [min-max] (error)
    of TTFT p50, TPOT p50 and mean E2E, as measured and at each other speed recorded."""
    setups = {"colo": "1 normal", "pd": "1P + 1C"}
    sides = [(side, name) for side, name in SIDES
             if any(pt.get(side) for pt in record["points"])]
    head = ["workload", "setup", "load", "rate req/s", "TTFT p50 ms", "TPOT p50 ms",
            "mean E2E ms"]
    for _, name in sides:
        head += [f"at {name}: factors", "TTFT p50", "TPOT p50", "mean E2E"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def cell(c: dict) -> str:
        return (f"{c['predicted']:.0f} / {c['median']:.0f} [{c['min']:.0f}-{c['max']:.0f}] "
                f"({100 * c['error']:+.0f}%{'' if c['within'] else '!'})")

    keys = ("ttft_p50", "tpot_p50", "e2e_mean")
    for pt in record["points"]:
        row = [pt["workload"], setups.get(pt["setup"], pt["setup"]), pt["level"],
               f"{pt['rate']:.2f}", *(cell(pt["compare"][k]) for k in keys)]
        for side, _ in sides:
            a = pt.get(side)
            row += [_factors(a), *(cell(a["compare"][k]) for k in keys)] if a else ["-"] * 4
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + f"\n\n{_within_line(record)}"


def step_factors(probe: dict | None) -> tuple[float, float, float] | None:
    """A probe's speed by kind of step: its prompt steps (all phases'), the solo stream's
    decode steps (one row) and the burst's (eight rows, fewer at its tail), each real over the
    simulator's; None for a failed probe or one from engines that do not split their busy
    time (runs 1-10)."""
    if not probe or "error" in probe or probe.get("real_prefill_s") is None:
        return None
    pre = sum(probe["real_prefill_s"]) / sum(probe["predicted_prefill_s"])
    solo, burst = ((probe["real_busy_s"][i] - probe["real_prefill_s"][i])
                   / probe["predicted_decode_s"][i] for i in (1, 2))
    return pre, solo, burst


def host_noise(record: dict) -> str:
    """The host's speed while each point ran, by kind of step: its probes' (the rate probe's
    and one before each run, minutes apart) median [min-max], beside the speed its runs'
    engines ran at. What the simulator cannot know before a run: how far the host moves
    within a point."""
    head = ["workload", "setup", "load", "probes", "prompt steps", "one-row decode steps",
            "eight-row decode steps", "the runs' own: prompt / decode"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    widths = []
    for pt in record["points"]:
        found = [f for f in map(step_factors, [pt.get("rate_probe"), *pt.get("probes", [])])
                 if f]
        if not found:
            continue
        kinds = list(zip(*found, strict=True))  # per kind of step, every probe's factor
        cells = [f"x{_median(list(k)):.2f} [{min(k):.2f}-{max(k):.2f}]" for k in kinds]
        widths.append([max(k) / min(k) for k in kinds])
        own = pt.get("at_run_speed")
        lines.append("| " + " | ".join([pt["workload"], pt["setup"], pt["level"],
                                         str(len(found)), *cells,
                                         _factors(own) if own else "-"]) + " |")
    if not widths:
        return ""
    spread = [f"{name} x{_median([w[i] for w in widths]):.2f} (at most "
              f"x{max(w[i] for w in widths):.2f})"
              for i, name in enumerate(("prompt steps", "one-row decode steps",
                                        "eight-row decode steps"))]
    return ("\n".join(lines) + "\n\nwithin a point, its slowest probe over its fastest: "
            + ", ".join(spread) + " (median over the points)")


def repredict(args: argparse.Namespace) -> int:
    """The simulator again over an earlier record's points (their rates, workloads, real runs):
    a change to the simulator or the profile judged without running the engines again."""
    if not args.profile:
        raise SystemExit("--repredict needs --profile")
    record = json.loads(Path(args.repredict).read_text())
    run_args = argparse.Namespace(**{**record["args"],
                                     "trace": str(ROOT / record["args"]["trace"])})
    profile = load_profile(args.profile)
    record.update(profile=rel(args.profile), repredicted_from=rel(args.repredict),
                  repredicted=time.strftime("%Y-%m-%dT%H:%M:%S"))
    for point in record["points"]:
        point["probes"] = [reprobe(p, profile, point["setup"], run_args)
                           for p in point.get("probes") or []]
        point["rate_probe"] = reprobe(point.get("rate_probe"), profile, point["setup"], run_args)
        sim = predict(profile, point["workload"], point["setup"], run_args, point["rate"])
        point.update(predicted_side(point["level"], sim, point["runs"]))
        point["at_probe"] = at_probe(profile, point, run_args)
        point["at_run_speed"] = at_run_speed(profile, point, run_args)
        print_point(point)
    Path(args.out).write_text(json.dumps(record, indent=1, default=str))
    print(f"{_within_line(record)}; wrote {rel(args.out)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", default="", help="default: fit one with `baton profile`")
    p.add_argument("--quick-profile", action="store_true", help="fit with --quick")
    p.add_argument("--runs", type=int, default=3, help="real runs per point")
    p.add_argument("--workloads", nargs="+", default=["trace", "synthetic"],
                   choices=["trace", "synthetic"])
    p.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    p.add_argument("--load-fractions", nargs=3, type=float, default=[0.3, 0.75, 1.5],
                   metavar=("LIGHT", "KNEE", "OVERLOADED"),
                   help="rates as fractions of the simulated capacity")
    p.add_argument("--num-requests", type=int, default=24)
    p.add_argument("--trace", default=str(ROOT / "tests/data/mooncake_conversation_window.jsonl"))
    p.add_argument("--length-scale", type=float, default=1 / 32)
    p.add_argument("--keep-bursts", action="store_true",
                   help="replay the trace's 3 s timestamp bins as bursts (runs 1-4b did: every "
                        "rate then a burst overload); default: spread (baton/workload/trace.py)")
    p.add_argument("--dataset", default="mix", choices=DATASETS)
    p.add_argument("--input-len", type=int, default=64, help="--dataset fixed: prompt words")
    p.add_argument("--output-len", type=int, default=96, help="--dataset fixed: output tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--goodput", nargs="*", default=["ttft:2000", "tpot:150"], metavar="KEY:MS")
    p.add_argument("--num-blocks", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--drain-timeout", type=float, default=300.0)
    p.add_argument("--engine-args", default="",
                   help="more engine flags for the real fleet, e.g. '--decode-kv rows'")
    p.add_argument("--client-cpus", default="",
                   help="pin the bench client, the router and redis to these CPUs once the "
                        "fleet is up (e.g. the completion engine's core, 1, so the prompt "
                        "engine has core 0 alone: what sharing its core costs the TTFT)")
    p.add_argument("--no-probe", action="store_true",
                   help="no speed probe before each real run (runs 1-6 had none)")
    p.add_argument("--rate-from", choices=("probe", "profile"), default=None,
                   help="a point's rate is a fraction of the simulated capacity at the speed "
                        "a probe finds just before the point (probe, the default) or at the "
                        "raw profile's (profile: runs 1-10; the default with --no-probe)")
    p.add_argument("--mock", action="store_true",
                   help="run every point on mock engines of --profile (`baton up --mock`: the "
                        "real router, engine loop, scheduler and wires, each step a sleep of "
                        "the profile's price) instead of real ones: the simulator against the "
                        "serving stack with the host's speed taken out")
    p.add_argument("--step-check", action="store_true",
                   help="first, each workload's steps on one real engine against the profile")
    p.add_argument("--step-check-only", action="store_true",
                   help="the step check and nothing else (no fleets)")
    p.add_argument("--repredict", default="", metavar="RUN.json",
                   help="no real runs: the simulator again (this code, --profile) at each point "
                        "of an earlier run's record, compared with that run's real runs")
    p.add_argument("--markdown", default="", metavar="RUN.json",
                   help="print an earlier record as the README's tables (the points; the "
                        "host's speed while each ran, from its probes), and nothing else")
    p.add_argument("--out", default=str(ROOT / "bench/results/sim_validate.json"))
    args = p.parse_args(argv)
    if args.mock and not args.profile:
        p.error("--mock needs --profile (the mock engines sleep its step times)")
    if args.quick_profile and args.profile:
        p.error("--quick-profile fits the profile that --profile would give: one or the other")
    # The modes that read an earlier record take only their own flags: any other given beside
    # them would do nothing, so it is refused by name.
    for mode, applies in (("markdown", ()), ("repredict", ("profile", "out"))):
        if getattr(args, mode):
            ignored = [f"--{name.replace('_', '-')}" for name, value in vars(args).items()
                       if name != mode and name not in applies and value != p.get_default(name)]
            takes = " and ".join(f"--{a}" for a in applies) or "no other flag"
            if ignored:
                p.error(f"--{mode} reads an earlier record: {', '.join(ignored)} would do "
                        f"nothing (it takes {takes})")
    if args.rate_from == "probe" and args.no_probe:
        p.error("--rate-from probe needs the speed probe that --no-probe turns off")
    if args.markdown:
        record = json.loads(Path(args.markdown).read_text())
        print(markdown(record))
        noise = host_noise(record)
        if noise:
            print(f"\n{noise}")
        return 0
    if args.repredict:
        return repredict(args)
    args.rate_from = args.rate_from or ("profile" if args.no_probe else "probe")
    logging.basicConfig(level=logging.WARNING)
    # A stop (SIGTERM) unwinds through RealFleet, which stops its `baton up`.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    profile_path = args.profile or fit_profile(args)
    profile = load_profile(profile_path)
    record = {"profile": rel(profile_path), "args": {k: rel(v) if k in ("trace", "out") else v
                                                     for k, v in vars(args).items()},
              "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "points": []}
    out = Path(args.out)
    if args.step_check or args.step_check_only:
        record["step_check"] = {}
        for kind in args.workloads:
            checked = step_check(profile, kind, args)
            record["step_check"][kind] = checked
            print(f"step check, {kind} (all at once, one engine here):\n"
                  f"{format_groups(checked)}", flush=True)
            out.write_text(json.dumps(record, indent=1, default=str))
        if args.step_check_only:
            return 0
    for setup in args.setups:
        with RealFleet(setup, args) as fleet:
            if args.client_cpus:
                fleet.pin_client(parse_cpus(args.client_cpus))
            for kind in args.workloads:
                for level, frac in zip(LEVELS, args.load_fractions, strict=True):
                    cap, rate_probe = rate_basis(fleet, profile, kind, setup, args)
                    rate = frac * cap
                    sim = predict(profile, kind, setup, args, rate)
                    probes, real = [], []
                    for _ in range(args.runs):
                        if not args.no_probe:
                            probes.append(probe(fleet, profile, setup, args))
                        real.append(measure(fleet, kind, args, rate))
                    runs = [r["summary"] for r in real]
                    point = {"workload": kind, "setup": setup, "level": level, "rate": rate,
                             "capacity": cap, "rate_probe": rate_probe, "runs": runs,
                             **predicted_side(level, sim, runs),
                             "runs_fleet": [r.get("fleet") for r in real],
                             "runs_requests": [requests_of(r) for r in real],
                             "probes": probes}
                    point["at_probe"] = at_probe(profile, point, args)
                    point["at_run_speed"] = at_run_speed(profile, point, args)
                    record["points"].append(point)
                    print_point(point)
                    out.write_text(json.dumps(record, indent=1, default=str))  # as it goes
    print(f"{_within_line(record)}; wrote {rel(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
