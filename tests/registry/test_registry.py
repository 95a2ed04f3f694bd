from __future__ import annotations

import os

import pytest

from baton.ops.redis_server import RedisServer, RedisStartError
from baton.ops.registry import (
    EngineRecord,
    Heartbeat,
    RedisRegistry,
    RegistryConfig,
    StaticRegistry,
    connect,
    make_registry,
    record_signing_key,
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
from kv_transfer.auth import ClusterKeys, generate
from tests.cluster import wait_for


def _record(role: str = "prompt", engine_id: str = "p0", **kw) -> EngineRecord:
    kw.setdefault("address", "tcp://127.0.0.1:1")
    return EngineRecord(role=role, engine_id=engine_id, **kw)


def _pttl_ms(redis_url: str, key: str) -> int:
    client = connect(redis_url)
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


def test_embedded_redis_is_closed_without_the_password(redis_server):
    import socket

    import redis

    # A plain client's first command, as redis-cli sends it: refused with NOAUTH.
    with socket.create_connection((redis_server.host, redis_server.port), timeout=2.0) as sock:
        sock.sendall(b"PING\r\n")
        assert sock.recv(256).startswith(b"-NOAUTH"), "Redis answered without a password"
    anonymous = redis.Redis(host=redis_server.host, port=redis_server.port, socket_timeout=2.0)
    wrong = redis.Redis(host=redis_server.host, port=redis_server.port, username="baton",
                        password="not-it", socket_timeout=2.0)
    try:
        for client in (anonymous, wrong):
            with pytest.raises(redis.AuthenticationError):
                client.ping()
    finally:
        anonymous.close()
        wrong.close()
    # The password is in a private file, not on the server's command line.
    assert oct(os.stat(redis_server.password_file).st_mode & 0o777) == "0o600"
    with open(f"/proc/{redis_server.proc.pid}/cmdline", "rb") as f:
        assert redis_server.password.encode() not in f.read()
    assert redis_server.password not in redis_server.url
    client = connect(redis_server.url, redis_server.password_file)
    try:
        assert client.ping()
    finally:
        client.close()


def test_a_world_readable_password_file_is_refused(tmp_path, redis_server):
    path = tmp_path / "pw"
    path.write_text(redis_server.password + "\n")
    path.chmod(0o644)
    with pytest.raises(ValueError, match="readable by every user"):
        connect(redis_server.url, str(path))
    path.chmod(0o600)
    connect(redis_server.url, str(path)).close()


def _signed(redis_url: str, keys) -> RedisRegistry:
    return RedisRegistry(RegistryConfig(url=redis_url, signing_key=record_signing_key(keys)))


def test_a_forged_record_is_ignored_and_counted(redis_url, tmp_path):
    import msgspec

    keys = ClusterKeys.load(generate(tmp_path / "keys"))
    engine, router = _signed(redis_url, keys), _signed(redis_url, keys)
    engine.publish(_record("prompt", "p0"))
    assert [r.engine_id for r in router.list("prompt")] == ["p0"]
    client = connect(redis_url)
    try:
        # Anyone who can write to Redis: an unsigned record, a record signed with another
        # cluster's key, and a genuine record whose address was changed.
        forged = _record("prompt", "evil", address="tcp://10.6.6.6:1")
        client.set("baton:engine:prompt:evil", msgspec.json.encode(forged))
        other = _signed(redis_url, ClusterKeys.load(generate(tmp_path / "other")))
        other.publish(_record("prompt", "evil2", address="tcp://10.6.6.6:2"))
        genuine = msgspec.json.decode(client.get("baton:engine:prompt:p0"), type=EngineRecord)
        genuine.address = "tcp://10.6.6.6:3"
        client.set("baton:engine:prompt:p0", msgspec.json.encode(genuine))
        assert router.list("prompt") == []
        assert router.num_rejected == 3
        # A replayed old record (still carrying its valid signature) is refused too.
        engine.publish(_record("prompt", "p1"))
        raw = msgspec.json.decode(client.get("baton:engine:prompt:p1"), type=EngineRecord)
        assert [r.engine_id for r in router.list("prompt")] == ["p1"]
        raw.updated_at -= 3600
        client.set("baton:engine:prompt:p1", msgspec.json.encode(raw))
        assert all(r.engine_id != "p1" for r in router.list("prompt"))
        assert router.num_rejected == 4  # each distinct record once, however often read
    finally:
        client.close()
        engine.close()
        router.close()


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
