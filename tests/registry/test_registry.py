from __future__ import annotations

import pytest

from baton.ops.redis_server import RedisServer, RedisStartError
from baton.ops.registry import (
    EngineRecord,
    Heartbeat,
    RedisRegistry,
    RegistryConfig,
    StaticRegistry,
    make_registry,
)
from baton.protocol import (
    MAX_MESSAGE_BYTES,
    EngineOutputs,
    EngineStats,
    GenerateRequest,
    ProtocolError,
    SamplingOptions,
    TokenDelta,
    decode_to_engine,
    decode_to_router,
    encode,
)
from tests.cluster import wait_for


def _record(role: str = "prompt", engine_id: str = "p0", **kw) -> EngineRecord:
    return EngineRecord(role=role, engine_id=engine_id, address="tcp://127.0.0.1:1", **kw)


def _pttl_ms(redis_url: str, key: str) -> int:
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        return client.pttl(key)
    finally:
        client.close()


def test_publish_list_and_ttl_expiry(redis_url):
    reg = RedisRegistry(RegistryConfig(url=redis_url, ttl_s=0.5, heartbeat_s=0.1))
    reg.publish(_record("prompt", "p0", num_free_blocks=7))
    reg.publish(_record("completion", "c0"))
    # Redis itself drops each record within one TTL unless it is renewed...
    for key in ("baton:engine:prompt:p0", "baton:engine:completion:c0"):
        assert 0 < _pttl_ms(redis_url, key) <= 500, key
    [rec] = reg.list("prompt")
    assert (rec.engine_id, rec.num_free_blocks) == ("p0", 7)
    assert [r.engine_id for r in reg.list("completion")] == ["c0"]
    # ...and then nobody lists it.
    wait_for(lambda: reg.list("prompt") == [] and reg.list("completion") == [])
    reg.close()


def test_heartbeat_renews_and_deregisters(redis_url):
    cfg = RegistryConfig(url=redis_url, ttl_s=0.4, heartbeat_s=0.1)
    reg = RedisRegistry(cfg)
    beats = []

    def make() -> EngineRecord:
        beats.append(1)
        return _record("normal", "n0", num_running=len(beats))

    hb = Heartbeat(reg, make, cfg.heartbeat_s).start()
    # Five intervals (each at least heartbeat_s) after the first record: past its TTL, so only
    # renewal keeps it; the sixth beat has begun, so the fifth record is in place.
    wait_for(lambda: len(beats) >= 6)
    [rec] = reg.list("normal")
    assert rec.num_running >= 5
    assert 0 < _pttl_ms(redis_url, "baton:engine:normal:n0") <= 400
    hb.stop()
    assert reg.list("normal") == []
    reg.close()


def test_prefix_isolates_deployments(redis_url):
    a = RedisRegistry(RegistryConfig(url=redis_url, prefix="a"))
    b = RedisRegistry(RegistryConfig(url=redis_url, prefix="b"))
    a.publish(_record())
    assert len(a.list("prompt")) == 1 and b.list("prompt") == []


def test_bad_role_and_config_rejected(redis_url):
    reg = RedisRegistry(RegistryConfig(url=redis_url))
    with pytest.raises(ValueError, match="bogus"):
        reg.publish(_record(role="bogus"))
    with pytest.raises(ValueError, match="heartbeat_s"):
        RegistryConfig(ttl_s=1.0, heartbeat_s=2.0)


def test_static_registry():
    reg = make_registry(RegistryConfig(), ["prompt=tcp://127.0.0.1:5000,tcp://127.0.0.1:5001",
                                           "completion=tcp://127.0.0.1:6000"])
    assert isinstance(reg, StaticRegistry)
    [p] = reg.list("prompt")
    assert p.side_channel == "tcp://127.0.0.1:5001"
    assert [c.address for c in reg.list("completion")] == ["tcp://127.0.0.1:6000"]
    with pytest.raises(ValueError, match="nonsense"):
        StaticRegistry.parse(["nonsense"])


def test_redis_port_in_use_is_a_clear_error(redis_server):
    with pytest.raises(RedisStartError, match="already in use"):
        RedisServer(port=redis_server.port).start()


def test_protocol_round_trip_and_untrusted_input():
    req = GenerateRequest("r1", [1, 2, 3], SamplingOptions(max_tokens=4, seed=3))
    assert decode_to_engine(encode(req)) == req
    outputs = EngineOutputs([TokenDelta("r1", [5], [-0.1], finish_reason="stop"),
                             TokenDelta("r2", [7])])
    assert decode_to_router(encode(outputs)) == outputs
    assert decode_to_router(encode(EngineStats("e", "prompt"))).role == "prompt"
    with pytest.raises(ProtocolError):
        decode_to_engine(b"\x93garbage")
    with pytest.raises(ProtocolError, match="exceeds"):
        decode_to_engine(b"\x00" * (MAX_MESSAGE_BYTES + 1))
    with pytest.raises(ProtocolError):  # wrong type for a field
        decode_to_engine(encode(TokenDelta("r1")))
