"""A fleet of mock engines behind one router or several, replaying a trace: do the routers keep
up, and what does the live path add to what the simulator predicts for the same requests?

    .venv/bin/python bench/mock_fleet.py --profile tests/data/profile_test.json \
        --normal-engines 16 --num-requests 200 --time-scale 0.5 --length-scale 0.0625
    .venv/bin/python bench/mock_fleet.py --normal-engines 64 --routers 2 --num-requests 2000 \
        --trace mooncake_conversation_first_half.jsonl --time-scale 0.05

1. Redis (this script's, closed by a password) and a cluster key dir; `baton up --mock PROFILE`
   on them starts the mock engines (the real engine loop, scheduler, ZMQ, registry and KV
   transfer; only the model replaced by the profile's step times) and router 0; routers
   1..N-1 are `baton router` processes on the same registry and keys: each has its own KV
   index, fed by the engines' KV events, and its own books of in-flight requests.
2. Once every router sees every engine, the trace is replayed through /v1/completions (no chat
   template, so a prompt has the token count the simulator gives it) on its own arrival times,
   request i to router i % N (bench/serve_bench.py's issuer, one per router).
3. `baton sim` runs the same requests over the same fleet shape in virtual time. Per request,
   measured TTFT (and end-to-end) minus predicted is what the live path adds: the router,
   the wires, and this host's process scheduling (the simulator has none of them).

Reports: the sustained request rate (completed / wall time) against the offered one, failures
(must be 0), the added latency p50/p99, the CPU each kind of process used over the replay (in
cores, and the busiest process's share of one core: what saturates first), resident memory,
and the fewest engines each router saw (a heartbeat past its TTL shows as a drop). Writes
bench/results/mock_fleet_<label>_<time>.json (and the live per-request record beside it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_bench as sb  # noqa: E402 - a sibling script, not a package

from baton.ops.ports import free_port  # noqa: E402
from baton.ops.redis_server import RedisServer  # noqa: E402
from baton.ops.up_process import UpError, UpProcess  # noqa: E402
from baton.perf.profile import load as load_profile  # noqa: E402
from baton.workload.results import summarize  # noqa: E402
from baton.workload.synthetic import WorkloadConfig  # noqa: E402
from baton.workload.trace import TraceConfig, build_trace_workload  # noqa: E402
from kv_transfer.auth import generate  # noqa: E402
from simulator.fleet import FleetConfig  # noqa: E402
from simulator.run import SimConfig, simulate  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


class Fleet:
    """Redis, `baton up --mock` (the engines and router 0) and routers 1..N-1 (`baton router`
    on the same registry and cluster keys: each its own KV index from the engines' events, no
    state shared with another router). Stops everything it started."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.key_dir = Path(tempfile.mkdtemp(prefix="baton-fleet-keys-"))
        generate(self.key_dir)
        self.redis = RedisServer().start()
        self.ports = [free_port() for _ in range(args.routers)]
        self.procs: list[subprocess.Popen] = []

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    def _shared(self) -> list[str]:
        return ["--redis-url", self.redis.url, "--redis-password-file", self.redis.password_file,
                "--cluster-key-dir", str(self.key_dir)]

    def start(self) -> None:
        a = self.args
        shape = (["--normal-engines", str(a.normal_engines)] if a.normal_engines else
                 ["--prompt-engines", str(a.prompt_engines),
                  "--completion-engines", str(a.completion_engines)])
        up = UpProcess.start(
            ["--mock", a.profile, "--no-cpu-pinning", "--no-metrics", "--ready-timeout",
             str(a.ready_timeout), *self._shared(), *shape, "--", "--num-blocks",
             str(a.num_blocks), "--max-num-seqs", str(a.max_num_seqs)],
            port=self.ports[0], ready_timeout_s=a.ready_timeout, keep_stderr=False)
        self.procs.append(up.proc)
        deadline = time.monotonic() + a.ready_timeout
        try:
            up.wait_up()
        except UpError as exc:
            raise SystemExit(f"baton up --mock: {exc}") from exc
        for port in self.ports[1:]:
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "baton_cli", "router", "--port", str(port),
                 *self._shared()], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True))
        for url in self.urls:  # every router sees every engine before the replay starts
            wait_engines(url, self.num_engines, deadline)

    @property
    def num_engines(self) -> int:
        a = self.args
        return a.normal_engines + a.prompt_engines + a.completion_engines

    def processes(self) -> dict[str, list[psutil.Process]]:
        """The live processes by kind: routers and engines (each with its children: a router's
        prepare workers), the launcher (`baton up`) and this client."""
        kinds: dict[str, list[psutil.Process]] = {"router": [], "engine": [], "launcher": [],
                                                  "client": [psutil.Process()]}
        for proc in self.procs:
            try:
                top = psutil.Process(proc.pid)
                tree = [top, *top.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
            kind_of = {top.pid: "router" if proc is not self.procs[0] else "launcher"}
            for p in tree[1:]:
                try:
                    argv, parent = p.cmdline(), p.ppid()
                except psutil.Error:
                    continue
                kind_of[p.pid] = ("engine" if "--engine-id" in argv else
                                  "router" if "router" in argv else
                                  kind_of.get(parent, "launcher"))
            for p in tree:
                if p.pid in kind_of:
                    kinds[kind_of[p.pid]].append(p)
        return kinds

    def rss_mib(self) -> dict[str, float]:
        """Resident memory per kind (MiB), summed."""
        out: dict[str, float] = {}
        for kind, procs in self.processes().items():
            for p in procs:
                try:
                    out[kind] = out.get(kind, 0.0) + p.memory_info().rss / 2**20
                except psutil.Error:
                    pass
        return out

    def stop(self) -> None:
        for proc in reversed(self.procs):  # routers first, then baton up (its engines)
            proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self.redis.stop()
        shutil.rmtree(self.key_dir, ignore_errors=True)


def wait_engines(url: str, num_engines: int, deadline: float) -> None:
    while True:
        health = router_health(url)
        if health and sum(health.get("engines", {}).values()) >= num_engines:
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"{url}: router sees {health} engines, not {num_engines}")
        time.sleep(0.5)


def router_health(url: str) -> dict:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5.0) as resp:
            return json.load(resp)
    except urllib.error.HTTPError as exc:  # 503: no engine of a role yet
        return json.load(exc)
    except (OSError, ValueError):
        return {}


class Monitor:
    """Every second during the replay: the engines each router sees (a missed heartbeat shows
    as a drop), and the CPU each kind of process burns (what saturates first)."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.min_engines_seen = {url: fleet.num_engines for url in fleet.urls}
        self.num_unanswered = {url: 0 for url in fleet.urls}  # /health polls past 5 s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _cpu(self) -> dict[str, dict[int, tuple[float, float]]]:
        """pid -> (CPU seconds, seconds runnable but waiting for a core), by kind."""
        out: dict[str, dict[int, tuple[float, float]]] = {}
        for kind, procs in self.fleet.processes().items():
            for p in procs:
                try:
                    t = p.cpu_times()
                    wait = sum(int(Path(f"/proc/{p.pid}/task/{tid.id}/schedstat").read_text()
                                   .split()[1]) for tid in p.threads()) / 1e9
                except (psutil.Error, OSError, IndexError, ValueError):
                    continue
                out.setdefault(kind, {})[p.pid] = (t.user + t.system, wait)
        return out

    def __enter__(self) -> Monitor:
        self.t0, self.cpu0 = time.monotonic(), self._cpu()
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            for url in self.fleet.urls:
                health = router_health(url)
                if not health:  # no answer: the router's loop is busy, not its engines gone
                    self.num_unanswered[url] += 1
                    continue
                seen = sum(health.get("engines", {}).values())
                self.min_engines_seen[url] = min(self.min_engines_seen[url], seen)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.wall_s = time.monotonic() - self.t0
        self.cpu1 = self._cpu()
        self.rss_mib = self.fleet.rss_mib()

    def cpu_record(self) -> dict:
        """Per kind: CPU seconds over the replay, as cores (mean) and the busiest process's
        share of one core."""
        record = {}
        for kind, after in self.cpu1.items():
            before = self.cpu0.get(kind, {})
            used = [after[pid][0] - before.get(pid, (0.0, 0.0))[0] for pid in after]
            waited = [after[pid][1] - before.get(pid, (0.0, 0.0))[1] for pid in after]
            busiest = max(range(len(used)), key=used.__getitem__)
            record[kind] = {"num_processes": len(used), "cpu_s": sum(used),
                            "cores": sum(used) / self.wall_s,
                            "busiest_core_fraction": used[busiest] / self.wall_s,
                            # the busiest one's time runnable but off-CPU (host saturated)
                            "busiest_runqueue_wait_fraction": waited[busiest] / self.wall_s}
        record["host_cores"] = psutil.cpu_count()
        return record


async def replay(urls: list[str], label: str, workload: WorkloadConfig,
                 trace: TraceConfig) -> dict:
    """The trace through the routers, request i to router i % N, each on its arrival time."""
    import httpx

    specs = build_trace_workload(trace)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    cfg = sb.BenchConfig(base_url=urls[0], endpoint="completions", num_requests=len(specs),
                         label=label, progress=False)
    clients = [httpx.AsyncClient(base_url=u, limits=limits, timeout=httpx.Timeout(600.0))
               for u in urls]
    try:
        model = await sb._discover(clients[0], cfg)
        eos = [await sb._check_ignore_eos(c, cfg, model) for c in clients]
        t0 = time.perf_counter()
        parts = await asyncio.gather(*(
            sb._Issuer(c, cfg, model, e).run(specs[k::len(urls)], workload.seed)
            for k, (c, e) in enumerate(zip(clients, eos, strict=True))))
        wall_s = time.perf_counter() - t0
    finally:
        for c in clients:
            await c.aclose()
    results = sorted((r for part in parts for r in part), key=lambda r: r.idx)
    summary = summarize(results, wall_s, {})
    return {"label": label, "model": model, "summary": summary,
            "requests": [asdict(r) for r in results]}


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
    p.add_argument("--spread-bursts", action="store_true",
                   help="spread each 3 s timestamp bin's requests over it (baton/workload/"
                        "trace.py); default: every bin a burst")
    p.add_argument("--normal-engines", type=int, default=16)
    p.add_argument("--prompt-engines", type=int, default=0)
    p.add_argument("--completion-engines", type=int, default=0)
    p.add_argument("--routers", type=int, default=1,
                   help="router replicas on the same registry and KV events; request i goes "
                        "to router i %% N")
    # Over 10% of the pool free for the trace's longest prompt: a prompt past the watermark
    # (0.9) of its engine's pool stalls there (the scheduler's, so real engines too).
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--label", default="")
    p.add_argument("--results-dir", default=str(ROOT / "bench/results"))
    args = p.parse_args(argv)
    if args.routers < 1:
        p.error(f"--routers must be >= 1, got {args.routers}")
    if args.prompt_engines or args.completion_engines:
        args.normal_engines = 0
    shape = (f"normal{args.normal_engines}" if args.normal_engines else
             f"pd{args.prompt_engines}x{args.completion_engines}")
    shape += f"_r{args.routers}" if args.routers > 1 else ""
    label = args.label or f"mock_{shape}"
    trace = TraceConfig(args.trace, num_requests=args.num_requests, time_scale=args.time_scale,
                        length_scale=args.length_scale, spread_bursts=args.spread_bursts)
    workload = WorkloadConfig()  # with a trace only its seed is used

    t0 = time.monotonic()
    fleet = Fleet(args)
    try:
        fleet.start()
        up_s = time.monotonic() - t0
        with Monitor(fleet) as monitor:
            live = asyncio.run(replay(fleet.urls, label, workload, trace))
    finally:
        fleet.stop()

    sim_fleet = FleetConfig(num_normal=args.normal_engines, num_prompt=args.prompt_engines,
                            num_completion=args.completion_engines, num_blocks=args.num_blocks,
                            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=1024)
    out = Path(args.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (out / f"mock_fleet_{label}_{stamp}_live.json").write_text(json.dumps(live, default=str))
    sim = simulate(load_profile(args.profile),
                   SimConfig(fleet=sim_fleet, num_requests=args.num_requests, label=label),
                   workload, trace)
    record = make_record(args, shape, label, up_s, live, sim, monitor, trace)
    print_record(record)
    path = out / f"mock_fleet_{label}_{stamp}.json"
    path.write_text(json.dumps(record, indent=1, default=str))
    print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    return 0 if record["num_failed"] == 0 else 1


def make_record(args, shape: str, label: str, up_s: float, live: dict, sim: dict,
                monitor: Monitor, trace: TraceConfig) -> dict:
    s = live["summary"]
    arrivals = sorted(r["start_s"] for r in live["requests"])
    span = arrivals[-1] - arrivals[0] if arrivals else 0.0
    return {"label": label, "shape": shape, "num_engines": args.normal_engines
            + args.prompt_engines + args.completion_engines, "num_routers": args.routers,
            "up_s": up_s, "offered_rate": (len(arrivals) - 1) / span if span else math.inf,
            "sustained_rate": s["num_completed"] / s["duration_s"],
            "num_completed": s["num_completed"], "num_failed": s["num_failed"],
            "errors": s["errors"], "live": {k: s[k] for k in ("ttft_ms", "e2e_ms", "tpot_ms")},
            "sim": {k: sim["summary"][k] for k in ("ttft_ms", "e2e_ms", "tpot_ms")},
            **compare(live, sim), "min_engines_seen": monitor.min_engines_seen,
            "num_health_unanswered": monitor.num_unanswered,
            "cpu": monitor.cpu_record(), "rss_mib": monitor.rss_mib, "load_average": list(os.getloadavg()),
            "trace": {**vars(trace), "path": _rel(trace.path)}}


def _rel(path: str) -> str:
    """A path in the repository relative to its root; outside it, the file's name only (the
    results name no path of this host)."""
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else p.name


def print_record(record: dict) -> None:
    print(f"{record['shape']}: {record['num_completed']} completed, {record['num_failed']} "
          f"failed; offered {record['offered_rate']:.1f} req/s, sustained "
          f"{record['sustained_rate']:.1f} req/s (fleet up in {record['up_s']:.0f} s; load "
          f"average {record['load_average'][0]:.1f})")
    print(f"{'':<14}{'live p50':>10}{'sim p50':>10}{'added p50':>11}{'added p99':>11}")
    for key, added in (("ttft_ms", "added_ttft_ms"), ("e2e_ms", "added_e2e_ms")):
        print(f"{key:<14}{record['live'][key]['median']:>10.1f}"
              f"{record['sim'][key]['median']:>10.1f}{record[added]['p50']:>11.1f}"
              f"{record[added]['p99']:>11.1f}")
    cpu = record["cpu"]
    print(f"CPU over the replay ({cpu['host_cores']} cores): " + ", ".join(
        f"{kind} x{c['num_processes']} {c['cores']:.2f} cores (busiest "
        f"{100 * c['busiest_core_fraction']:.0f}% of one, waiting for a core "
        f"{100 * c['busiest_runqueue_wait_fraction']:.0f}% of the time)"
        for kind, c in cpu.items() if kind != "host_cores"))
    print("resident memory (MiB): " + ", ".join(f"{k} {v:.0f}"
                                                for k, v in record["rss_mib"].items()))
    print("fewest engines a router saw during the replay: " + ", ".join(
        f"{url.rsplit(':', 1)[-1]}: {n}" for url, n in record["min_engines_seen"].items())
          + "; /health polls unanswered within 5 s: " + ", ".join(
              f"{url.rsplit(':', 1)[-1]}: {n}"
              for url, n in record["num_health_unanswered"].items()))


if __name__ == "__main__":
    sys.exit(main())
