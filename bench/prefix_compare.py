"""Prefix caching on a multi-turn chat workload: disaggregated and co-located, cache on and off.

Four setups, one `baton up` each (all of this machine's cores), the same seeded workload
(`--conversations` conversations of `--turns` turns behind one shared system prompt of
`--system-prompt-len` words, every conversation in flight at once, each turn sent when the
previous answer is complete): TTFT p50/p99, E2E p50, output tok/s, the cached-token fraction
(usage.prompt_tokens_details.cached_tokens over prompt tokens) and, disaggregated, the
completion engine's KV blocks pulled per request (from its stats). Writes
bench/results/prefix_cache.json and prints a Markdown table, and the two targets:
disaggregated TTFT p50 with caching / without (goal <= 0.3), and blocks pulled with the
decode-side cache / without (goal <= 0.25).

Routing (`--setups disaggregated+cache 2-prompt+cache-aware 2-prompt+least-loaded --out
prefix_routing.json`): two prompt engines behind the router's cache-aware or least-loaded
choice, against one prompt engine (where every turn meets its cache); the target is a
cached-token fraction of cache-aware routing >= 0.9x the single prompt engine's.

    python bench/prefix_compare.py                 # ~12 minutes on 2 cores
    python bench/prefix_compare.py --conversations 4 --turns 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_bench as sb  # noqa: E402 - sibling scripts, not a package
from serve_compare import BatonUp, CompareConfig  # noqa: E402

logger = logging.getLogger(__name__)

OFF = ["--no-enable-prefix-caching"]
SETUPS = {  # name -> (`baton up` flags, engine flags)
    "disaggregated+cache": (["--prompt-engines", "1", "--completion-engines", "1"], []),
    "disaggregated": (["--prompt-engines", "1", "--completion-engines", "1"], OFF),
    "colocated+cache": (["--normal-engines", "1"], []),
    "colocated": (["--normal-engines", "1"], OFF),
    # Two prompt engines: does routing keep each conversation where its turns are cached?
    "2-prompt+cache-aware": (["--prompt-engines", "2", "--completion-engines", "1",
                              "--routing", "cache-aware"], []),
    "2-prompt+least-loaded": (["--prompt-engines", "2", "--completion-engines", "1",
                               "--routing", "least-loaded"], []),
}
DEFAULT_SETUPS = ["disaggregated+cache", "disaggregated", "colocated+cache", "colocated"]


def engine_addresses(log_path: Path) -> dict[str, str]:
    """`baton up`'s banner lists each engine's address."""
    text = log_path.read_text(errors="replace")
    return dict(re.findall(r"^\s+(\S+-\d+)\s+(tcp://\S+)$", text, re.M))


def engine_stats(address: str) -> dict[str, float]:
    from baton.service.client import probe_engine
    from kv_transfer.auth import keys_from_env

    # main() exported the key dir every `baton up` here uses
    stats = probe_engine(address, timeout_s=5.0, keys=keys_from_env())
    return {} if stats is None else dict(stats.extra)


def run_setup(name: str, args: argparse.Namespace) -> dict:
    flags, engine_flags = SETUPS[name]
    cfg = CompareConfig(port=args.port, engine_args=engine_flags, results_dir=Path(args.results_dir))
    log = cfg.results_dir / f"prefix_compare_{name.replace('+', '_')}.log"
    cfg.results_dir.mkdir(parents=True, exist_ok=True)
    baton = BatonUp(name, cfg, log, flags)
    try:
        workload = sb.WorkloadConfig(dataset="multi-turn", turns=args.turns,
                                     system_prompt_len=args.system_prompt_len,
                                     short_output_range=tuple(args.output_range), seed=args.seed)
        bench = sb.BenchConfig(base_url=baton.base_url, num_requests=args.conversations,
                               label=name, drain_timeout_s=300.0, progress=False)
        record = asyncio.run(sb.run_async(bench, workload))
        print(sb.format_table(record), flush=True)
        addresses = engine_addresses(log)
        record["engines"] = {eid: engine_stats(addr) for eid, addr in addresses.items()}
    finally:
        baton.stop()
    record["setup"] = name
    return record


def row(record: dict) -> dict:
    s = record["summary"]
    completion = [v for k, v in record.get("engines", {}).items() if k.startswith("completion")]
    pulled = sum(e.get("kv_blocks_pulled", 0.0) for e in completion)
    reused = sum(e.get("kv_blocks_reused", 0.0) for e in completion)
    n = max(1, s["num_completed"])
    return {"setup": record["setup"], "completed": s["num_completed"],
            "ttft_p50_ms": s["ttft_ms"]["median"], "ttft_p99_ms": s["ttft_ms"]["p99"],
            "e2e_p50_ms": s["e2e_ms"]["median"], "output_tok_s": s["output_throughput"],
            "cached_fraction": s["cached_token_fraction"],
            "blocks_pulled_per_request": pulled / n if completion else None,
            "blocks_reused_per_request": reused / n if completion else None}


def table(rows: list[dict]) -> str:
    lines = ["| setup | TTFT p50 ms | TTFT p99 ms | E2E p50 ms | output tok/s | cached tokens "
             "| blocks pulled / request |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        pulled = "" if r["blocks_pulled_per_request"] is None else \
            f"{r['blocks_pulled_per_request']:.1f}"
        lines.append(f"| {r['setup']} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | "
                     f"{r['e2e_p50_ms']:.0f} | {r['output_tok_s']:.1f} | "
                     f"{100 * r['cached_fraction']:.0f}% | {pulled} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-prompt-len", type=int, default=512)
    p.add_argument("--output-range", type=int, nargs=2, default=[32, 64], metavar=("LO", "HI"))
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--port", type=int, default=8124)
    p.add_argument("--setups", nargs="*", default=DEFAULT_SETUPS, choices=list(SETUPS))
    p.add_argument("--results-dir", default=str(sb.RESULTS_DIR))
    p.add_argument("--out", default="prefix_cache.json", help="JSON file in --results-dir")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    import os

    from kv_transfer.auth import ENV_KEY_DIR, generate

    # One key dir for every `baton up` (they inherit it) and for the stats probes.
    os.environ.setdefault(ENV_KEY_DIR, str(generate()))
    records = [run_setup(name, args) for name in args.setups]
    rows = [row(r) for r in records]
    by = {r["setup"]: r for r in rows}
    targets = {}
    if "disaggregated+cache" in by and "disaggregated" in by:
        on, off = by["disaggregated+cache"], by["disaggregated"]
        targets["ttft_p50_ratio"] = on["ttft_p50_ms"] / off["ttft_p50_ms"]
        targets["blocks_pulled_ratio"] = (on["blocks_pulled_per_request"]
                                          / max(1e-9, off["blocks_pulled_per_request"]))
    single = by.get("disaggregated+cache")
    for name in ("2-prompt+cache-aware", "2-prompt+least-loaded"):
        if single and name in by:
            targets[f"cached_fraction_ratio_{name.split('+')[1]}"] = (
                by[name]["cached_fraction"] / max(1e-9, single["cached_fraction"]))
    out = Path(args.results_dir) / args.out
    out.write_text(json.dumps({"args": vars(args), "rows": rows, "targets": targets,
                               "runs": records}, indent=1))
    print(table(rows))
    for key, value in targets.items():
        print(f"{key}: {value:.3f}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
