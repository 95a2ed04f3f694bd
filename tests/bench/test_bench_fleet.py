"""`baton bench --engine-metrics`: the record's `fleet` section from the engines' /metrics, the
differences of two scrapes (baton/workload/fleet_metrics.py), and once against a mock
deployment (`baton up --mock`) end to end."""

from __future__ import annotations

import json
import re

import pytest

from baton.protocol import EngineStats
from baton.service.client import is_whole, probe_engine
from baton.service.metrics import EngineMetrics
from baton.workload.fleet_metrics import (
    COUNTERS,
    fleet_delta,
    format_fleet,
    parse_engine_metrics,
)


def _text(engine_id: str, role: str, busy: float, steps: int, prompt: int, generated: int,
          queries: int, hits: int, pulled_blocks: int = 0, pulled_bytes: int = 0) -> str:
    """One engine's /metrics text; a quarter of its busy seconds and steps prompt steps."""
    stats = EngineStats(engine_id=engine_id, role=role, num_steps=steps,
                        num_prompt_tokens=prompt, num_generated_tokens=generated,
                        extra={"busy_s": busy, "loop_s": busy + 0.01 * steps,
                               "prompt_busy_s": busy / 4, "num_prompt_steps": steps / 4,
                               "prefix_cache_query_tokens": queries,
                               "prefix_cache_hit_tokens": hits, "num_preemptions": 1,
                               "kv_blocks_pulled": pulled_blocks,
                               "kv_bytes_total": pulled_bytes})
    metrics = EngineMetrics(engine_id, role)
    metrics.publish(stats)
    return metrics.render().decode()


def test_the_parser_reads_every_counter_an_engine_exposes():
    """The names it looks for are the ones baton/service/metrics.py writes (a completion
    engine exposes all of them)."""
    text = _text("completion-0", "completion", 2.5, 40, 7, 33, 64, 48, 5, 1280)
    assert "# HELP baton_engine_busy_seconds_total Seconds spent in engine steps" in text
    (engine,) = parse_engine_metrics(text).values()
    assert (engine.name, engine.role) == ("completion-0", "completion")
    assert set(engine.values) == set(COUNTERS)
    assert engine.values == {"busy_s": 2.5, "loop_s": 2.9, "num_steps": 40,
                             "prefill_busy_s": 0.625, "num_prompt_steps": 10,
                             "num_prompt_tokens": 7,
                             "num_generated_tokens": 33, "num_preemptions": 1,
                             "pulled_kv_blocks": 5, "pulled_kv_bytes": 1280,
                             "cache_queries": 64, "cache_hits": 48}
    assert parse_engine_metrics("# nothing here\n") == {}


def test_the_fleet_is_what_moved_over_the_run():
    p0, p1 = "http://h:1/metrics", "http://h:2/metrics"
    c0, gone = "http://h:3/metrics", "http://h:4/metrics"
    before = {p0: parse_engine_metrics(_text("prompt-0", "prompt", 10.0, 100, 500, 20, 600, 100)),
              # restarted during the run: its counters start again from zero
              p1: parse_engine_metrics(_text("prompt-1", "prompt", 9.0, 90, 400, 20, 500, 100)),
              c0: parse_engine_metrics(_text("completion-0", "completion", 3.0, 50, 0, 80, 0, 0,
                                             10, 2560)),
              gone: "URLError: <urlopen error [Errno 111] Connection refused>"}
    after = {p0: parse_engine_metrics(_text("prompt-0", "prompt", 14.0, 130, 800, 26, 1000, 200)),
             p1: parse_engine_metrics(_text("prompt-1", "prompt", 1.0, 8, 64, 2, 96, 32)),
             c0: parse_engine_metrics(_text("completion-0", "completion", 7.0, 150, 0, 280,
                                            0, 0, 30, 7680)),
             gone: "URLError: <urlopen error [Errno 111] Connection refused>"}
    fleet = fleet_delta(before, after, wall_s=8.0)
    by_name = {e["name"]: e for e in fleet["engines"]}
    assert list(by_name) == ["prompt-0", "prompt-1", "completion-0"]  # the URLs' order
    p = by_name["prompt-0"]
    assert (p["role"], p["busy_s"], p["busy_fraction"], p["num_steps"]) == ("prompt", 4.0, 0.5, 30)
    assert (p["prefill_busy_s"], p["num_prompt_steps"]) == (1.0, 8)  # 32.5 - 25 steps, rounded
    assert (p["num_prompt_tokens"], p["num_generated_tokens"], p["num_preemptions"]) == (300, 6, 0)
    assert p["cache_hit_rate"] == 100 / 400 and p["pulled_kv_bytes"] == 0
    assert (by_name["prompt-1"]["num_steps"], by_name["prompt-1"]["cache_hit_rate"]) == (8, 1 / 3)
    c = by_name["completion-0"]
    assert (c["pulled_kv_blocks"], c["pulled_kv_bytes"], c["cache_hit_rate"]) == (20, 5120, 0.0)
    assert fleet["pulled_kv_bytes"] == 5120 and fleet["wall_s"] == 8.0
    assert fleet["unreachable"] == [{"url": gone, "when": "before", "error": before[gone]}]
    # The simulator's keys, where the metrics give them (simulator/fleet.py fleet_record).
    assert {"name", "role", "busy_s", "busy_fraction", "num_steps", "num_prompt_tokens",
            "num_generated_tokens", "num_preemptions", "pulled_kv_blocks", "pulled_kv_bytes",
            "cache_hit_rate"} <= set(c)
    line = format_fleet(fleet)
    assert line.startswith("busy: prompt-0 50%, prompt-1 12%, completion-0 50%; pulled KV "
                           "5.0 KiB; prefix cache hits 27%\n")
    assert f"not read: {gone} (before: URLError" in line
    # An engine of an earlier version, without the prompt-step split: left out, not 0.
    old = {p0: parse_engine_metrics(re.sub(r"(?m)^baton_engine_prompt_.*$", "",
                                           _text("prompt-0", "prompt", 1.0, 8, 64, 2, 9, 3)))}
    (e,) = fleet_delta({p0: {}}, old, 1.0)["engines"]
    assert "prefill_busy_s" not in e and "num_prompt_steps" not in e and e["num_steps"] == 8
    # Reachable before the run only: noted with when it failed.
    assert fleet_delta({p0: before[p0]}, {p0: "TimeoutError: timed out"}, 1.0)["unreachable"] == [
        {"url": p0, "when": "after", "error": "TimeoutError: timed out"}]


@pytest.mark.slow  # a multi-process deployment (tests/sim/test_mock_engines.py)
def test_baton_bench_fills_the_fleet_from_mock_engines(tmp_path, capsys):
    from baton_cli.main import main as baton_main
    from tests.cluster import KEYS, wait_for
    from tests.sim.test_mock_engines import _start

    up = _start(["--prompt-engines", "1", "--completion-engines", "1"])
    try:
        urls = up.metrics_urls
        assert sorted(urls) == ["completion-0", "prompt-0"], up.banner
        # One system prompt for all: every request after the first hits the prefix cache.
        code = baton_main(["bench", "--base-url", up.base_url, "--no-progress",
                           "--dataset", "shared-prefix", "--num-system-prompts", "1",
                           "--system-prompt-len", "40", "--short-input-range", "8:16",
                           "--short-output-range", "4:4", "--num-requests", "6",
                           "--max-concurrency", "2", "--label", "fleet",
                           "--results-dir", str(tmp_path),
                           "--engine-metrics", *urls.values(), "http://127.0.0.1:9/metrics"])
        addresses = list(up.engines.values())

        def whole() -> bool:  # no block owned, no lease, no pull on either engine
            stats = [probe_engine(a, 5.0, keys=KEYS) for a in addresses]
            return all(s is not None and is_whole(s) for s in stats)

        assert len(addresses) == 2, up.banner
        wait_for(whole, timeout_s=30, poll_s=0.2)
    finally:
        up.stop()
    assert code == 0
    printed = capsys.readouterr().out
    assert re.search(r"^busy: prompt-0 \d+%, completion-0 \d+%; pulled KV", printed, re.M), printed
    (path,) = tmp_path.glob("serve_fleet_*.json")
    record = json.loads(path.read_text())
    assert record["summary"]["num_completed"] == 6
    fleet = record["fleet"]
    assert [(e["name"], e["role"]) for e in fleet["engines"]] == [
        ("prompt-0", "prompt"), ("completion-0", "completion")]
    assert all(e["busy_s"] > 0 and e["num_steps"] > 0 for e in fleet["engines"])
    # The loop's iterations that stepped hold the steps and the service's work around them.
    assert all(e["loop_s"] >= e["busy_s"] for e in fleet["engines"])
    # The prompt-step split: a prompt engine runs only prompt steps, a completion engine none.
    prompt, completion = fleet["engines"]
    assert prompt["num_prompt_steps"] == prompt["num_steps"]
    assert 0.9 * prompt["busy_s"] <= prompt["prefill_busy_s"] <= prompt["busy_s"]
    assert (completion["num_prompt_steps"], completion["prefill_busy_s"]) == (0, 0.0)
    assert fleet["unreachable"][0]["url"] == "http://127.0.0.1:9/metrics"
    sent = sum(r["prompt_tokens"] - r["cached_tokens"] for r in record["requests"])
    assert sum(e["num_prompt_tokens"] for e in fleet["engines"]) == sent
    assert prompt["cache_hit_rate"] > 0
    assert completion["pulled_kv_blocks"] > 0 and fleet["pulled_kv_bytes"] > 0
    assert completion["num_generated_tokens"] > 0
