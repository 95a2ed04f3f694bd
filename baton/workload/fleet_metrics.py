"""The `fleet` section of `baton bench`'s record, read from the engines' Prometheus endpoints.

`baton sim` fills `fleet` from its simulated engines (simulator/fleet.py `fleet_record`);
`baton bench --engine-metrics URL ...` fills the same keys, where the engines' metrics give
them, from two scrapes of each engine's `/metrics` (the URLs `baton up`'s banner prints): one
before the run and one after it. Every figure is a difference of the two, so it covers the run
and not the engine's life; a counter that went down (the engine restarted during the run)
counts from zero. Per engine: name (its `engine_id` label), role, busy_s
(`baton_engine_busy_seconds_total`: seconds in engine steps), prefill_busy_s and
num_prompt_steps (`baton_engine_prompt_busy_seconds_total`, `..._prompt_steps_total`: those of
prompt steps; left out for an engine that does not expose them), loop_s (`baton_engine_loop_seconds_total`:
the loop iterations that stepped; minus busy_s, the service's own work), busy_fraction (over the run's
wall time), num_steps, num_prompt_tokens (computed by prefill, cached ones excluded),
num_generated_tokens, num_preemptions, pulled_kv_blocks and pulled_kv_bytes (completion
engines), cache_hit_rate (prefix-cache hit tokens over looked-up tokens, over the run); the
fleet's total pulled_kv_bytes. An engine that cannot be scraped is listed under `unreachable`
(its URL, when, why); it never fails the benchmark.

The router cannot name the engines' metrics endpoints (the registry's records carry no
metrics URL), so the URLs come from the flag.
"""

from __future__ import annotations

import asyncio
import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from baton.protocol import COMPLETION

# fleet key -> the engine's counter sample (baton/service/metrics.py).
COUNTERS = {
    "busy_s": "baton_engine_busy_seconds_total",
    "prefill_busy_s": "baton_engine_prompt_busy_seconds_total",
    "num_prompt_steps": "baton_engine_prompt_steps_total",
    "loop_s": "baton_engine_loop_seconds_total",
    "num_steps": "baton_engine_steps_total",
    "num_prompt_tokens": "baton_prompt_tokens_total",
    "num_generated_tokens": "baton_generation_tokens_total",
    "num_preemptions": "baton_num_preemptions_total",
    "pulled_kv_blocks": "baton_kv_blocks_pulled_total",
    "pulled_kv_bytes": "baton_kv_transfer_bytes_total",
    "cache_queries": "baton_prefix_cache_queries_total",
    "cache_hits": "baton_prefix_cache_hits_total",
}
# Counters an engine of an earlier version does not expose: left out of its record rather
# than read as 0 (an engine without the prompt-step split is not one that ran no prompt step).
_OPTIONAL_KEYS = ("prefill_busy_s", "num_prompt_steps")
_INTEGER_KEYS = ("num_steps", "num_prompt_steps", "num_prompt_tokens", "num_generated_tokens",
                 "num_preemptions", "pulled_kv_blocks", "pulled_kv_bytes")
# The engines publish their counters every 0.25 s (the service loop's snapshot): a scrape this
# long after the last answer sees all of the run.
SETTLE_S = 0.5
SCRAPE_TIMEOUT_S = 5.0


@dataclass
class EngineCounters:
    """One engine's counters in one scrape (0 where it does not expose one)."""

    name: str
    role: str
    values: dict[str, float] = field(default_factory=dict)


def parse_engine_metrics(text: str) -> dict[str, EngineCounters]:
    """engine_id -> its counters, from one /metrics text (usually one engine; several where a
    process serves several). ValueError when the text does not parse."""
    by_name = {sample: key for key, sample in COUNTERS.items()}
    engines: dict[str, EngineCounters] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = by_name.get(sample.name)
            name = sample.labels.get("engine_id")
            if key is None or name is None:
                continue
            engine = engines.setdefault(name, EngineCounters(name, sample.labels.get("role", "")))
            engine.values[key] = engine.values.get(key, 0.0) + sample.value
    return engines


def scrape(url: str, timeout_s: float = SCRAPE_TIMEOUT_S) -> dict[str, EngineCounters]:
    """GET one /metrics URL; OSError or ValueError when it cannot be reached or read."""
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 - user's URL
        return parse_engine_metrics(resp.read().decode())


Scrape = dict[str, dict[str, EngineCounters] | str]  # url -> its engines, or why it failed


async def scrape_all(urls: list[str], timeout_s: float = SCRAPE_TIMEOUT_S) -> Scrape:
    """Every URL at once (threads); a failure is its message, never an exception."""
    async def one(url: str) -> dict[str, EngineCounters] | str:
        try:
            return await asyncio.to_thread(scrape, url, timeout_s)
        except (OSError, ValueError) as exc:
            return f"{type(exc).__name__}: {exc}"[:300]

    return dict(zip(urls, await asyncio.gather(*(one(u) for u in urls)), strict=True))


def _delta(before: float, after: float) -> float:
    return after - before if after >= before else after  # went down: a restart, from zero


def fleet_delta(before: Scrape, after: Scrape, wall_s: float) -> dict:
    """The `fleet` section: per engine, what its counters moved between the two scrapes."""
    engines, unreachable = [], []
    for url in dict.fromkeys([*before, *after]):  # the URLs' order, each once
        bad = [(when, scraped) for when, scraped in (("before", before.get(url)),
                                                     ("after", after.get(url)))
               if not isinstance(scraped, dict)]
        if bad:
            when, why = bad[0]
            unreachable.append({"url": url, "when": when, "error": why or "not scraped"})
            continue
        for name, end in sorted(after[url].items()):
            start = before[url].get(name)
            start_values = start.values if start is not None else {}
            d = {key: _delta(start_values.get(key, 0.0), end.values.get(key, 0.0))
                 for key in COUNTERS}
            for key in _INTEGER_KEYS:
                d[key] = round(d[key])
            queries, hits = d.pop("cache_queries"), d.pop("cache_hits")
            engines.append({
                "name": name, "role": end.role, "url": url, "busy_s": d["busy_s"],
                **{k: d[k] for k in _OPTIONAL_KEYS if k in end.values},
                "loop_s": d["loop_s"],
                "busy_fraction": d["busy_s"] / wall_s if wall_s > 0 else 0.0,
                **{k: d[k] for k in _INTEGER_KEYS if k not in _OPTIONAL_KEYS},
                "cache_hit_rate": hits / queries if queries else 0.0,
                "cache_query_tokens": round(queries), "cache_hit_tokens": round(hits)})
    return {"source": "engine_metrics", "wall_s": wall_s, "engines": engines,
            "pulled_kv_bytes": sum(e["pulled_kv_bytes"] for e in engines),
            "unreachable": unreachable}


def format_fleet(fleet: dict, max_engines: int = 16) -> str:
    """One short line for the table (as `baton sim` prints its busy line), plus one naming the
    engines that could not be scraped."""
    engines = fleet.get("engines", [])
    lines = []
    if engines:
        busy = ", ".join(f"{e['name']} {100 * e['busy_fraction']:.0f}%"
                         for e in engines[:max_engines])
        more = f" (+{len(engines) - max_engines} more)" if len(engines) > max_engines else ""
        # A completion engine looks its pulled prompts up again: the prompts count once.
        computing = [e for e in engines if e["role"] != COMPLETION] or engines
        queries = sum(e.get("cache_query_tokens", 0) for e in computing)
        hits = sum(e.get("cache_hit_tokens", 0) for e in computing)
        hit = f"{100 * hits / queries:.0f}%" if queries else "-"
        lines.append(f"busy: {busy}{more}; pulled KV {_bytes(fleet['pulled_kv_bytes'])}; "
                     f"prefix cache hits {hit}")
    if fleet.get("unreachable"):
        lines.append("engine metrics not read: " + ", ".join(
            f"{u['url']} ({u['when']}: {u['error'][:60]})" for u in fleet["unreachable"]))
    return "\n".join(lines)


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
