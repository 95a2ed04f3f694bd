"""Prometheus metrics of one router app, in a CollectorRegistry of its own.

A registry per app (not the process-global default) lets tests build many apps in one process
without "duplicated timeseries" errors, and keeps the scrape free of unrelated collectors.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from baton.ops.registry import EngineRecord

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Outcome(NamedTuple):
    """What one request met, for the planner's SLO signal (planner/signals.py): the router's
    record live, the simulator's (simulator/fleet.py) in virtual time."""

    done_s: float  # when it ended: the router's wall clock live, virtual time in baton sim
    ttft_s: float  # arrival to its first token (0: none came)
    tpot_s: float  # per output token after the first (0: one token or none)
    ok: bool  # finished; False: failed, or refused (a 429, a 503)


class RouterMetrics:
    # The planner's input (planner/core.py, `baton up --planner`): (arrival wall time, prompt
    # tokens, output tokens) of each finished request, and the `Outcome` of each request that
    # ended (failed and refused ones too), bounded.
    MAX_OBSERVATIONS = 50_000

    def __init__(self) -> None:
        self.recent: deque[tuple[float, int, int]] = deque(maxlen=self.MAX_OBSERVATIONS)
        self.outcomes: deque[Outcome] = deque(maxlen=self.MAX_OBSERVATIONS)
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("baton_router_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.ttft = Histogram("baton_router_time_to_first_token_seconds",
                              "Request arrival to the first generated token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("baton_router_inter_token_latency_seconds",
                             "Time between two deltas of a request, per token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("baton_router_e2e_request_latency_seconds",
                             "Request arrival to its last token", buckets=_E2E_BUCKETS, registry=r)
        self.kv_transfer = Histogram(
            "baton_router_kv_transfer_seconds",
            "Handing a request to the completion engine until its first delta (KV pull included)",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("baton_router_prompt_tokens", "Prompt tokens served",
                                     registry=r)
        self.generated_tokens = Counter("baton_router_generated_tokens", "Tokens generated",
                                        registry=r)
        self.retries = Counter("baton_router_engine_retries",
                               "Requests retried on another engine before their first token",
                               ["role"], registry=r)
        self.migrations = Counter("baton_router_migrations",
                                  "Requests moved to other engines after one failed mid-stream, "
                                  "by the failed engine's role and the failure",
                                  ["role", "cause"], registry=r)
        self.migration_tokens = Counter("baton_router_migration_prefill_tokens",
                                        "Tokens migrated requests prefilled again (prefilled) "
                                        "and how many of them were prefix-cache hits (cached)",
                                        ["kind"], registry=r)
        self.aborts = Counter("baton_router_aborts", "Requests aborted in the engines, by cause",
                              ["cause"], registry=r)
        self.planner_recommended = Gauge(
            "baton_router_planner_recommended_engines", "Engines of each role the planner "
            "recommends (its last decision, read from the registry)", ["role"], registry=r)
        self.engine_load = Gauge("baton_router_engine_load",
                                 "Registry load of an engine plus this router's in-flight requests",
                                 ["role", "engine"], registry=r)
        self.engine_free_blocks = Gauge("baton_router_engine_free_blocks",
                                        "Free KV blocks an engine last published",
                                        ["role", "engine"], registry=r)

        self.routing_decisions = Counter(
            "baton_router_routing_decisions",
            "Engines chosen, by role and whether the chosen one held part of the prompt "
            "(cached / uncached; least_loaded under --routing least-loaded)",
            ["role", "outcome"], registry=r)
        self.routing_credited_blocks = Counter(
            "baton_router_routing_credited_blocks",
            "Prompt blocks the chosen engine held, as its KV events said (cache-credited hits)",
            ["role"], registry=r)
        self.path = Counter(
            "baton_router_path",
            "Requests by the path they took (colocated on a normal engine, or disaggregated) "
            "and why (router/path.py: only_path, predicted, threshold, default_threshold, "
            "fallback)",
            ["path", "reason"], registry=r)
        self.slo_rejections = Counter(
            "baton_router_slo_rejections",
            "Requests answered 429 at once because their predicted TTFT on the path they would "
            "take was past --admission-factor x --admission-ttft-ms (router/admission.py)",
            ["path"], registry=r)
        self.kv_index_keys = Gauge("baton_router_kv_index_keys",
                                   "Block keys this router's index credits an engine with",
                                   ["role", "engine"], registry=r)
        self.api_key_requests = Counter(
            "baton_router_api_key_requests", "HTTP requests by API key name and status",
            ["key", "status"], registry=r)
        self.api_key_tokens = Counter(
            "baton_router_api_key_tokens", "Tokens served by API key name: prompt, generated",
            ["key", "kind"], registry=r)
        self.registry_rejected = Counter(
            "baton_router_registry_rejected",
            "Engine records read from the registry and ignored (unsigned, a bad signature, "
            "stale or undecodable): someone with write access to Redis, or a wrong key",
            registry=r)
        self.kv_index_resyncs = Gauge(
            "baton_router_kv_index_resyncs",
            "Times an engine's index entries were dropped for a gap, restart or bad message",
            registry=r)

    def set_engine_loads(self, records: list[tuple[EngineRecord, int]]) -> None:
        # Engines that left the registry must leave the scrape too.
        self.engine_load.clear()
        self.engine_free_blocks.clear()
        for record, num_inflight in records:
            self.engine_load.labels(record.role, record.engine_id).set(record.load + num_inflight)
            self.engine_free_blocks.labels(record.role, record.engine_id).set(record.num_free_blocks)

    def set_kv_index(self, num_keys: list[tuple[EngineRecord, int]], num_resyncs: int) -> None:
        self.kv_index_keys.clear()
        for record, num in num_keys:
            self.kv_index_keys.labels(record.role, record.engine_id).set(num)
        self.kv_index_resyncs.set(num_resyncs)

    def render(self) -> bytes:
        return generate_latest(self.registry)
