"""The engines a request may go to: membership, load and selection, composed.

A request's engine, step by step (router/dispatch.py drives it):
  1. `wait_choose(role, keys)`: while no engine of the role is live, wait up to
     `engine_wait_timeout_s` for one (an engine being restarted is back within seconds, and a
     503 would fail a request that a short wait serves); NoEngineError after that;
  2. the candidates: the live engines of the role (router/membership.py) not excluded, less
     those that failed within `failure_cooldown_s` (router/load.py) unless nothing else is left;
  3. the policy (`--routing`, router/selection.py) picks one: cache-aware (default, the
     overlap-minus-load cost over the KV index) or least-loaded;
  4. `acquire` / `prefilled` / `add_blocks` / `release` / `mark_failed` keep the engine's
     load and health (router/load.py) while the request is there.
In a mixed fleet (NORMAL engines beside PROMPT and COMPLETION ones) `choose_path` first decides
each request's path (router/path.py): it shows the path policy the engine of each role the
request would get, and counts the choice in `baton_router_path_total{path,reason}`.
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
from baton.perf.profile import Profile
from baton.perf.profile import load as load_profile
from baton.protocol import COMPLETION, NORMAL, PROMPT, ROLES
from router.admission import Overloaded, SloAdmission
from router.config import RouterConfig
from router.engine_client import EngineClient
from router.kv_index import KvIndex, RequestKeys
from router.load import LegWork, LoadTracker
from router.membership import Membership
from router.metrics import RouterMetrics
from router.path import (
    COLOCATED,
    DISAGGREGATED,
    FALLBACK,
    ONLY_PATH,
    EngineView,
    PathChoice,
    PathPolicy,
    PathRequest,
    PredictedPath,
    build_path_policy,
)
from router.selection import (
    DEFAULT_BLOCK_SIZE,
    Candidate,
    LeastLoaded,
    OverlapMinusLoad,
    SelectionPolicy,
)

logger = logging.getLogger(__name__)

_WAIT_POLL_S = 0.05  # how often a waiting request looks again (registry, connections)
# An engine's published counts are a snapshot up to this old at its record's `updated_at`
# (baton/service: snapshots every 0.25 s), with margin.
_SNAPSHOT_LAG_S = 0.5
# A router that can serve nothing (its first engines still starting, or every one gone) reads
# the registry this often, not every refresh_s: the first engine serves as soon as it is up.
_IDLE_REFRESH_S = 0.2
PATH_ROLES = {COLOCATED: (NORMAL,), DISAGGREGATED: (PROMPT, COMPLETION)}


class NoEngineError(Exception):
    """No live engine of a role can take the request (HTTP 503)."""


def make_path_policy(config: RouterConfig, profile: Profile | None) -> PathPolicy:
    """The mixed fleet's path policy: the static threshold when one is given, else the
    profile's prediction (`profile`, config.profile_path loaded), else the default threshold
    (router/path.py)."""
    return build_path_policy(profile, config.pd_threshold_tokens, config.pd_handoff_ms)


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
        profile = load_profile(config.profile_path) if config.profile_path else None
        self.path_policy = make_path_policy(config, profile)
        # SLO-aware admission (router/admission.py): the profile's TTFT prediction, opt-in.
        self.admission = (SloAdmission(config.admission_ttft_ms, config.admission_factor)
                          if config.admission_ttft_ms else None)
        self._ttft_model = (PredictedPath(profile, config.pd_handoff_ms)
                            if self.admission is not None and profile is not None else None)
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
            await asyncio.sleep(self.config.refresh_s if self._can_serve()
                                else min(self.config.refresh_s, _IDLE_REFRESH_S))
            await self.refresh()

    def _can_serve(self) -> bool:
        try:
            self.check_path()
            return True
        except NoEngineError:
            return False

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

    def lora_adapters(self) -> dict[str, str]:
        """The LoRA adapters the live engines serve (their registry records): name -> id."""
        adapters: dict[str, str] = {}
        for record, _ in self.live_engines():
            for name, adapter_id in self.membership.lora_adapters(record).items():
                adapters.setdefault(name, adapter_id)
        return adapters

    def serves_lora(self, record: EngineRecord, name: str) -> bool:
        return name in self.membership.lora_adapters(record)

    async def refresh_lora_adapters(self) -> None:
        await self.membership.refresh_lora_adapters()

    def client(self, address: str) -> EngineClient:
        return self.membership.clients[address]

    def is_live(self, address: str) -> bool:
        return self.membership.is_live(address)

    def has_live(self, role: str) -> bool:
        return bool(self.membership.live(role))

    def paths(self) -> list[str]:
        """The paths the registered engines offer (co-located first); with nothing registered,
        co-located: a request waits for a normal engine as it always did."""
        paths = [COLOCATED] if self.membership.records.get(NORMAL) else []
        if self.membership.is_disaggregated:
            paths.append(DISAGGREGATED)
        return paths or [COLOCATED]

    def live_paths(self) -> list[str]:
        """The offered paths whose every role has a live engine taking new work (a draining
        one, in a role change, does not)."""
        return [p for p in self.paths()
                if all(any(not r.draining for r in self.membership.live(role))
                       for role in PATH_ROLES[p])]

    def check_path(self) -> None:
        """NoEngineError now unless some offered path has a live engine of each of its roles."""
        errors = []
        for path in self.paths():
            try:
                for role in PATH_ROLES[path]:
                    self.pick(role)
                return
            except NoEngineError as exc:
                errors.append(str(exc))
        raise NoEngineError("; ".join(errors))

    async def wait_path(self) -> None:
        """`check_path`, after waiting up to `engine_wait_timeout_s` for a live path."""
        paths = self.paths()
        if len(paths) == 1:  # a fleet of one kind: wait for each role as a request always did
            for role in PATH_ROLES[paths[0]]:
                await self.wait_pick(role)
            return
        deadline = time.monotonic() + self.config.engine_wait_timeout_s
        while not self.live_paths():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                try:
                    self.check_path()
                except NoEngineError as exc:
                    raise NoEngineError(f"no live path within "
                                        f"{self.config.engine_wait_timeout_s:g} s: {exc}") from None
                return
            await asyncio.sleep(min(_WAIT_POLL_S, remaining))

    def choose_path(self, request: RequestKeys, num_max_tokens: int,
                    exclude: set[str] = frozenset()) -> PathChoice:
        """The request's path (router/path.py), counted in the path metric. With one path
        live there is nothing to choose; the caller waits for its engines as before.
        `exclude`: paths the request already failed on (a live other one is its fallback)."""
        live = self.live_paths()
        untried = [p for p in live if p not in exclude]
        if exclude and untried:
            choice = PathChoice(untried[0], FALLBACK)
        elif len(live) != 2:
            choice = PathChoice(live[0] if live else self.paths()[0], ONLY_PATH)
        else:
            choice = self.path_policy.choose(
                PathRequest(len(request.token_ids), num_max_tokens), self._view(NORMAL, request),
                self._view(PROMPT, request), self._view(COMPLETION, request))
        self.metrics.path.labels(choice.path, choice.reason).inc()
        return choice

    def admit(self, path: str, request: RequestKeys, num_max_tokens: int) -> None:
        """SLO-aware admission of a fresh request on `path` (router/admission.py): raises
        `Overloaded` (429) when its predicted TTFT there is past what the SLO allows. Nothing
        without --admission-ttft-ms, or while the path's first role has no live engine (the
        wait for one, and its 503, decide then)."""
        if self.admission is None or self._ttft_model is None:
            return
        role = PATH_ROLES[path][0]
        if not self.has_live(role):
            return
        predicted = self._ttft_model.ttft_ms(
            PathRequest(len(request.token_ids), num_max_tokens), self._view(role, request), path)
        try:
            self.admission.check(predicted, path)
        except Overloaded:
            self.metrics.slo_rejections.labels(path).inc()
            raise

    def _view(self, role: str, request: RequestKeys) -> EngineView:
        """The engine of `role` the selection policy would give the request, as the path
        policy sees it: this router's work there (router/load.py), the registry's running
        count when another router's requests make it larger, the request's blocks it holds.

        The registry's count is a snapshot that may still hold this router's finished requests
        (a heartbeat late): it counts only when published well after this router's last change
        there, or an idle engine would look busy for a second after every request."""
        by_address, choice = self._select(role, request)
        record = by_address[choice.engine_id]
        work = self.load.work(record.address)
        decoding = self.load.num_requests(record.address) - work.num_prefilling
        is_fresh = record.updated_at - self.load.changed_at(record.address) > _SNAPSHOT_LAG_S
        block_size = ((self.kv_index.block_size(record.address) if self.kv_index else None)
                      or record.block_size or DEFAULT_BLOCK_SIZE)
        return EngineView(num_running=max(decoding, record.num_running if is_fresh else 0),
                          num_queued_prefills=work.num_prefilling,
                          num_queued_tokens=work.num_prefill_tokens,
                          num_context_tokens=work.num_context_tokens,
                          num_overlap_blocks=choice.num_overlap_blocks, block_size=block_size)

    def pick(self, role: str, exclude: set[str] = frozenset()) -> EngineRecord:
        """The least-loaded live engine of `role` not in `exclude`; NoEngineError if none."""
        by_address, candidates = self._candidates(role, exclude)
        return by_address[self._least_loaded.select(role, candidates, RequestKeys([])).engine_id]

    def choose(self, role: str, request: RequestKeys,
               exclude: set[str] = frozenset()) -> tuple[EngineRecord, int, int]:
        """The engine for a request: `(record, active_blocks, overlap_blocks)`, the blocks the
        request adds to the engine's load (`acquire`) and those it holds already."""
        by_address, choice = self._select(role, request, exclude)
        if not self.policy.is_cache_aware:
            self.metrics.routing_decisions.labels(role, "least_loaded").inc()
        else:
            overlap = choice.num_overlap_blocks
            self.metrics.routing_decisions.labels(role, "cached" if overlap else "uncached").inc()
            self.metrics.routing_credited_blocks.labels(role).inc(overlap)
        return (by_address[choice.engine_id], choice.num_active_blocks,
                choice.num_overlap_blocks)

    def _select(self, role: str, request: RequestKeys, exclude: set[str] = frozenset()):
        by_address, candidates = self._candidates(role, exclude, request.lora_name)
        return by_address, self.policy.select(role, candidates, request)

    def _candidates(self, role: str, exclude: set[str], lora_name: str = ""
                    ) -> tuple[dict[str, EngineRecord], list[Candidate]]:
        """The live engines of `role` not in `exclude` (serving LoRA adapter `lora_name`,
        when one is named), the recently failed ones left out while another is healthy, as
        the policy sees them; NoEngineError if none is live."""
        # A draining engine (a role change, S41) finishes what it runs but gets nothing new.
        live = [r for r in self.membership.live(role)
                if r.address not in exclude and not r.draining]
        if lora_name and live:
            live = [r for r in live if lora_name in self.membership.lora_adapters(r)]
            if not live:
                raise NoEngineError(f"no live {role} engine serves LoRA adapter {lora_name!r}")
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

    def acquire(self, address: str, num_blocks: int = 0, work: LegWork | None = None) -> None:
        self.load.acquire(address, num_blocks, work)

    def prefilled(self, address: str, work: LegWork) -> None:
        self.load.prefilled(address, work)

    def release(self, address: str, num_blocks: int = 0, work: LegWork | None = None) -> None:
        self.load.release(address, num_blocks, work)

    def add_blocks(self, address: str, num_blocks: int) -> None:
        """Move an engine's active blocks (cache-aware cost) by `num_blocks`."""
        self.load.add_blocks(address, num_blocks)

    def mark_failed(self, address: str) -> None:
        self.load.mark_failed(address)
