"""`baton_kv_tier_*{tier}` and `baton_kv_integrity_failures_total{where="disk"}` on an engine's
/metrics, from the stats a worker with a disk tier (and a shared tier) reports (README: KV
tiers)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from baton.protocol import EngineStats
from baton.service.metrics import EngineMetrics


def test_tier_families_carry_one_sample_per_tier() -> None:
    metrics = EngineMetrics("e0", "normal")
    metrics.publish(EngineStats("e0", "normal", num_total_blocks=32, extra={
        "kv_tier_hit_tokens_pool": 160.0, "kv_tier_hit_tokens_disk": 32.0,
        "kv_tier_bytes_pool": 1000.0, "kv_tier_bytes_disk": 2000.0,
        "kv_tier_load_seconds_disk": 0.25, "kv_tier_loads_disk": 2.0,
        "kv_integrity_failures_disk": 1.0}))
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    hits = {s.labels["tier"]: s.value for s in families["baton_kv_tier_hit_tokens"].samples
            if s.name.endswith("_total")}
    assert hits == {"pool": 160.0, "disk": 32.0}
    assert families["baton_kv_tier_bytes"].type == "gauge"
    assert {s.labels["tier"] for s in families["baton_kv_tier_bytes"].samples} == {"pool", "disk"}
    loads = [s for s in families["baton_kv_tier_load_seconds"].samples if s.name.endswith("_total")]
    assert [(s.labels["tier"], s.value) for s in loads] == [("disk", 0.25)]
    assert "baton_kv_tier_loads" in families and "baton_kv_tier_errors" not in families
    integrity = families["baton_kv_integrity_failures"].samples[0]
    assert integrity.labels["where"] == "disk" and integrity.value == 1.0


def test_the_shared_tier_has_its_samples_and_its_up_gauge() -> None:
    metrics = EngineMetrics("e0", "normal")
    metrics.publish(EngineStats("e0", "normal", num_total_blocks=32, extra={
        "kv_tier_hit_tokens_pool": 16.0, "kv_tier_hit_tokens_shared": 64.0,
        "kv_tier_load_seconds_shared": 0.02, "kv_tier_up_shared": 0.0,
        "kv_tier_timeouts_shared": 1.0, "kv_integrity_failures_shared": 2.0}))
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    hits = {s.labels["tier"]: s.value for s in families["baton_kv_tier_hit_tokens"].samples
            if s.name.endswith("_total")}
    assert hits == {"pool": 16.0, "shared": 64.0}
    up = families["baton_kv_tier_up"]
    assert up.type == "gauge" and [(s.labels["tier"], s.value) for s in up.samples] == [
        ("shared", 0.0)]
    assert [s.value for s in families["baton_kv_tier_timeouts"].samples
            if s.name.endswith("_total")] == [1.0]
    integrity = families["baton_kv_integrity_failures"].samples[0]
    assert integrity.labels["where"] == "shared" and integrity.value == 2.0
