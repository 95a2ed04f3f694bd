"""Which engines are live, how loaded each is, and which one a request goes to.

The registry is read every `refresh_s` (in a thread: the Redis client blocks). An engine is a
candidate while it is in the latest registry snapshot, its connection has not dropped, and it
has not failed a request within `failure_cooldown_s` (unless nothing else is left). Among
candidates the router picks (`--routing`):

least-loaded  the registry's load (updated once per engine heartbeat) plus the requests this
              router has sent it since, so a burst spreads out at once.
cache-aware   (default) the lowest cost, NVIDIA Dynamo's KV router cost in blocks:
                  cost = overlap_weight * new_blocks + active_blocks
              new_blocks: the prompt's blocks the engine does not hold (from its KV events,
              router/kv_index.py): what a prompt or normal engine must prefill, what a
              completion engine must pull. active_blocks: the blocks of this router's requests
              in flight there (a prompt engine's until its first token, the others' until the
              end). Ties go to the least loaded as above. overlap_weight 1 (Dynamo's default)
              prices a cached block like one block of queued work.
A request that finds no live engine of a role waits up to `engine_wait_timeout_s` for one to
appear (`wait_pick`): an engine being restarted is back within seconds, and a 503 would fail a
request that a short wait serves.
"""

from __future__ import annotations

import asyncio
import logging
import time

import zmq.asyncio

from baton.ops.registry import EngineRecord, Registry, RegistryConfig, make_registry
from baton.protocol import ROLES
from router.config import RouterConfig
from router.engine_client import EngineClient
from router.kv_index import KvIndex, RequestKeys
from router.metrics import RouterMetrics

logger = logging.getLogger(__name__)

_DEPARTED_CLOSE_S = 60.0  # an engine absent from the registry this long loses its socket
_WAIT_POLL_S = 0.05  # how often a waiting request looks again (registry, connections)
_RESUBSCRIBE_S = 2.0  # a live engine still unindexed this long after a subscribe is asked again


class NoEngineError(Exception):
    """No live engine of a role can take the request (HTTP 503)."""


class EnginePool:
    def __init__(self, config: RouterConfig, metrics: RouterMetrics,
                 registry: Registry | None = None):
        self.config = config
        self.metrics = metrics
        self.registry = registry or make_registry(
            RegistryConfig(url=config.registry_url, prefix=config.registry_prefix), config.engines)
        self._ctx: zmq.asyncio.Context | None = None
        self._records: dict[str, list[EngineRecord]] = {}
        self._clients: dict[str, EngineClient] = {}
        self._inflight: dict[str, int] = {}
        self._failed_at: dict[str, float] = {}
        self._last_seen: dict[str, float] = {}  # address -> when the registry last listed it
        self._refresh_task: asyncio.Task | None = None
        self.last_refresh_error = ""
        self.kv_index = KvIndex() if config.routing == "cache-aware" else None
        self._inflight_blocks: dict[str, int] = {}  # address -> active blocks (cache-aware)
        self._old_instances: dict[str, set[str]] = {}  # address -> instance ids replaced

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        await self.refresh()
        self._refresh_task = asyncio.create_task(self._refresh_loop(), name="registry refresh")

    async def close(self) -> None:
        if self._refresh_task is not None:
            self._refresh_task.cancel()
            await asyncio.gather(self._refresh_task, return_exceptions=True)
        await asyncio.gather(*(c.close() for c in self._clients.values()))
        self._clients.clear()
        if self._ctx is not None:
            self._ctx.term()
        await asyncio.to_thread(self.registry.close)

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.refresh_s)
            await self.refresh()

    async def refresh(self) -> None:
        try:
            records = await asyncio.to_thread(self._list_all)
        except Exception as exc:  # keep the last snapshot: a Redis hiccup must not drop engines
            self.last_refresh_error = str(exc)
            logger.warning("registry refresh failed: %s", exc)
            return
        self.last_refresh_error = ""
        self._records = records
        now = time.monotonic()
        for role_records in records.values():
            for record in role_records:
                self._last_seen[record.address] = now
                if record.address not in self._clients:
                    logger.info("engine %s (%s) at %s", record.engine_id, record.role, record.address)
                    self._clients[record.address] = EngineClient(self._ctx, record.address,
                                                                 self.kv_index)
        await self._close_departed(now)
        if self.kv_index is not None:
            await self._sync_kv_index(records, now)
            self.metrics.set_kv_index(
                [(r, self.kv_index.num_keys(r.address)) for rs in records.values() for r in rs],
                self.kv_index.num_resyncs)
        self.metrics.set_engine_loads(
            [(r, self._inflight.get(r.address, 0)) for rs in records.values() for r in rs])

    async def _close_departed(self, now: float) -> None:
        # An engine gone from the registry for a while (a replaced pod) would otherwise keep a
        # socket reconnecting forever; one with requests still open waits for them.
        for address, client in list(self._clients.items()):
            if now - self._last_seen.get(address, now) > _DEPARTED_CLOSE_S and not client.num_open:
                logger.info("closing the socket of departed engine %s", address)
                del self._clients[address]
                self._last_seen.pop(address, None)
                await client.close()

    async def _sync_kv_index(self, records: dict[str, list[EngineRecord]], now: float) -> None:
        """Forget engines that left the registry or restarted; (re)subscribe unindexed ones."""
        listed = {r.address: r for rs in records.values() for r in rs}
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
            client = self._clients.get(address)
            if (entry is None and client is not None and client.is_connected
                    and now - client.kv_subscribed_at >= _RESUBSCRIBE_S):
                await client.subscribe_kv_events()

    def _list_all(self) -> dict[str, list[EngineRecord]]:
        return {role: self.registry.list(role) for role in ROLES}

    def records(self, role: str) -> list[EngineRecord]:
        return list(self._records.get(role, []))

    def live_engines(self) -> list[tuple[EngineRecord, EngineClient]]:
        """Every live engine of every role, with its client."""
        return [(r, self._clients[r.address]) for role in ROLES
                for r in self.records(role) if self.is_live(r.address)]

    def client(self, address: str) -> EngineClient:
        return self._clients[address]

    def is_live(self, address: str) -> bool:
        """In the latest registry snapshot and connected (or still connecting)."""
        client = self._clients.get(address)
        if client is None or not client.is_usable(self.config.connect_grace_s):
            return False
        return any(r.address == address for rs in self._records.values() for r in rs)

    @property
    def is_disaggregated(self) -> bool:
        return bool(self._records.get("prompt")) or bool(self._records.get("completion"))

    def pick(self, role: str, exclude: set[str] = frozenset()) -> EngineRecord:
        """The least-loaded live engine of `role` not in `exclude`; NoEngineError if none."""
        candidates = self._candidates(role, exclude)
        return min(candidates, key=self._load)

    def choose(self, role: str, request: RequestKeys,
               exclude: set[str] = frozenset()) -> tuple[EngineRecord, int, int]:
        """The engine for a request: `(record, active_blocks, overlap_blocks)`, the blocks the
        request adds to the engine's load (`acquire`) and those it holds already."""
        candidates = self._candidates(role, exclude)
        if self.kv_index is None:
            self.metrics.routing_decisions.labels(role, "least_loaded").inc()
            return min(candidates, key=self._load), 0, 0
        scored = []
        for record in candidates:
            entry = self.kv_index.get(record.address)
            block_size = entry.block_size if entry is not None else record.block_size or 16
            num_blocks = request.num_blocks(block_size)
            overlap = self.kv_index.overlap(record.address, request)
            cost = (self.config.kv_overlap_weight * (num_blocks - overlap)
                    + self._inflight_blocks.get(record.address, 0))
            scored.append((cost, self._load(record), record, num_blocks, overlap))
        cost, _, record, num_blocks, overlap = min(scored, key=lambda s: (s[0], s[1]))
        active = num_blocks - overlap if role == "prompt" else num_blocks
        self.metrics.routing_decisions.labels(role, "cached" if overlap else "uncached").inc()
        self.metrics.routing_credited_blocks.labels(role).inc(overlap)
        return record, active, overlap

    def _load(self, record: EngineRecord) -> float:
        return record.load + self._inflight.get(record.address, 0)

    def _candidates(self, role: str, exclude: set[str]) -> list[EngineRecord]:
        live = [r for r in self._records.get(role, [])
                if r.address not in exclude and self.is_live(r.address)]
        if not live:
            known = len(self._records.get(role, []))
            if not known:
                raise NoEngineError(f"no {role} engine is registered")
            raise NoEngineError(f"none of the {known} registered {role} engines is live "
                                f"({len(exclude)} already tried)")
        now = time.monotonic()
        healthy = [r for r in live
                   if now - self._failed_at.get(r.address, -1e9) >= self.config.failure_cooldown_s]
        return healthy or live

    def has_live(self, role: str) -> bool:
        return any(self.is_live(r.address) for r in self._records.get(role, []))

    async def wait_pick(self, role: str, exclude: set[str] = frozenset()) -> EngineRecord:
        """`pick`, after waiting up to `engine_wait_timeout_s` while no engine of `role` is live.

        Live engines that are all in `exclude` are no reason to wait (they stay up); the
        NoEngineError then is at once, as from `pick`."""
        deadline = time.monotonic() + self.config.engine_wait_timeout_s
        while not self.has_live(role):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                try:
                    return self.pick(role, exclude)
                except NoEngineError as exc:
                    raise NoEngineError(f"no live {role} engine within "
                                        f"{self.config.engine_wait_timeout_s:g} s: {exc}") from None
            await asyncio.sleep(min(_WAIT_POLL_S, remaining))
        return self.pick(role, exclude)

    async def wait_choose(self, role: str, request: RequestKeys,
                          exclude: set[str] = frozenset()) -> tuple[EngineRecord, int, int]:
        """`choose`, after the same wait as `wait_pick`."""
        await self.wait_pick(role, exclude)
        return self.choose(role, request, exclude)

    def acquire(self, address: str, num_blocks: int = 0) -> None:
        self._inflight[address] = self._inflight.get(address, 0) + 1
        self.add_blocks(address, num_blocks)

    def release(self, address: str, num_blocks: int = 0) -> None:
        self._inflight[address] = max(0, self._inflight.get(address, 0) - 1)
        self.add_blocks(address, -num_blocks)

    def add_blocks(self, address: str, num_blocks: int) -> None:
        """Move an engine's active blocks (cache-aware cost) by `num_blocks`."""
        if num_blocks:
            self._inflight_blocks[address] = max(0, self._inflight_blocks.get(address, 0)
                                                 + num_blocks)

    def mark_failed(self, address: str) -> None:
        self._failed_at[address] = time.monotonic()
