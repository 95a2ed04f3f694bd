"""Which engines are live, how loaded each is, and which one a request goes to.

The registry is read every `refresh_s` (in a thread: the Redis client blocks). An engine is a
candidate while it is in the latest registry snapshot, its connection has not dropped, and it
has not failed a request within `failure_cooldown_s` (unless nothing else is left). Among
candidates the router picks the least loaded: the registry's load (updated once per engine
heartbeat) plus the requests this router has sent it since, so a burst spreads out at once.
A request that finds no live engine of a role waits up to `engine_wait_timeout_s` for one to
appear (`wait_pick`): an engine being restarted is back within seconds, and a 503 would fail a
request that a short wait serves.
"""

from __future__ import annotations

import asyncio
import logging
import time

import zmq.asyncio

from baton.registry import EngineRecord, Registry, RegistryConfig, make_registry
from router.config import RouterConfig
from router.engine_client import EngineClient
from router.metrics import RouterMetrics

logger = logging.getLogger(__name__)

_DEPARTED_CLOSE_S = 60.0  # an engine absent from the registry this long loses its socket
_WAIT_POLL_S = 0.05  # how often a waiting request looks again (registry, connections)


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
                    self._clients[record.address] = EngineClient(self._ctx, record.address)
        await self._close_departed(now)
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

    def _list_all(self) -> dict[str, list[EngineRecord]]:
        return {role: self.registry.list(role) for role in ("normal", "prompt", "completion")}

    def records(self, role: str) -> list[EngineRecord]:
        return list(self._records.get(role, []))

    def live_engines(self) -> list[tuple[EngineRecord, EngineClient]]:
        """Every live engine of every role, with its client."""
        return [(r, self._clients[r.address]) for role in ("normal", "prompt", "completion")
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
        return min(healthy or live, key=lambda r: r.load + self._inflight.get(r.address, 0))

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

    def acquire(self, address: str) -> None:
        self._inflight[address] = self._inflight.get(address, 0) + 1

    def release(self, address: str) -> None:
        self._inflight[address] = max(0, self._inflight.get(address, 0) - 1)

    def mark_failed(self, address: str) -> None:
        self._failed_at[address] = time.monotonic()
