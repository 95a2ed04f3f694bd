"""The engines' Prometheus endpoints (--metrics-port), scraped over HTTP from real engine
processes with a real NIXL pull between them, and parsed with prometheus_client's own parser:
the counters move by what the requests did, failures and expired leases are counted by reason,
a preemption is counted, and every expression of the Grafana dashboard names a metric that a
real engine or the router exposes.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
import socket
import time
import urllib.request
import uuid
from pathlib import Path

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from baton.ops.ports import free_port
from baton.protocol import SamplingOptions, TokenDelta
from baton.service.metrics import EngineMetrics
from baton_cli.main import build_parser
from router.metrics import RouterMetrics
from tests.cluster import EngineProcess, start_all, wait_for, wait_whole

pytestmark = pytest.mark.slow

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "baton-dashboard.json"
# SmolLM2's KV block in float32: 30 layers x (K, V) x 16 tokens x 3 KV heads x 64 x 4 bytes.
BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 4
GREEDY = SamplingOptions(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("metrics")
    ports = {"prompt": free_port(), "completion": free_port()}
    engines = {
        # A short lease, so one test can watch a lease expire.
        "prompt": EngineProcess("prompt-engine", "prompt-m", logs, args=[
            "--num-blocks", "96", "--lease-ttl", "3", "--metrics-port", str(ports["prompt"])]),
        # 7 usable blocks: two decodes past 48 tokens cannot both fit, so one is preempted.
        "completion": EngineProcess("completion-engine", "completion-m", logs, args=[
            "--num-blocks", "8", "--kv-timeout", "10",
            "--metrics-port", str(ports["completion"])]),
    }
    for role, engine in engines.items():
        engine.metrics_port = ports[role]
    try:
        start_all(list(engines.values()))
        yield engines
    finally:
        for engine in engines.values():
            engine.stop()


@pytest.fixture(autouse=True)
def pools_whole_after(request):
    yield
    if "cluster" in request.fixturenames:
        cluster = request.getfixturevalue("cluster")
        wait_whole([cluster["prompt"], cluster["completion"]])


# --------------------------------------------------------------------------- helpers
def scrape(engine: EngineProcess) -> list:
    url = f"http://127.0.0.1:{engine.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5.0) as resp:
        return list(text_string_to_metric_families(resp.read().decode()))


def value(families: list, sample: str, **labels: str) -> float:
    """The sum of the samples named `sample` whose labels include `labels` (0 if none)."""
    return sum(s.value for f in families for s in f.samples
               if s.name == sample and labels.items() <= s.labels.items())


def _ids(n: int, seed: int) -> list[int]:
    return [300 + (i * 7919 + seed * 104729) % 40000 for i in range(n)]


def _prefill(prompt: EngineProcess, ids: list[int], opts=GREEDY) -> TokenDelta:
    with prompt.client() as c:
        first = c.generate(ids, opts, req_id=uuid.uuid4().hex, timeout_s=120)
    assert first.kv_handle and len(first.token_ids) == 1, first
    return first


def _decode(completion: EngineProcess, ids: list[int], first: TokenDelta,
            opts=GREEDY) -> TokenDelta:
    with completion.client() as c:
        return c.generate(ids, opts, req_id=first.req_id, timeout_s=120,
                          kv_handle=first.kv_handle, first_token_id=first.token_ids[0])


def _settled(engine: EngineProcess, before: list, want: dict) -> dict:
    """How far each of `want`'s samples moved since `before`, once that equals `want` or
    after 10 s: counters mirrored from the loop's snapshot lag by up to its period (0.25 s)."""
    deadline = time.monotonic() + 10.0
    while True:
        after = scrape(engine)
        got = {(name, lb): value(after, name, **dict(lb)) - value(before, name, **dict(lb))
               for name, lb in want}
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


# --------------------------------------------------------------------------- the tests
def test_metrics_are_off_by_default_and_port_0_is_off():
    for command in ("engine", "prompt-engine", "completion-engine"):
        assert build_parser().parse_args([command]).metrics_port == 0
    with pytest.raises(ValueError, match="metrics port"):
        EngineMetrics("e", "normal").serve("127.0.0.1", 0)


def test_server_binds_the_host_and_stops_on_close():
    metrics = EngineMetrics("e-1", "normal")
    port = free_port()
    metrics.serve("127.0.0.1", port)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5.0) as resp:
        assert resp.status == 200
    metrics.close()
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2.0):
        pass
    metrics.close()  # idempotent


def test_endpoints_listen_on_loopback_with_engine_labels(cluster):
    for role, engine in cluster.items():
        listening = {c.laddr for c in psutil.Process(engine.proc.pid).net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN}
        assert ("127.0.0.1", engine.metrics_port) in listening, listening
        families = {f.name: f for f in scrape(engine)}
        (sample,) = families["baton_num_requests_running"].samples
        assert sample.labels == {"engine_id": engine.engine_id, "role": role}
        assert families["baton_kv_cache_usage_perc"].type == "gauge"


def test_counters_move_by_what_two_turns_did(cluster):
    """Two runs of one 40-token prompt: the second hits both prefix caches (2 full blocks)."""
    prompt, completion = cluster["prompt"], cluster["completion"]
    before_p, before_c = scrape(prompt), scrape(completion)
    ids = _ids(40, seed=11)
    for _ in range(2):
        rest = _decode(completion, ids, _prefill(prompt, ids))
        assert rest.finish_reason == "length", rest.error
        wait_whole([prompt, completion])  # the lease ended: its blocks are cached
    handed_off, length = (("finished_reason", "handed_off"),), (("finished_reason", "length"),)
    want_p = {("baton_request_success_total", handed_off): 2,
              ("baton_prefix_cache_queries_total", ()): 80,
              ("baton_prefix_cache_hits_total", ()): 32,
              ("baton_prompt_tokens_total", ()): 40 + 8,
              ("baton_generation_tokens_total", ()): 2,
              ("baton_kv_leases_held_total", ()): 2,
              ("baton_time_to_first_token_seconds_count", ()): 2,
              ("baton_time_per_output_token_seconds_count", ()): 0,
              ("baton_e2e_request_latency_seconds_count", ()): 2}
    want_c = {("baton_request_success_total", length): 2,
              ("baton_kv_transfer_seconds_count", ()): 2,
              ("baton_kv_blocks_pulled_total", ()): 3 + 1,
              ("baton_kv_blocks_reused_total", ()): 2,
              ("baton_kv_transfer_bytes_total", ()): 4 * BLOCK_BYTES,
              ("baton_generation_tokens_total", ()): 2 * 3,
              # 3 tokens decoded, one delta each: the first, then two intervals.
              ("baton_time_to_first_token_seconds_count", ()): 2,
              ("baton_time_per_output_token_seconds_count", ()): 2 * 2,
              ("baton_e2e_request_latency_seconds_count", ()): 2}
    assert _settled(prompt, before_p, want_p) == want_p
    assert _settled(completion, before_c, want_c) == want_c
    after_c = scrape(completion)
    assert value(after_c, "baton_kv_transfer_seconds_sum") > value(
        before_c, "baton_kv_transfer_seconds_sum")
    idle = {("baton_num_requests_running", ()): 0, ("baton_num_requests_waiting", ()): 0,
            ("baton_kv_cache_usage_perc", ()): 0}
    assert _settled(completion, [], idle) == idle
    assert _settled(prompt, [], {**idle, ("baton_kv_leases_active", ()): 0}) == {
        **idle, ("baton_kv_leases_active", ()): 0}


def test_an_expired_lease_is_counted_on_both_sides(cluster):
    prompt, completion = cluster["prompt"], cluster["completion"]
    before_p, before_c = scrape(prompt), scrape(completion)
    ids = _ids(20, seed=12)
    first = _prefill(prompt, ids)
    wait_for(lambda: value(scrape(prompt), "baton_kv_leases_expired_total")
             > value(before_p, "baton_kv_leases_expired_total"), timeout_s=20.0, poll_s=0.2)
    rest = _decode(completion, ids, first)
    assert rest.finish_reason == "kv_transfer_failed", rest
    name = "baton_kv_transfer_failures_total"
    wait_for(lambda: value(scrape(completion), name, reason="lease_expired")
             > value(before_c, name, reason="lease_expired"), timeout_s=10.0, poll_s=0.1)
    after_c = scrape(completion)
    assert value(after_c, name) - value(before_c, name) == 1  # no other reason moved
    assert value(after_c, "baton_request_success_total", finished_reason="kv_transfer_failed") \
        == value(before_c, "baton_request_success_total",
                 finished_reason="kv_transfer_failed") + 1
    assert value(after_c, "baton_kv_transfer_seconds_count") == value(
        before_c, "baton_kv_transfer_seconds_count")  # the histogram times successful pulls


def test_a_preemption_is_counted(cluster):
    """Two 40-token prompts arrive with 3 blocks each of the completion engine's 7; at 49
    tokens each needs a fourth: the scheduler preempts one (a completion engine cannot
    recompute, so it finishes), the other runs to its end."""
    prompt, completion = cluster["prompt"], cluster["completion"]
    before = scrape(completion)
    opts = SamplingOptions(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [_ids(40, seed=13), _ids(40, seed=14)]
    firsts = [_prefill(prompt, ids, opts) for ids in prompts]
    with cf.ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda a: _decode(completion, *a, opts),
                             zip(prompts, firsts, strict=True)))
    reasons = sorted(o.finish_reason for o in outs)
    assert reasons == ["insufficient_system_resource", "length"], outs
    wait_for(lambda: value(scrape(completion), "baton_num_preemptions_total")
             == value(before, "baton_num_preemptions_total") + 1, timeout_s=10.0, poll_s=0.1)


def _exposed_names(families: list) -> set[str]:
    """Every name PromQL may use for these families (counters' _total, histograms' parts)."""
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"],
                "gauge": [""]}
    names = {s.name for f in families for s in f.samples}
    names |= {f.name + x for f in families for x in suffixes.get(f.type, [""])}
    return names


def test_dashboard_names_only_metrics_that_exist(cluster):
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
              for v in dashboard["templating"]["list"] if v["type"] == "query"]
    assert len(exprs) >= 10
    router = list(text_string_to_metric_families(RouterMetrics().render().decode()))
    exposed = _exposed_names(router)
    for engine in cluster.values():
        exposed |= _exposed_names(scrape(engine))
    used = {name for e in exprs for name in re.findall(r"\bbaton_[a-z0-9_]+", e)}
    assert used, exprs
    assert not used - exposed, f"the dashboard names metrics nobody exposes: {used - exposed}"
    titles = {p["title"] for p in dashboard["panels"]}
    assert len(titles) == len(dashboard["panels"]), "panel titles must be distinct"
