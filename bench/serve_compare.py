"""Disaggregated (1 prompt + 1 completion engine) against co-located (1 NORMAL engine) serving.

Same workload, same seed, same machine, one run: for each setup it starts Baton with
`baton up` (which splits this machine's cores between its engines, so both setups get the same
total), runs serve_bench at each request rate, stops Baton, and then draws
bench/results/serve_cdf_ttft.png, serve_cdf_itl.png and serve_latency_vs_rate.png, writes
bench/results/serve_compare.json and a Markdown table (serve_compare.md), and prints the p99
ITL of disaggregated over co-located for the long-prompt mix (the goal is <= 0.5).

    python bench/serve_compare.py                      # the default: ~11 minutes on 2 cores
    python bench/serve_compare.py --rates 0.2 0.4 0.8 --num-requests 60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_bench as sb  # noqa: E402 - a sibling script, not a package

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
SETUPS = {  # name -> `baton up` flags; both get every core of this machine
    "disaggregated": ["--prompt-engines", "1", "--completion-engines", "1"],
    "colocated": ["--normal-engines", "1"],
}
COLORS = {"disaggregated": "tab:blue", "colocated": "tab:orange"}


@dataclass
class CompareConfig:
    # Sized for a 2-core machine running SmolLM2-135M in fp32: about 11 minutes there. A light
    # rate and one where chat streams are always decoding when a long prompt arrives (only
    # then are its stalls more than 1% of the ITL samples, i.e. visible at p99).
    rates: list[float] = field(default_factory=lambda: [0.3, 0.6])  # requests/s
    num_requests: int = 40  # per rate and setup
    port: int = 8123
    seed: int = 2
    slos_ms: dict[str, float] = field(default_factory=lambda: {"ttft": 5000.0, "tpot": 250.0})
    up_timeout_s: float = 300.0
    engine_args: list[str] = field(default_factory=list)  # after --: for every engine
    results_dir: Path = sb.RESULTS_DIR

    def __post_init__(self) -> None:
        if not self.rates or any(r <= 0 for r in self.rates):
            raise ValueError(f"rates must be positive, got {self.rates}")
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")


# --------------------------------------------------------------------------- Baton up/down
class BatonUp:
    """`baton up` as a child process group, stopped with SIGTERM (then SIGKILL)."""

    def __init__(self, setup: str, cfg: CompareConfig, log_path: Path,
                 flags: list[str] | None = None) -> None:
        """`flags`: the `baton up` flags of the setup (default: SETUPS[setup])."""
        argv = [sys.executable, "-m", "baton_cli", "up", "--port", str(cfg.port),
                "--ready-timeout", str(cfg.up_timeout_s), *(flags or SETUPS[setup])]
        if cfg.engine_args:
            argv += ["--", *cfg.engine_args]
        self.base_url = f"http://127.0.0.1:{cfg.port}"
        self.log = log_path.open("w")
        logger.info("starting %s: %s (log %s)", setup, " ".join(argv[1:]), log_path)
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self._wait_ready(cfg.up_timeout_s + 30)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"baton up exited with {self.proc.returncode}; "
                                   f"see {self.log.name}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"baton up not healthy within {timeout_s:.0f}s; see {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()


# --------------------------------------------------------------------------- runs
def workload_for(cfg: CompareConfig) -> sb.WorkloadConfig:
    """The long-prompt mix: chat turns with one long document in ten."""
    return sb.WorkloadConfig(dataset="mix", seed=cfg.seed)


def bench_setup(setup: str, cfg: CompareConfig) -> list[dict]:
    """Every rate against one running setup; the server is up once for all of them."""
    cfg.results_dir.mkdir(parents=True, exist_ok=True)
    baton = BatonUp(setup, cfg, cfg.results_dir / f"serve_compare_{setup}.log")
    records = []
    try:
        for rate in cfg.rates:
            bench = sb.BenchConfig(base_url=baton.base_url, request_rate=rate,
                                   num_requests=cfg.num_requests, slos_ms=cfg.slos_ms,
                                   label=f"{setup}_r{rate:g}", drain_timeout_s=180.0,
                                   progress=False)
            record = asyncio.run(sb.run_async(bench, workload_for(cfg)))
            print(sb.format_table(record), flush=True)
            record["setup"], record["rate"] = setup, rate
            records.append(record)
    finally:
        baton.stop()
    return records


def _p(record: dict, metric: str, q: str = "p99", kind: str | None = None) -> float:
    s = record["summary"] if kind is None else record["summary"]["by_kind"].get(kind, {})
    return s.get(metric, {}).get(q, float("nan"))


def ratios(records: list[dict]) -> list[dict]:
    """Per rate: p99 ITL (and the short chat requests' p99 ITL) disaggregated / co-located."""
    by = {(r["setup"], r["rate"]): r for r in records}
    out = []
    for rate in sorted({r["rate"] for r in records}):
        a, b = by.get(("disaggregated", rate)), by.get(("colocated", rate))
        if a is None or b is None:
            continue
        out.append({"rate": rate,
                    "p99_itl_ratio": _p(a, "itl_ms") / _p(b, "itl_ms"),
                    "p99_itl_ratio_short": _p(a, "itl_ms", kind="short")
                    / _p(b, "itl_ms", kind="short")})
    return out


# --------------------------------------------------------------------------- plots, table
def _cdf(ax, values_ms: list[float], label: str, color: str) -> None:
    import numpy as np

    if not values_ms:
        return
    xs = np.sort(np.asarray(values_ms))
    ax.plot(xs, np.arange(1, xs.size + 1) / xs.size, label=label, color=color)


def plot_cdfs(records: list[dict], out_dir: Path, rate: float) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for metric, title in (("ttft", "time to first token"), ("itl", "inter-token latency")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in records:
            if r["rate"] != rate:
                continue
            ok = [q for q in r["requests"] if q["ok"]]
            vals = [q["ttft_s"] * 1e3 for q in ok] if metric == "ttft" else \
                [x * 1e3 for q in ok for x in q["itl_s"]]
            _cdf(ax, vals, r["setup"], COLORS[r["setup"]])
        ax.set_xscale("log")
        ax.set_xlabel(f"{metric.upper()} (ms, log scale)")
        ax.set_ylabel("fraction of " + ("requests" if metric == "ttft" else "token gaps"))
        ax.set_title(f"CDF of {title}, long-prompt mix, {rate:g} req/s")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        paths.append(out_dir / f"serve_cdf_{metric}.png")
        fig.tight_layout()
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def plot_vs_rate(records: list[dict], out_dir: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("ttft_ms", "p90", "TTFT p90"), ("itl_ms", "p99", "ITL p99"),
              ("e2e_ms", "median", "end-to-end median"))
    fig, axes = plt.subplots(1, len(panels), figsize=(13, 3.8))
    for ax, (metric, q, title) in zip(axes, panels, strict=True):
        for setup in SETUPS:
            rs = sorted((r for r in records if r["setup"] == setup), key=lambda r: r["rate"])
            ax.plot([r["rate"] for r in rs], [_p(r, metric, q) for r in rs], marker="o",
                    label=setup, color=COLORS[setup])
        ax.set_title(title)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("ms")
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    fig.suptitle("Latency against request rate, long-prompt mix")
    fig.tight_layout()
    path = out_dir / "serve_latency_vs_rate.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def markdown_table(records: list[dict], rows: list[dict]) -> str:
    head = ("| setup | rate (req/s) | done | out tok/s | goodput (req/s) | TTFT p50 / p99 (ms) "
            "| TPOT p50 (ms) | ITL p50 / p99 (ms) | E2E p50 / p99 (ms) |")
    lines = [head, "|" + "---|" * 9]
    for r in sorted(records, key=lambda r: (r["rate"], r["setup"])):
        s = r["summary"]
        lines.append(
            f"| {r['setup']} | {r['rate']:g} | {s['num_completed']}/{s['num_issued']} "
            f"| {s['output_throughput']:.1f} | {s['goodput']:.3f} "
            f"| {_p(r, 'ttft_ms', 'median'):.0f} / {_p(r, 'ttft_ms'):.0f} "
            f"| {_p(r, 'tpot_ms', 'median'):.0f} "
            f"| {_p(r, 'itl_ms', 'median'):.0f} / {_p(r, 'itl_ms'):.0f} "
            f"| {_p(r, 'e2e_ms', 'median'):.0f} / {_p(r, 'e2e_ms'):.0f} |")
    lines.append("")
    for row in rows:
        lines.append(f"p99 ITL disaggregated / co-located at {row['rate']:g} req/s: "
                     f"{row['p99_itl_ratio']:.2f} (short chat requests only: "
                     f"{row['p99_itl_ratio_short']:.2f}; goal <= 0.5)")
    return "\n".join(lines)


# --------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> CompareConfig:
    d = CompareConfig()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", type=float, nargs="+", default=d.rates, help="requests/s")
    p.add_argument("--num-requests", type=int, default=d.num_requests, help="per rate and setup")
    p.add_argument("--port", type=int, default=d.port, help="router port for both setups")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--goodput", nargs="*", default=[f"{k}:{v:g}" for k, v in d.slos_ms.items()],
                   metavar="KEY:MS")
    p.add_argument("--results-dir", default=str(d.results_dir))
    p.add_argument("engine_args", nargs=argparse.REMAINDER, help="after --: engine flags")
    args = p.parse_args(argv)
    return CompareConfig(rates=args.rates, num_requests=args.num_requests, port=args.port,
                         seed=args.seed, slos_ms=sb._slos(args.goodput),
                         engine_args=[a for a in args.engine_args if a != "--"],
                         results_dir=Path(args.results_dir))


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    cfg = parse_args(argv)
    t0 = time.monotonic()
    records = [rec for setup in SETUPS for rec in bench_setup(setup, cfg)]
    rows = ratios(records)
    table = markdown_table(records, rows)
    out = cfg.results_dir
    plots = plot_cdfs(records, out, max(cfg.rates)) + [plot_vs_rate(records, out)]
    (out / "serve_compare.md").write_text(table + "\n")
    (out / "serve_compare.json").write_text(json.dumps(
        {"config": {**cfg.__dict__, "results_dir": str(out)}, "ratios": rows,
         "wall_s": time.monotonic() - t0, "runs": records}, indent=1))
    print(table)
    print("wrote", ", ".join(str(p) for p in plots), "and serve_compare.{md,json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
