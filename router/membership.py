"""Which engines are live, per role: the registry's snapshot and a socket to each engine.

An engine's life as the router sees it:
  1. it registers (baton/ops/registry.py); the next `refresh` (every `refresh_s`, in a thread:
     the Redis client blocks) lists it, and the router opens its socket (router/engine_client.py)
     and, routing cache-aware, subscribes to its KV events (router/kv_index.py);
  2. it is live while the latest snapshot lists it and its socket is connected (or still
     within `connect_grace_s` of connecting);
  3. a restart shows as a new `instance_id`: its KV index entry is dropped (its cache is
     empty) and it is subscribed again;
  4. once gone from the registry for `_DEPARTED_CLOSE_S` with no request open, its socket is
     closed. A failed refresh keeps the last snapshot: a Redis hiccup must not drop engines.
"""

from __future__ import annotations

import asyncio
import logging
import time

import zmq.asyncio

from baton.ops.registry import EngineRecord, Registry, StaticRegistry
from baton.protocol import COMPLETION, PROMPT, ROLES
from kv_transfer.auth import ClusterKeys
from router.engine_client import EngineClient
from router.kv_index import KvIndex
from router.metrics import RouterMetrics

logger = logging.getLogger(__name__)

_DEPARTED_CLOSE_S = 60.0  # an engine absent from the registry this long loses its socket
_RESUBSCRIBE_S = 2.0  # a live engine still unindexed this long after a subscribe is asked again


class Membership:
    """The registry's latest snapshot per role and the router's socket to each engine."""

    def __init__(self, registry: Registry, connect_grace_s: float, metrics: RouterMetrics,
                 kv_index: KvIndex | None = None, keys: ClusterKeys | None = None):
        """`keys`: the cluster's client key pair every engine socket dials with (CURVE);
        None = plain TCP (--insecure)."""
        self.registry = registry
        self.keys = keys
        self.connect_grace_s = connect_grace_s
        self.metrics = metrics
        self.kv_index = kv_index
        self.records: dict[str, list[EngineRecord]] = {}  # role -> the latest snapshot's
        self.clients: dict[str, EngineClient] = {}  # address -> socket
        self._ctx: zmq.asyncio.Context | None = None
        self._last_seen: dict[str, float] = {}  # address -> when the registry last listed it
        self._old_instances: dict[str, set[str]] = {}  # address -> instance ids replaced
        self._num_rejected_counted = 0  # the registry's ignored records already in metrics
        # A static engine list's records say nothing of LoRA adapters: ask the engines.
        self.asks_lora = isinstance(registry, StaticRegistry)

    def open(self) -> None:
        self._ctx = zmq.asyncio.Context()

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients.values()))
        self.clients.clear()
        if self._ctx is not None:
            self._ctx.term()
        await asyncio.to_thread(self.registry.close)

    async def refresh(self) -> bool:
        """Read the registry, open sockets to new engines, close long-departed ones. False
        (and the last snapshot kept) when the registry could not be read."""
        try:
            records = await asyncio.to_thread(self._list_all)
        except Exception as exc:  # keep the last snapshot: a Redis hiccup must not drop engines
            logger.warning("registry refresh failed: %s", exc)
            return False
        self.records = records
        num_rejected = getattr(self.registry, "num_rejected", 0)
        if num_rejected > self._num_rejected_counted:
            self.metrics.registry_rejected.inc(num_rejected - self._num_rejected_counted)
            self._num_rejected_counted = num_rejected
        now = time.monotonic()
        for record in self.all_records():
            self._last_seen[record.address] = now
            if record.address not in self.clients:
                logger.info("engine %s (%s) at %s", record.engine_id, record.role, record.address)
                self.clients[record.address] = EngineClient(self._ctx, record.address,
                                                            self.kv_index, self.keys,
                                                            asks_lora=self.asks_lora)
        await self._close_departed(now)
        if self.kv_index is not None:
            await self._sync_kv_index(now)
            self.metrics.set_kv_index(
                [(r, self.kv_index.num_keys(r.address)) for r in self.all_records()],
                self.kv_index.num_resyncs)
        return True

    def _list_all(self) -> dict[str, list[EngineRecord]]:
        return {role: self.registry.list(role) for role in ROLES}

    async def _close_departed(self, now: float) -> None:
        # An engine gone from the registry for a while (a replaced pod) would otherwise keep a
        # socket reconnecting forever; one with requests still open waits for them.
        for address, client in list(self.clients.items()):
            if now - self._last_seen.get(address, now) > _DEPARTED_CLOSE_S and not client.num_open:
                logger.info("closing the socket of departed engine %s", address)
                del self.clients[address]
                self._last_seen.pop(address, None)
                await client.close()

    async def _sync_kv_index(self, now: float) -> None:
        """Forget engines that left the registry or restarted; (re)subscribe unindexed ones."""
        listed = {r.address: r for r in self.all_records()}
        for address in self.kv_index.addresses():
            if address not in listed:
                self.kv_index.drop(address)
        for address, record in listed.items():
            entry = self.kv_index.get(address)
            old = self._old_instances.setdefault(address, set())
            if (entry is not None and record.instance_id and record.instance_id not in old
                    and record.instance_id != entry.instance_id):
                # The registry names a newer process than our snapshot (the socket reconnected
                # without us noticing): its cache starts empty.
                logger.info("engine %s restarted (instance %s): dropping its KV index",
                            record.engine_id, record.instance_id)
                old.add(entry.instance_id)
                self.kv_index.drop(address)
                entry = None
            client = self.clients.get(address)
            if (entry is None and client is not None and client.is_connected
                    and now - client.kv_subscribed_at >= _RESUBSCRIBE_S):
                await client.subscribe_kv_events()

    def lora_adapters(self, record: EngineRecord) -> dict[str, str]:
        """The LoRA adapters engine `record` serves: name -> id (its record's, or with a
        static engine list what the engine said)."""
        if not self.asks_lora:
            return record.lora_adapters
        client = self.clients.get(record.address)
        return client.lora_adapters if client is not None else {}

    async def refresh_lora_adapters(self) -> None:
        """After a load or unload: the registry's records again, or each engine asked."""
        if not self.asks_lora:
            await self.refresh()
            return
        await asyncio.gather(*(c.refresh_lora_adapters() for c in self.clients.values()
                               if c.is_connected), return_exceptions=True)

    def all_records(self) -> list[EngineRecord]:
        """The latest snapshot's engines, every role."""
        return [r for rs in self.records.values() for r in rs]

    def role_records(self, role: str) -> list[EngineRecord]:
        return list(self.records.get(role, []))

    def live(self, role: str) -> list[EngineRecord]:
        """The live engines of `role`, in the registry's order."""
        return [r for r in self.records.get(role, []) if self.is_live(r.address)]

    def is_live(self, address: str) -> bool:
        """In the latest registry snapshot and connected (or still connecting)."""
        client = self.clients.get(address)
        if client is None or not client.is_usable(self.connect_grace_s):
            return False
        return any(r.address == address for r in self.all_records())

    @property
    def is_disaggregated(self) -> bool:
        return bool(self.records.get(PROMPT)) or bool(self.records.get(COMPLETION))
