"""Where engines are: a Redis registry (several hosts) or a static list (one host).

Each engine publishes an `EngineRecord` under `{prefix}:engine:{role}:{engine_id}` with a TTL
and renews it from a heartbeat thread, so a dead engine disappears within one TTL without anyone
cleaning up. Readers list the live records of a role. Records are JSON so an operator can read
them with `redis-cli`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from baton.protocol import ROLES

logger = logging.getLogger(__name__)



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

    def __post_init__(self) -> None:
        if self.ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {self.ttl_s}")
        if not 0 < self.heartbeat_s < self.ttl_s:
            raise ValueError(f"heartbeat_s must be in (0, ttl_s={self.ttl_s}), got {self.heartbeat_s}")


class RedisRegistry:
    def __init__(self, config: RegistryConfig):
        import redis

        self.config = config
        self._redis = redis.Redis.from_url(config.url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self._enc = msgspec.json.Encoder()
        self._dec = msgspec.json.Decoder(EngineRecord)

    def _key(self, role: str, engine_id: str) -> str:
        return f"{self.config.prefix}:engine:{role}:{engine_id}"

    def publish(self, record: EngineRecord) -> None:
        if record.role not in ROLES:
            raise ValueError(f"unknown role {record.role!r}; expected one of {ROLES}")
        record.updated_at = time.time()
        ttl_ms = max(1, int(self.config.ttl_s * 1000))
        self._redis.set(self._key(record.role, record.engine_id), self._enc.encode(record), px=ttl_ms)

    def remove(self, role: str, engine_id: str) -> None:
        self._redis.delete(self._key(role, engine_id))

    def list(self, role: str) -> list[EngineRecord]:
        keys = sorted(self._redis.scan_iter(match=self._key(role, "*"), count=100))
        records = []
        for raw in self._redis.mget(keys) if keys else []:
            if raw is None:  # expired between SCAN and MGET
                continue
            try:
                records.append(self._dec.decode(raw))
            except msgspec.DecodeError:
                logger.warning("ignoring an undecodable registry record")
        return records

    def close(self) -> None:
        self._redis.close()


class StaticRegistry:
    """A fixed list of engines, for one host without Redis: `role=address[,side_channel]`."""

    def __init__(self, records: list[EngineRecord]):
        self._records = list(records)

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
