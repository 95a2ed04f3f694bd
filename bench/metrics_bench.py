"""What an engine's Prometheus metrics cost its service loop per decode step.

Run: .venv/bin/python bench/metrics_bench.py
Writes bench/results/metrics.json.

Per step the loop calls `EngineMetrics.on_delta` once per token delta (baton/service/engine_service.py); the
baseline, measured in the same run, is what the loop does for those deltas anyway: encode the
step's `EngineOutputs`. Every 0.25 s it also publishes a stats snapshot, and a scrape renders
the registry on the HTTP thread; both are reported in absolute terms. Each case runs ROUNDS
rounds of REPEATS steps; the table gives the median step and the spread across rounds.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path

from baton.protocol import EngineOutputs, EngineStats, TokenDelta, encode
from baton.service.metrics import EngineMetrics

RESULTS = Path(__file__).parent / "results" / "metrics.json"
ROUNDS, REPEATS = 7, 500


def _round(fn) -> float:
    """Median microseconds of one call of fn over REPEATS calls."""
    times = []
    for _ in range(REPEATS):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def _case(fn) -> dict:
    rounds = [_round(fn) for _ in range(ROUNDS)]
    return {"median_us": statistics.median(rounds), "min_us": min(rounds), "max_us": max(rounds)}


def main() -> None:
    results = {}
    for num_seqs in (1, 8, 64, 256):
        metrics = EngineMetrics("bench-0", "completion")
        ids = [f"req-{i}" for i in range(num_seqs)]
        for req_id in ids:
            metrics.on_arrival(req_id)
        deltas = [TokenDelta(req_id, [1234]) for req_id in ids]

        def record(metrics=metrics, deltas=deltas) -> None:
            for delta in deltas:
                metrics.on_delta(delta)

        results[f"decode_{num_seqs}"] = {
            "on_delta": _case(record),
            "encode_baseline": _case(lambda deltas=deltas: encode(EngineOutputs(deltas))),
        }
    metrics = EngineMetrics("bench-0", "completion")
    extra = {f"kv_failed_reason_{i}": 1.0 for i in range(4)} | {"kv_bytes_total": 1e9}
    stats = EngineStats("bench-0", "completion", num_total_blocks=4096, extra=extra)
    results["publish"] = _case(lambda: metrics.publish(stats))
    metrics.publish(stats)
    results["scrape_render"] = _case(metrics.render)

    print(f"{'case':<14}{'on_delta us':>14}{'encode us':>12}{'ratio':>8}{'spread us':>16}")
    for name, r in results.items():
        if "on_delta" in r:
            d, e = r["on_delta"], r["encode_baseline"]
            r["ratio"] = d["median_us"] / e["median_us"]
            print(f"{name:<14}{d['median_us']:>14.1f}{e['median_us']:>12.1f}{r['ratio']:>8.2f}"
                  f"{d['min_us']:>8.1f}-{d['max_us']:.1f}")
        else:
            print(f"{name:<14}{r['median_us']:>14.1f}{'':>12}{'':>8}"
                  f"{r['min_us']:>8.1f}-{r['max_us']:.1f}")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                                   "rounds": ROUNDS, "repeats": REPEATS,
                                   "results": results}, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
