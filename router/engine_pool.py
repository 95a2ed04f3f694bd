"""The engines a request may go to: membership, load and selection, composed.

A request's engine, step by step (router/dispatch.py drives it):
  1. `wait_choose(role, keys)`: while no engine of the role is live, wait up to
     `engine_wait_timeout_s` for one (an engine being restarted is back within seconds, and a
     503 would fail a request that a short wait serves); NoEngineError after that;
  2. the candidates: the live engines of the role (router/membership.py) not excluded, less
     those that failed within `failure_cooldown_s` (router/load.py) unless nothing else is left;
  3. the policy (`--routing`, router/selection.py) picks one: cache-aware (default, the
     overlap-minus-load cost over the KV index) or least-loaded;
  4. `acquire` / `add_blocks` / `release` / `mark_failed` keep the engine's load and health
     (router/load.py) while the request is there.
"""

from __future__ import annotations

import asyncio
import logging
import time

from baton.ops.registry import (
    EngineRecord,
    Registry,
    RegistryConfig,
    make_registry,
    record_signing_key,
)
from baton.protocol import ROLES
from router.config import RouterConfig
from router.engine_client import EngineClient
from router.kv_index import KvIndex, RequestKeys
from router.load import LoadTracker
from router.membership import Membership
from router.metrics import RouterMetrics
from router.selection import (
    DEFAULT_BLOCK_SIZE,
    Candidate,
    LeastLoaded,
    OverlapMinusLoad,
    SelectionPolicy,
)

logger = logging.getLogger(__name__)

_WAIT_POLL_S = 0.05  # how often a waiting request looks again (registry, connections)


class NoEngineError(Exception):
    """No live engine of a role can take the request (HTTP 503)."""


class EnginePool:
    def __init__(self, config: RouterConfig, metrics: RouterMetrics,
                 registry: Registry | None = None):
        self.config = config
        self.metrics = metrics
        registry = registry or make_registry(
            RegistryConfig(url=config.registry_url, prefix=config.registry_prefix,
                           password_file=config.registry_password_file,
                           signing_key=record_signing_key(config.cluster_keys)), config.engines)
        self.kv_index = KvIndex() if config.routing == "cache-aware" else None
        self.membership = Membership(registry, config.connect_grace_s, metrics, self.kv_index,
                                     config.cluster_keys)
        self.load = LoadTracker(config.failure_cooldown_s)
        self.policy: SelectionPolicy = (
            LeastLoaded() if self.kv_index is None
            else OverlapMinusLoad(self.kv_index, config.kv_overlap_weight))
        self._least_loaded = LeastLoaded()
        self._refresh_task: asyncio.Task | None = None

    async def start(self) -> None:
        self.membership.open()
        await self.refresh()
        self._refresh_task = asyncio.create_task(self._refresh_loop(), name="registry refresh")

    async def close(self) -> None:
        if self._refresh_task is not None:
            self._refresh_task.cancel()
            await asyncio.gather(self._refresh_task, return_exceptions=True)
        await self.membership.close()

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.refresh_s)
            await self.refresh()

    async def refresh(self) -> None:
        if await self.membership.refresh():
            self.metrics.set_engine_loads([(r, self.load.num_requests(r.address))
                                           for r in self.membership.all_records()])

    def records(self, role: str) -> list[EngineRecord]:
        return self.membership.role_records(role)

    def live_engines(self) -> list[tuple[EngineRecord, EngineClient]]:
        """Every live engine of every role, with its client."""
        return [(r, self.membership.clients[r.address]) for role in ROLES
                for r in self.membership.live(role)]

    def client(self, address: str) -> EngineClient:
        return self.membership.clients[address]

    def is_live(self, address: str) -> bool:
        return self.membership.is_live(address)

    @property
    def is_disaggregated(self) -> bool:
        return self.membership.is_disaggregated

    def has_live(self, role: str) -> bool:
        return bool(self.membership.live(role))

    def pick(self, role: str, exclude: set[str] = frozenset()) -> EngineRecord:
        """The least-loaded live engine of `role` not in `exclude`; NoEngineError if none."""
        by_address, candidates = self._candidates(role, exclude)
        return by_address[self._least_loaded.select(role, candidates, RequestKeys([])).engine_id]

    def choose(self, role: str, request: RequestKeys,
               exclude: set[str] = frozenset()) -> tuple[EngineRecord, int, int]:
        """The engine for a request: `(record, active_blocks, overlap_blocks)`, the blocks the
        request adds to the engine's load (`acquire`) and those it holds already."""
        by_address, candidates = self._candidates(role, exclude)
        choice = self.policy.select(role, candidates, request)
        if not self.policy.is_cache_aware:
            self.metrics.routing_decisions.labels(role, "least_loaded").inc()
        else:
            overlap = choice.num_overlap_blocks
            self.metrics.routing_decisions.labels(role, "cached" if overlap else "uncached").inc()
            self.metrics.routing_credited_blocks.labels(role).inc(overlap)
        return (by_address[choice.engine_id], choice.num_active_blocks,
                choice.num_overlap_blocks)

    def _candidates(self, role: str, exclude: set[str]
                    ) -> tuple[dict[str, EngineRecord], list[Candidate]]:
        """The live engines of `role` not in `exclude`, the recently failed ones left out
        while another is healthy, as the policy sees them; NoEngineError if none is live."""
        # A draining engine (a role change, S41) finishes what it runs but gets nothing new.
        live = [r for r in self.membership.live(role)
                if r.address not in exclude and not r.draining]
        if not live:
            known = len(self.membership.records.get(role, []))
            if not known:
                raise NoEngineError(f"no {role} engine is registered")
            raise NoEngineError(f"none of the {known} registered {role} engines is live "
                                f"({len(exclude)} already tried)")
        now = time.monotonic()
        healthy = [r for r in live if self.load.is_healthy(r.address, now)] or live
        candidates = [Candidate(r.address, self.load.load(r), self.load.num_blocks(r.address),
                                r.block_size or DEFAULT_BLOCK_SIZE) for r in healthy]
        by_address: dict[str, EngineRecord] = {}
        for record in healthy:
            by_address.setdefault(record.address, record)
        return by_address, candidates

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
        self.load.acquire(address, num_blocks)

    def release(self, address: str, num_blocks: int = 0) -> None:
        self.load.release(address, num_blocks)

    def add_blocks(self, address: str, num_blocks: int) -> None:
        """Move an engine's active blocks (cache-aware cost) by `num_blocks`."""
        self.load.add_blocks(address, num_blocks)

    def mark_failed(self, address: str) -> None:
        self.load.mark_failed(address)
