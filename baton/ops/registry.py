"""Where engines are: a Redis registry (several hosts) or a static list (one host).

Each engine publishes an `EngineRecord` under `{prefix}:engine:{role}:{engine_id}` with a TTL
and renews it from a heartbeat thread, so a dead engine disappears within one TTL without anyone
cleaning up. Readers list the live records of a role. Records are JSON so an operator can read
them with `redis-cli`.

Write access to Redis must not be enough to redirect traffic, so every record is signed: an
HMAC-SHA256 over its key name and its JSON (`signature` left out), with `record_signing_key`,
derived from the cluster's client secret (kv_transfer/auth.py), which every engine and the router
hold. A reader with the key ignores, logs and counts (`num_rejected`) a record that is unsigned,
does not verify, or is older than `max_record_age_s` (a replayed old record). Without cluster
keys (`--insecure`) records are neither signed nor checked.

Redis itself is closed too: the user is in the URL (`redis://baton@host:port/0`, or
`rediss://` for TLS) and the password in a file (`password_file`, default
$BATON_REDIS_PASSWORD_FILE), never on a command line.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from baton.protocol import ROLES
from kv_transfer.auth import ClusterKeys

logger = logging.getLogger(__name__)

ENV_PASSWORD_FILE = "BATON_REDIS_PASSWORD_FILE"
_MAX_PASSWORD_BYTES = 4096  # a password file is one line; anything longer is the wrong file


class EngineRecord(msgspec.Struct, omit_defaults=True):
    role: str
    engine_id: str
    address: str  # ZMQ address of the engine's request socket
    side_channel: str = ""  # kv_transfer side channel (PROMPT engines)
    model_fingerprint: str = ""
    block_size: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_running: int = 0
    num_waiting: int = 0
    updated_at: float = 0.0
    # Random per engine process start (baton/engine/kv_events.py): a new one means a restarted engine,
    # whose prefix cache is empty whatever a router remembers of the old one.
    instance_id: str = ""
    # Finishing what it runs before a role change (S41) or a shutdown: routers send it nothing
    # new, but its running requests are not failed over.
    draining: bool = False
    # Hex HMAC-SHA256 of the record (see the module docstring); "" = unsigned.
    signature: str = ""
    # The LoRA adapters it serves: name -> id (the digest that keys their KV blocks,
    # baton/engine/block_keys.py), so routers list them and key an adapter's prompt as it does.
    lora_adapters: dict[str, str] = {}

    @property
    def load(self) -> float:
        """Lower is better: queued work first, then KV pressure."""
        used = 1.0 - self.num_free_blocks / self.num_total_blocks if self.num_total_blocks else 0.0
        return self.num_waiting + self.num_running + used


@dataclass
class RegistryConfig:
    url: str = ""  # redis://host:port/db; empty = static registry
    prefix: str = "baton"  # key namespace, so several deployments can share one Redis
    ttl_s: float = 3.0  # a record not renewed within this is gone
    heartbeat_s: float = 1.0  # renew interval; must be well under ttl_s
    # File holding the Redis password (one line); "" = $BATON_REDIS_PASSWORD_FILE, or none.
    password_file: str = ""
    # HMAC key of the records (record_signing_key); b"" = unsigned records, none checked.
    signing_key: bytes = field(default=b"", repr=False)
    # A signed record older than this (its updated_at, clocks of two hosts) is a replay.
    max_record_age_s: float = 60.0

    def __post_init__(self) -> None:
        if not self.password_file:
            self.password_file = os.environ.get(ENV_PASSWORD_FILE, "")
        if self.max_record_age_s <= self.ttl_s:
            raise ValueError(f"max_record_age_s must be > ttl_s={self.ttl_s}, "
                             f"got {self.max_record_age_s}")
        if self.ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {self.ttl_s}")
        if not 0 < self.heartbeat_s < self.ttl_s:
            raise ValueError(f"heartbeat_s must be in (0, ttl_s={self.ttl_s}), got {self.heartbeat_s}")


def record_signing_key(keys: ClusterKeys | None) -> bytes:
    """The registry's HMAC key, derived from the cluster's client secret (b"" without keys:
    --insecure). ValueError when the key dir lacks client.key_secret."""
    if keys is None:
        return b""
    if not keys.can_dial:
        raise ValueError(f"no client.key_secret in {keys.key_dir!r}: it signs and checks the "
                         "registry's records")
    return hmac.new(keys.client_secret, b"baton registry record v1|" + keys.server_public
                    + b"|" + keys.client_public, hashlib.sha256).digest()


def read_private_file(path: str, what: str, max_bytes: int) -> bytes:
    """At most `max_bytes + 1` bytes of a secret file (one more shows it is too long);
    ValueError naming `what` and `path` when it is missing or readable by every user."""
    try:
        if os.stat(path).st_mode & 0o004:
            raise ValueError(f"{what} {path} is readable by every user; chmod 600 it")
        with open(path, "rb") as f:
            return f.read(max_bytes + 1)
    except OSError as exc:
        raise ValueError(f"cannot read {what} {path}: {exc}") from None


def read_password_file(path: str) -> str:
    """The password in `path` (its first line); ValueError naming a file that is missing,
    empty, too long or readable by every user."""
    raw = read_private_file(path, "Redis password file", _MAX_PASSWORD_BYTES)
    password = raw.decode(errors="replace").splitlines()[0].strip() if raw.strip() else ""
    if not password or len(raw) > _MAX_PASSWORD_BYTES:
        raise ValueError(f"Redis password file {path} must hold one line of at most "
                         f"{_MAX_PASSWORD_BYTES} bytes")
    return password


def connect(url: str, password_file: str = "", timeout_s: float = 2.0,
            retries: int | None = None):
    """A redis-py client for `url` (redis://, rediss://, unix://) with the password of
    `password_file` (default $BATON_REDIS_PASSWORD_FILE); each attempt at most `timeout_s`,
    `retries` more attempts after a failed one (None: redis-py's default, 3 with backoff)."""
    import redis

    password_file = password_file or os.environ.get(ENV_PASSWORD_FILE, "")
    extra = {"password": read_password_file(password_file)} if password_file else {}
    if retries is not None:
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        extra["retry"] = Retry(NoBackoff(), retries)
    return redis.Redis.from_url(url, socket_timeout=timeout_s,
                                socket_connect_timeout=timeout_s, **extra)


class RedisRegistry:
    def __init__(self, config: RegistryConfig):
        self.config = config
        self._redis = connect(config.url, config.password_file)
        self._enc = msgspec.json.Encoder()
        self._dec = msgspec.json.Decoder(EngineRecord)
        # Distinct records ignored (unsigned, not verifying, stale, undecodable): one sitting
        # in Redis is counted and logged once, not at every read.
        self.num_rejected = 0
        self._rejected_seen: set[bytes] = set()

    def _key(self, role: str, engine_id: str) -> str:
        return f"{self.config.prefix}:engine:{role}:{engine_id}"

    def _mac(self, record: EngineRecord) -> str:
        body = self._enc.encode(msgspec.structs.replace(record, signature=""))
        key_name = self._key(record.role, record.engine_id).encode()
        return hmac.new(self.config.signing_key, key_name + b"\n" + body,
                        hashlib.sha256).hexdigest()

    def publish(self, record: EngineRecord) -> None:
        if record.role not in ROLES:
            raise ValueError(f"unknown role {record.role!r}; expected one of {ROLES}")
        record.updated_at = time.time()
        record.signature = self._mac(record) if self.config.signing_key else ""
        ttl_ms = max(1, int(self.config.ttl_s * 1000))
        self._redis.set(self._key(record.role, record.engine_id), self._enc.encode(record), px=ttl_ms)

    def _why_rejected(self, key: bytes, record: EngineRecord, role: str) -> str:
        """"" for a record to use, else why it is ignored."""
        if record.role != role or key.decode(errors="replace") != self._key(role, record.engine_id):
            return "its key name does not match its role and engine id"
        if not self.config.signing_key:
            return ""
        if not record.signature:
            return "unsigned"
        if not hmac.compare_digest(record.signature, self._mac(record)):
            return "bad signature"
        if abs(time.time() - record.updated_at) > self.config.max_record_age_s:
            return f"updated_at {record.updated_at:.0f} is over {self.config.max_record_age_s}s away"
        return ""

    def _reject(self, key: bytes, raw: bytes, why: str) -> None:
        seen = hashlib.sha256(key + b"\n" + raw).digest()
        if seen in self._rejected_seen:
            return
        if len(self._rejected_seen) >= 10_000:  # bounded whatever is written into Redis
            self._rejected_seen.clear()
        self._rejected_seen.add(seen)
        self.num_rejected += 1
        if self.num_rejected <= 10 or self.num_rejected % 1000 == 0:  # no log flood
            logger.warning("ignoring registry record %r: %s (%d ignored so far)",
                           key.decode(errors="replace")[:200], why, self.num_rejected)

    def remove(self, role: str, engine_id: str) -> None:
        self._redis.delete(self._key(role, engine_id))

    # The planner's latest decision (planner/, `baton up --planner`), for the routers'
    # `/planner` and metrics: signed like a record, so a Redis writer cannot forge advice.
    def _plan_key(self) -> str:
        return f"{self.config.prefix}:planner"

    def _plan_mac(self, body: bytes) -> str:
        return hmac.new(self.config.signing_key, self._plan_key().encode() + b"\n" + body,
                        hashlib.sha256).hexdigest()

    def publish_plan(self, plan: dict, ttl_s: float) -> None:
        body = self._enc.encode({**plan, "updated_at": time.time()})
        signature = self._plan_mac(body) if self.config.signing_key else ""
        self._redis.set(self._plan_key(), self._enc.encode({"body": body.decode(),
                                                             "signature": signature}),
                        px=max(1, int(ttl_s * 1000)))

    def read_plan(self) -> dict | None:
        """The planner's latest decision, or None (no planner, expired, or not verifying)."""
        raw = self._redis.get(self._plan_key())
        if raw is None or len(raw) > 1 << 20:
            return None
        try:
            outer = msgspec.json.decode(raw, type=dict[str, str])
            body = outer["body"].encode()
            if self.config.signing_key and not hmac.compare_digest(
                    outer.get("signature", ""), self._plan_mac(body)):
                self._reject(self._plan_key().encode(), raw, "bad signature")
                return None
            plan = msgspec.json.decode(body, type=dict)
        except (msgspec.DecodeError, msgspec.ValidationError, KeyError):
            self._reject(self._plan_key().encode(), raw, "undecodable")
            return None
        return plan

    def list(self, role: str) -> list[EngineRecord]:
        keys = sorted(self._redis.scan_iter(match=self._key(role, "*"), count=100))
        records = []
        for key, raw in zip(keys, self._redis.mget(keys) if keys else [], strict=True):
            if raw is None:  # expired between SCAN and MGET
                continue
            try:
                record = self._dec.decode(raw)
            except msgspec.DecodeError:
                self._reject(key, raw, "undecodable")
                continue
            why = self._why_rejected(key, record, role)
            if why:
                self._reject(key, raw, why)
            else:
                records.append(record)
        return records

    def close(self) -> None:
        self._redis.close()


class StaticRegistry:
    """A fixed list of engines, for one host without Redis: `role=address[,side_channel]`."""

    def __init__(self, records: list[EngineRecord]):
        self._records = list(records)
        self.num_rejected = 0  # nothing is read from outside

    @classmethod
    def parse(cls, entries: list[str]) -> StaticRegistry:
        records = []
        for i, entry in enumerate(entries):
            role, sep, rest = entry.partition("=")
            if not sep or role not in ROLES or not rest:
                raise ValueError(f"bad engine entry {entry!r}: expected ROLE=ADDRESS, ROLE in {ROLES}")
            address, _, side = rest.partition(",")
            records.append(EngineRecord(role=role, engine_id=f"{role}-{i}", address=address,
                                        side_channel=side))
        return cls(records)

    def publish(self, record: EngineRecord) -> None:  # engines on one host need no registry
        pass

    def remove(self, role: str, engine_id: str) -> None:
        pass

    def list(self, role: str) -> list[EngineRecord]:
        return [r for r in self._records if r.role == role]

    def read_plan(self) -> dict | None:  # a static fleet has no planner
        return None

    def close(self) -> None:
        pass


Registry = RedisRegistry | StaticRegistry


class Heartbeat:
    """Re-publishes `make_record()` every `heartbeat_s` until stopped; removes it on stop."""

    def __init__(self, registry: Registry, make_record: Callable[[], EngineRecord],
                 heartbeat_s: float):
        self._registry = registry
        self._make_record = make_record
        self._interval = heartbeat_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="registry-heartbeat", daemon=True)
        self._last: EngineRecord | None = None

    def start(self) -> Heartbeat:
        self._beat()  # visible before start() returns
        self._thread.start()
        return self

    def _beat(self) -> None:
        self._last = self._make_record()
        self._registry.publish(self._last)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._beat()
            except Exception as exc:  # a Redis hiccup must not kill the engine
                logger.warning("registry heartbeat failed: %s", exc)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if self._last is not None:
            try:
                self._registry.remove(self._last.role, self._last.engine_id)
            except Exception as exc:
                logger.warning("registry deregistration failed: %s", exc)


def make_registry(config: RegistryConfig, static_entries: list[str] | None = None) -> Registry:
    if config.url:
        return RedisRegistry(config)
    return StaticRegistry.parse(static_entries or [])
