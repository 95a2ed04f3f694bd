"""Prometheus metrics of one engine process, served on `--metrics-port` (names after vLLM's).

Who writes what, given that only the service loop thread may touch the scheduler and the
worker (neither is thread-safe):
1. At the registry-snapshot cadence (baton/service/engine_service.py) the loop publishes an `EngineStats`
   snapshot (`publish`); a custom collector turns the latest one into gauges and into the
   counters the engine already keeps (busy seconds and steps, prefix cache, preemptions, tokens,
   KV leases and pulls) when Prometheus scrapes, on the HTTP thread. Publishing swaps one
   reference: no lock.
2. Events the loop sees itself go into prometheus_client's own (thread-safe) objects: a
   request's arrival (`on_arrival`) and each delta sent for it (`on_delta`: time to its first
   token, time per output token, end to end, finished requests by reason), every finished KV
   pull's duration (`on_pull`, a completion engine's admission).
3. `serve` starts prometheus_client's HTTP server in a daemon thread bound to the engine's
   --host; `close` stops it (the service loop's shutdown).
Every sample carries the `engine_id` and `role` labels. Each engine has a registry of its own,
so several engines in one process (tests) do not collide.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector

from baton.protocol import COMPLETION, PROMPT, EngineStats, TokenDelta
from kv_transfer.errors import FailReason, TransferState
from kv_transfer.pulls import TransferResult

logger = logging.getLogger(__name__)

LABELS = ("engine_id", "role")
# A pull is handshake (first time per peer) + claim round trip + NIXL READ: milliseconds on
# one host, up to the --kv-timeout (30 s) when a peer is slow.
_TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                     10.0, 30.0)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# A client's abort is not a transfer failure; everything else the importer reports is.
_NOT_FAILURES = {FailReason.ABORTED.value}

# (name, help, stats field or extra key) of the counters mirrored from the snapshot, per role.
_COUNTERS = [
    ("baton_engine_busy_seconds", "Seconds spent in engine steps (the forward and its booking; "
     "over wall time, how busy the engine is)", "busy_s"),
    ("baton_engine_prompt_busy_seconds", "Of the busy seconds, those of steps that ran a prompt "
     "step (the rest: decode steps)", "prompt_busy_s"),
    ("baton_engine_prompt_steps", "Prompt steps run (the rest of the steps: decode steps)",
     "num_prompt_steps"),
    ("baton_engine_loop_seconds", "Seconds of the engine loop's iterations that ran a step (the "
     "step, its messages and KV events; minus busy seconds, the service's own work)", "loop_s"),
    ("baton_engine_steps", "Engine steps run (a batch of prompt chunks and decodes each)",
     "num_steps"),
    ("baton_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
     "prefix_cache_query_tokens"),
    ("baton_prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed)",
     "prefix_cache_hit_tokens"),
    ("baton_num_preemptions", "Sequences preempted for lack of KV blocks (recomputed on "
     "normal and prompt engines, finished insufficient_system_resource on completion engines)",
     "num_preemptions"),
    ("baton_prompt_tokens", "Prompt tokens computed by prefill (cached tokens excluded, "
     "recomputed ones included)", "num_prompt_tokens"),
    ("baton_generation_tokens", "Tokens sampled by this engine", "num_generated_tokens"),
]
_PROMPT_COUNTERS = [
    ("baton_kv_leases_held", "Prompts whose KV blocks were put under a lease for a completion "
     "engine", "kv_leases_held"),
    ("baton_kv_leases_expired", "KV leases that ended by their deadline: never claimed, or "
     "claimed and never released", ("kv_leases_expired", "kv_claims_expired")),
]
_COMPLETION_COUNTERS = [
    ("baton_kv_transfer_bytes", "KV bytes pulled from prompt engines", "kv_bytes_total"),
    ("baton_kv_blocks_pulled", "KV blocks pulled from prompt engines", "kv_blocks_pulled"),
    ("baton_kv_blocks_reused", "Prompt KV blocks found in this engine's prefix cache instead "
     "of pulled", "kv_blocks_reused"),
]
_SPEC_COUNTERS = [
    ("baton_spec_drafted_tokens", "Draft tokens verified (speculative decoding)",
     "spec_drafted_tokens"),
    ("baton_spec_accepted_tokens", "Draft tokens the model agreed with (kept)",
     "spec_accepted_tokens"),
    ("baton_spec_verify_rows", "Decode rows that carried drafts", "spec_verify_rows"),
    ("baton_spec_skipped_batches", "Decode steps whose drafts were dropped: verifying them "
     "would not pay at that batch size (measured step times)", "spec_skipped_batches"),
]
# (name, help, stats.extra key prefix + position) of the per-position draft counters.
_SPEC_PER_POSITION = [
    ("baton_spec_drafted_tokens_per_pos", "Rows with a draft at this position (0 = the first)",
     "spec_drafted_pos_"),
    ("baton_spec_accepted_tokens_per_pos", "Rows whose draft at this position was kept",
     "spec_accepted_pos_"),
]
# (endpoint label, stats.extra key) of the CURVE refusal counters (kv_transfer/auth.py).
_AUTH_ENDPOINTS = [("engine", "auth_refused"), ("kv_side_channel", "kv_auth_refused")]
_FAILED_PREFIX = "kv_failed_"  # the importer's per-reason failure counters, in stats.extra
# stats.extra keys of KV integrity failures, one per where (baton_kv_integrity_failures_total).
INTEGRITY_PREFIX = "kv_integrity_failures_"
# Per KV tier (pool, disk, shared): (family, help, counter or gauge, stats.extra key kv_tier_<name>_<tier>).
TIER_PREFIX = "kv_tier_"
_TIER_FAMILIES = [
    ("baton_kv_tier_hit_tokens", "Prompt tokens served from this KV tier instead of computed "
     "(disk: loaded into the pool, then hit)", True, "hit_tokens"),
    ("baton_kv_tier_blocks", "Keyed KV blocks this tier holds now (pool: cached-free ones)",
     False, "blocks"),
    ("baton_kv_tier_bytes", "Bytes of KV blocks this tier holds now", False, "bytes"),
    ("baton_kv_tier_capacity_bytes", "Bytes this tier may hold", False, "capacity_bytes"),
    ("baton_kv_tier_capacity_tokens", "Tokens this tier may hold (pool: its blocks x block "
     "size; the KV budget's share beside it, the CPU backend's dense decode rows where it "
     "keeps them, holds none of its own)", False, "capacity_tokens"),
    ("baton_kv_tier_loads", "Prompts whose blocks were read from this tier", True, "loads"),
    ("baton_kv_tier_load_seconds", "Seconds spent reading and checking blocks of this tier "
     "and putting them into the pool (over loads: the mean load time)", True, "load_seconds"),
    ("baton_kv_tier_loaded_blocks", "Blocks loaded from this tier into the pool", True,
     "loaded_blocks"),
    ("baton_kv_tier_missed_blocks", "Blocks looked up in this tier but not loaded (refused, "
     "evicted meanwhile, no room): recomputed", True, "missed_blocks"),
    ("baton_kv_tier_written_blocks", "Blocks written to this tier (disk: evicted from the "
     "pool; shared: computed by a prompt step here)", True, "written_blocks"),
    ("baton_kv_tier_dropped_blocks", "Blocks not written (writer behind, I/O error, full disk, "
     "store down): recomputed when needed", True, "dropped_blocks"),
    ("baton_kv_tier_errors", "I/O errors of this tier (each a warning; requests recompute)",
     True, "errors"),
    ("baton_kv_tier_timeouts", "Reads of this tier given up at its timeout: the prompt "
     "computed", True, "timeouts"),
    ("baton_kv_tier_up", "1 while this tier's store answers, 0 while it is down (prompts "
     "recompute, it is retried)", False, "up"),
]


def _value(stats: EngineStats, key: str | tuple[str, ...]) -> float:
    if isinstance(key, tuple):
        return sum(_value(stats, k) for k in key)
    if hasattr(stats, key):
        return float(getattr(stats, key))
    return float(stats.extra.get(key, 0.0))


class _SnapshotCollector(Collector):
    """Families built from the latest published `EngineStats` at scrape time."""

    def __init__(self, engine_id: str, role: str) -> None:
        self.labels = [engine_id, role]
        self.role = role
        self.snapshot: EngineStats | None = None

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self.snapshot
        if stats is None:
            return
        yield self._gauge("baton_num_requests_running", "Sequences in the running queue",
                          stats.num_running)
        yield self._gauge("baton_num_requests_waiting", "Requests waiting to be scheduled "
                          "(and, on a completion engine, for blocks or for their KV pull)",
                          stats.num_waiting)
        total = stats.num_total_blocks
        used = (total - stats.num_free_blocks) / total if total else 0.0
        yield self._gauge("baton_kv_cache_usage_perc", "KV-cache usage: 1 means every block "
                          "is in use (cached-free blocks count as free)", used)
        counters = list(_COUNTERS)
        if self.role == PROMPT:
            counters += _PROMPT_COUNTERS
            yield self._gauge("baton_kv_leases_active", "Handed-off prompts whose KV blocks "
                              "are still under a lease", _value(stats, "kv_leases_active"))
        if self.role == COMPLETION:
            counters += _COMPLETION_COUNTERS
            yield self._failures(stats)
        if "spec_drafted_tokens" in stats.extra:
            yield from self._speculation(stats)
        integrity = self._integrity(stats)
        if integrity is not None:
            yield integrity
        yield from self._tiers(stats)
        refused = self._refused(stats)
        if refused is not None:
            yield refused
        for name, text, key in counters:
            family = CounterMetricFamily(name, text, labels=LABELS)
            family.add_metric(self.labels, _value(stats, key))
            yield family

    def _gauge(self, name: str, text: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, text, labels=LABELS)
        family.add_metric(self.labels, float(value))
        return family

    def _speculation(self, stats: EngineStats) -> Iterator[CounterMetricFamily]:
        """Speculative decoding (an engine started with --speculative): drafts verified and
        kept, overall and by position (acceptance at position j = accepted / drafted there)."""
        for name, text, key in _SPEC_COUNTERS:
            family = CounterMetricFamily(name, text, labels=LABELS)
            family.add_metric(self.labels, _value(stats, key))
            yield family
        for name, text, prefix in _SPEC_PER_POSITION:
            family = CounterMetricFamily(name, text, labels=[*LABELS, "position"])
            j = 0
            while f"{prefix}{j}" in stats.extra:
                family.add_metric([*self.labels, str(j)], stats.extra[f"{prefix}{j}"])
                j += 1
            yield family

    def _refused(self, stats: EngineStats) -> CounterMetricFamily | None:
        """Peers refused at the CURVE handshake, per socket (absent with --insecure)."""
        endpoints = [(endpoint, stats.extra[key]) for endpoint, key in _AUTH_ENDPOINTS
                     if key in stats.extra]
        if not endpoints:
            return None
        family = CounterMetricFamily("baton_auth_refused", "Peers refused at the handshake "
                                     "for want of the cluster's CURVE client key, by socket",
                                     labels=[*LABELS, "endpoint"])
        for endpoint, value in endpoints:
            family.add_metric([*self.labels, endpoint], value)
        return family

    def _integrity(self, stats: EngineStats) -> CounterMetricFamily | None:
        """KV refused for its bytes or its producer, by where it was checked: every
        `kv_integrity_failures_<where>` a worker reports ("pull": a completion engine's
        hand-offs; a KV tier adds its own where)."""
        wheres = [(key.removeprefix(INTEGRITY_PREFIX), value)
                  for key, value in sorted(stats.extra.items())
                  if key.startswith(INTEGRITY_PREFIX)]
        if not wheres:
            return None
        family = CounterMetricFamily("baton_kv_integrity_failures", "KV refused, never "
                                     "decoded, because its bytes differ from their checksum or "
                                     "its producer's fingerprint from this engine's, by where "
                                     "it was checked", labels=[*LABELS, "where"])
        for where, value in wheres:
            family.add_metric([*self.labels, where], value)
        return family

    def _tiers(self, stats: EngineStats) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        """Hits, bytes and load time per KV tier: every `kv_tier_<name>_<tier>` a worker
        reports (the pool's always, the disk tier's when it is on)."""
        for name, text, is_counter, key in _TIER_FAMILIES:
            prefix = f"{TIER_PREFIX}{key}_"
            tiers = [(k.removeprefix(prefix), v) for k, v in sorted(stats.extra.items())
                     if k.startswith(prefix)]
            if not tiers:
                continue
            kind = CounterMetricFamily if is_counter else GaugeMetricFamily
            family = kind(name, text, labels=[*LABELS, "tier"])
            for tier, value in tiers:
                family.add_metric([*self.labels, tier], value)
            yield family

    def _failures(self, stats: EngineStats) -> CounterMetricFamily:
        family = CounterMetricFamily("baton_kv_transfer_failures", "KV pulls that failed, by "
                                     "reason (peer_gone, lease_expired, timeout, ...)",
                                     labels=[*LABELS, "reason"])
        for key, value in sorted(stats.extra.items()):
            reason = key.removeprefix(_FAILED_PREFIX)
            if key.startswith(_FAILED_PREFIX) and reason not in _NOT_FAILURES:
                family.add_metric([*self.labels, reason], value)
        return family


class EngineMetrics:
    """One engine's registry, its collectors, and (after `serve`) its HTTP server."""

    def __init__(self, engine_id: str, role: str) -> None:
        self.registry = CollectorRegistry()
        self._snapshot = _SnapshotCollector(engine_id, role)
        self.registry.register(self._snapshot)
        self._labels = [engine_id, role]
        self._finished = Counter("baton_request_success", "Requests finished, by finish "
                                 "reason (handed_off: a prompt left with its KV handle)",
                                 [*LABELS, "finished_reason"], registry=self.registry)
        self._ttft = self._histogram(
            "baton_time_to_first_token_seconds", "A request's arrival at this engine to its first "
            "token delta (a completion engine's first decoded token: the KV pull included)",
            _TTFT_BUCKETS)
        self._tpot = self._histogram(
            "baton_time_per_output_token_seconds", "Time between two token deltas of a request, "
            "per token", _TPOT_BUCKETS)
        self._e2e = self._histogram(
            "baton_e2e_request_latency_seconds", "A request's arrival at this engine to its last "
            "delta (a prompt engine's: the hand-off)", _E2E_BUCKETS)
        # req_id -> (arrival, last token delta or 0.0); the service forgets what it drops.
        self._times: dict[str, tuple[float, float]] = {}
        self._transfer_seconds = None
        if role == COMPLETION:
            self._transfer_seconds = self._histogram(
                "baton_kv_transfer_seconds", "One successful KV pull, start to result: "
                "handshake (first time per peer), claim, NIXL READ", _TRANSFER_BUCKETS)
        self._server = None
        self._thread: threading.Thread | None = None
        self.port = 0

    # ---- the service loop's thread ----

    def publish(self, stats: EngineStats) -> None:
        """The snapshot the next scrapes read; the caller must not change it afterwards."""
        self._snapshot.snapshot = stats

    def on_arrival(self, req_id: str) -> None:
        self._times[req_id] = (time.monotonic(), 0.0)

    def on_delta(self, delta: TokenDelta, ends: bool | None = None) -> None:
        """A delta the service sends for a request it tracks (after `on_arrival`); `ends`:
        it is the request's last (None: when it has a finish reason or a KV handle)."""
        times = self._times.get(delta.req_id)
        if times is None:
            return
        now, (arrived, last) = time.monotonic(), times
        if delta.token_ids:
            if last:
                self._tpot.observe((now - last) / len(delta.token_ids))
            else:
                self._ttft.observe(now - arrived)
            self._times[delta.req_id] = (arrived, now)
        if ends is None:
            ends = bool(delta.finish_reason or delta.kv_handle)  # a handle ends a PROMPT request
        if ends:
            del self._times[delta.req_id]
            self._e2e.observe(now - arrived)
            self._finished.labels(*self._labels, delta.finish_reason or "handed_off").inc()

    def forget(self, req_id: str) -> None:
        """A request the service dropped without a final delta (its router is gone)."""
        self._times.pop(req_id, None)

    def on_pull(self, result: TransferResult) -> None:
        """A finished KV pull (the admission's collect): its duration when it succeeded."""
        if self._transfer_seconds is not None and result.state == TransferState.DONE:
            self._transfer_seconds.observe(result.seconds)

    def _histogram(self, name: str, text: str, buckets: tuple[float, ...]):
        return Histogram(name, text, LABELS, buckets=buckets,
                         registry=self.registry).labels(*self._labels)

    # ---- exposition ----

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def serve(self, host: str, port: int) -> None:
        """Serve /metrics on host:port (a daemon thread); OSError when the port is taken."""
        if not 0 < port < 65536:
            raise ValueError(f"metrics port must be in [1, 65535], got {port}")
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self.port = self._server.server_port
        logger.info("metrics on http://%s:%d/metrics", host, self.port)

    def close(self) -> None:
        """Stop the HTTP server (idempotent)."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
