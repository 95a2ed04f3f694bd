"""The result record `baton bench` and `baton sim` both write: per-request results, the summary
(throughput, TTFT/TPOT/ITL/end-to-end statistics, goodput under SLOs), the table, the file."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

STAT_KEYS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
SLO_KEYS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2e": "e2e_ms"}


def parse_slos(items: list[str]) -> dict[str, float]:
    """`--goodput ttft:MS tpot:MS e2e:MS` -> {"ttft": MS, ...}; ValueError naming a bad item."""
    out = {}
    for item in items:
        key, _, value = item.partition(":")
        try:
            out[key] = float(value) if key in SLO_KEYS else float("nan")
        except ValueError:
            out[key] = float("nan")
        if key not in SLO_KEYS or not out[key] >= 0:
            raise ValueError(f"bad --goodput item {item!r}: expected ttft:MS, tpot:MS or e2e:MS")
    return out


@dataclass
class RequestResult:
    idx: int
    kind: str
    ok: bool = False
    error: str = ""
    start_s: float = 0.0  # since the run's start
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    prompt_tokens: int = 0  # from the server's usage when it sends one, else words
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens, when the server says
    output_tokens: int = 0
    expected_output_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)  # gaps between successive text chunks
    text: str = ""  # the answer (multi-turn: the next turn's history)

    @property
    def tpot_s(self) -> float:
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 \
            else 0.0


def stats_ms(values_s: list[float]) -> dict[str, float]:
    """mean, median, p90, p99 in milliseconds (zeros when there is nothing to measure)."""
    import numpy as np

    if not values_s:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0, "count": 0}
    a = np.asarray(values_s) * 1000.0
    return {"mean": float(a.mean()), "median": float(np.median(a)),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99)),
            "count": int(a.size)}


def meets_slos(r: RequestResult, slos_ms: dict[str, float]) -> bool:
    value_ms = {"ttft": r.ttft_s * 1e3, "tpot": r.tpot_s * 1e3, "e2e": r.e2e_s * 1e3}
    return r.ok and all(value_ms[k] <= limit for k, limit in slos_ms.items())


def latency_stats(ok: list[RequestResult]) -> dict[str, dict[str, float]]:
    return {"ttft_ms": stats_ms([r.ttft_s for r in ok]),
            "tpot_ms": stats_ms([r.tpot_s for r in ok if r.output_tokens > 1]),
            "itl_ms": stats_ms([x for r in ok for x in r.itl_s]),
            "e2e_ms": stats_ms([r.e2e_s for r in ok])}


def summarize(results: list[RequestResult], wall_s: float, slos_ms: dict[str, float]) -> dict:
    ok = [r for r in results if r.ok]
    num_out = sum(r.output_tokens for r in ok)
    good = [r for r in ok if meets_slos(r, slos_ms)]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error[:80]] = errors.get(r.error[:80], 0) + 1
    kinds = sorted({r.kind for r in ok})
    return {
        "num_issued": len(results), "num_completed": len(ok), "num_failed": len(results) - len(ok),
        "errors": errors, "duration_s": wall_s,
        "num_short_outputs": sum(r.output_tokens < r.expected_output_tokens for r in ok),
        "total_prompt_tokens": sum(r.prompt_tokens for r in ok), "total_output_tokens": num_out,
        "total_cached_tokens": sum(r.cached_tokens for r in ok),
        "cached_token_fraction": (sum(r.cached_tokens for r in ok)
                                  / max(1, sum(r.prompt_tokens for r in ok))),
        "request_throughput": len(ok) / wall_s if wall_s else 0.0,
        "output_throughput": num_out / wall_s if wall_s else 0.0,
        "slos_ms": slos_ms, "num_good": len(good),
        "goodput": len(good) / wall_s if wall_s else 0.0,
        **latency_stats(ok),
        "by_kind": {k: {"count": sum(r.kind == k for r in ok),
                        **latency_stats([r for r in ok if r.kind == k])} for k in kinds},
    }


def format_table(record: dict) -> str:
    s = record["summary"]
    slos = " ".join(f"{k}<={v:g}ms" for k, v in s["slos_ms"].items()) or "none"
    lines = [
        f"== {record['label']}: {record['model']} ({record['bench'].get('endpoint', 'sim')}, "
        f"rate {record['bench'].get('request_rate', 'trace')}/s, "
        f"{record['workload'].get('dataset', 'trace')}) ==",
        f"completed {s['num_completed']}/{s['num_issued']} in {s['duration_s']:.1f}s "
        f"(failed {s['num_failed']}, short outputs {s['num_short_outputs']})",
        f"request throughput {s['request_throughput']:.3f} req/s   "
        f"output {s['output_throughput']:.1f} tok/s   "
        f"goodput {s['goodput']:.3f} req/s ({s['num_good']} met SLOs: {slos})   "
        f"cached prompt tokens {s['total_cached_tokens']} ({100 * s['cached_token_fraction']:.0f}%)",
        f"{'metric (ms)':<12}{'mean':>10}{'median':>10}{'p90':>10}{'p99':>10}",
    ]
    for key in STAT_KEYS:
        st = s[key]
        lines.append(f"{key[:-3].upper():<12}{st['mean']:>10.1f}{st['median']:>10.1f}"
                     f"{st['p90']:>10.1f}{st['p99']:>10.1f}")
    for err, n in s["errors"].items():
        lines.append(f"  {n} x {err}")
    return "\n".join(lines)


def write_result(record: dict, results_dir: Path) -> Path:
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"serve_{record['label']}_{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(record, indent=1))
    return path
