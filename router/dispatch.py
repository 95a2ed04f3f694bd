"""One request's trip through the engines, as a stream of TokenDeltas.

The request's state (its choices, attempts and legs) is one RouterRequest (router/request.py).
Disaggregated (prompt and completion engines registered):
  1. pick a live prompt engine (router/engine_pool.py, router/selection.py: cache-aware or
     least-loaded); send GenerateRequest without a handle;
  2. wait for its single delta (first token + kv_handle, or a finish reason); if it fails first
     (timeout, connection dropped, vanished from the registry, error delta), abort it there and
     retry, up to `prompt_retry_limit` times, on another live prompt engine, or on the same one
     once it is back from a restart (an engine that failed while staying up is not asked again);
  3. pick a completion engine the same way (cache-aware: the one that must pull the least);
     send GenerateRequest with the handle, the first token and its logprob; yield the first
     token; stream the completion engine's deltas.
Otherwise a NORMAL engine serves the whole request (same first-token retry). In a mixed fleet
(both kinds live) each attempt first takes its path from the pool (router/path.py), logged on
the request's line and counted in `baton_router_path_total{path,reason}`; a request whose path
failed before any token went out (its retries spent, or no live engine of the role left) takes
the other path in a new attempt (reason `fallback`; it counts as one of `migration_limit`'s).
With n > 1 (baton/engine/choices.py) the request is still one request per engine: the prompt engine
sends one first delta per choice (the KV handle on one of them), the completion engine gets the
handle once with the first token of every choice that goes on, and deltas carry their choice's
`index` until each choice has its finish reason (`RouterRequest.open_choices`).
Whenever no engine of the role a step needs is live, the step waits for one up to the pool's
`engine_wait_timeout_s` (a restart in progress) before NoEngineError, a 503 naming the role.

Migration: when an engine fails after tokens have gone out (error delta, dropped connection,
gone from the registry, token timeout), the request starts again from step 1 under a fresh
wire id (`REQ~mN`, so no late abort or lease of the failed attempt can touch it) with the
tokens streamed so far as `output_token_ids`: the prompt engine prefills prompt + them (mostly
a prefix-cache hit) and samples the next token as if nothing had happened, since a greedy or
seeded token depends only on the tokens and its position. The client sees one stream, no token
repeated or missing; after `migration_limit` migrations the next failure ends it with an error.
A request with n > 1 migrates choice by choice: each open choice goes on as a request of its
own (n = 1, wire id `REQ~cI`, sample_index base + I, its tokens so far), so a seeded choice
draws what it would have drawn (its draw depends on seed, sample_index and position only) and
a grammar, penalties and logprobs continue from its own tokens; the choices run concurrently
and their deltas are merged into the one stream under their own index. Each choice migrates
again on its own, within the same `migration_limit`.

Whoever stops reading early (client gone, stop string hit) closes the generator; its `finally`
sends AbortRequest to every engine that may still hold the request. The aborts run as their own
tasks, because the reader may be a cancelled task whose every further await would be cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

import msgspec

from baton.protocol import COMPLETION, NORMAL, PROMPT, GenerateRequest, SamplingOptions, TokenDelta
from router.engine_client import DISCONNECTED
from router.engine_pool import EnginePool, NoEngineError
from router.kv_index import RequestKeys
from router.load import LegWork
from router.path import DISAGGREGATED, ONLY_PATH
from router.request import Attempt, Leg, RouterRequest
from router.selection import DEFAULT_BLOCK_SIZE

logger = logging.getLogger(__name__)

OK_FINISH_REASONS = ("", "stop", "length")
_WATCH_SLICE_S = 0.25  # how often a waiting request checks its engine is still registered
_GONE = "engine_gone"  # synthetic finish reason: the engine left the registry mid-request
_ABORT_SEND_S = 1.0  # bound on queueing an AbortRequest before a retry on the same socket
# Failures another engine would repeat: the request itself was refused.
_NOT_MIGRATED = ("bad_request",)


class EngineFailure(Exception):
    """An engine failed the request (error delta, timeout, gone); `started` = tokens were sent.
    `role` and `reason` (the finish reason) say which engine failed how, when known."""

    def __init__(self, message: str, started: bool, role: str = "", reason: str = ""):
        super().__init__(message)
        self.started = started
        self.role = role
        self.reason = reason


def is_error(delta: TokenDelta) -> bool:
    return bool(delta.error) or delta.finish_reason not in OK_FINISH_REASONS


def _completion_request(req_id: str, prompt_token_ids: list[int], sampling: SamplingOptions,
                        handle: bytes, going: list[TokenDelta],
                        outputs: list[int], cache_salt: str = "",
                        lora_name: str = "") -> GenerateRequest:
    """What the completion engine gets: the KV handle and the first token of each choice that
    goes on (n > 1: their indices; it forks them after the one pull)."""
    request = GenerateRequest(
        req_id=req_id, prompt_token_ids=prompt_token_ids, sampling=sampling, kv_handle=handle,
        first_token_id=going[0].token_ids[0],
        first_logprob=going[0].logprobs[0] if going[0].logprobs else 0.0,
        output_token_ids=list(outputs), cache_salt=cache_salt, lora_name=lora_name)
    if sampling.n > 1:
        request.choice_indices = [d.index for d in going]
        request.first_token_ids = [d.token_ids[0] for d in going]
        request.first_logprobs = [d.logprobs[0] if d.logprobs else 0.0 for d in going]
    return request


class Dispatcher:
    def __init__(self, pool: EnginePool, metrics, first_token_timeout_s: float,
                 token_timeout_s: float, prompt_retry_limit: int = 2,
                 migration_limit: int = 3):
        self.pool = pool
        self.metrics = metrics
        self.first_token_timeout_s = first_token_timeout_s
        self.token_timeout_s = token_timeout_s
        self.prompt_retry_limit = prompt_retry_limit
        self.migration_limit = migration_limit
        self._abort_tasks: set[asyncio.Task] = set()

    def check_available(self) -> None:
        """Raise NoEngineError (HTTP 503) now unless some path has a live engine of each role."""
        self.pool.check_path()

    async def wait_available(self) -> None:
        """Wait (up to the pool's engine wait timeout) until some path has a live engine of
        each of its roles; NoEngineError naming the roles otherwise."""
        await self.pool.wait_path()

    async def generate(self, request: RouterRequest) -> AsyncIterator[TokenDelta]:
        """Deltas of one request until each choice has a finish reason, migrated to other
        engines when one fails mid-stream. Each delta's tokens are on its choice
        (`RouterChoice.token_ids`) before it is yielded.

        Raises NoEngineError or EngineFailure; `EngineFailure.started` tells whether tokens
        were already yielded.
        """
        await self.wait_available()
        while True:
            if request.is_split_by_choice:
                async for delta in self._migrate_choices(request):
                    yield delta
                return
            attempt = request.start_attempt()
            try:
                async with aclosing(self._attempt(request, attempt)) as deltas:
                    async for delta in deltas:
                        request.choices[delta.index].token_ids.extend(delta.token_ids)
                        yield delta
                return
            except (EngineFailure, NoEngineError) as exc:
                if self._untried_path(request) is not None:
                    logger.warning("request %s: %s; nothing sent yet: trying the %s path",
                                   request.req_id, exc, self._untried_path(request))
                    continue
                self._check_migration(request, exc)
                role = exc.role if isinstance(exc, EngineFailure) else ""
                reason = exc.reason if isinstance(exc, EngineFailure) else "no_engine"
                self.metrics.migrations.labels(role or "unknown", reason or "error").inc()
                logger.warning("request %s: %s; migrating with %s tokens generated (migration "
                               "%d of at most %d)", request.req_id, exc,
                               "+".join(str(len(request.choices[i].token_ids))
                                        for i in request.open_choices()),
                               request.num_migrations + 1, self.migration_limit)
                # n > 1: the choices go on each as a request of their own (_migrate_choices)
                request.is_split_by_choice = request.sampling.n > 1

    def _untried_path(self, request: RouterRequest) -> str | None:
        """A mixed fleet's live path no attempt of the request took yet, while nothing went
        out: an engine that fails a request before its first token (or a path left without a
        live engine) sends it down the other path instead of a 503."""
        if request.has_output:
            return None
        tried = {a.path.path for a in request.attempts if a.path is not None}
        return next((p for p in self.pool.live_paths() if p not in tried), None)

    def _check_migration(self, request: RouterRequest,
                         exc: EngineFailure | NoEngineError) -> None:
        """Re-raise `exc` as it is (nothing went out: the caller answers with a 503) or as a
        started EngineFailure, unless the request may migrate."""
        if not request.has_output:
            raise exc
        reason = exc.reason if isinstance(exc, EngineFailure) else "no_engine"
        if reason in _NOT_MIGRATED or request.num_migrations >= self.migration_limit:
            raise EngineFailure(f"{exc}; not migrated (migration {request.num_migrations} of "
                                f"at most {self.migration_limit})", started=True,
                                reason=reason) from None

    async def _migrate_choices(self, request: RouterRequest) -> AsyncIterator[TokenDelta]:
        """Every open choice of an n > 1 request continued as a request of its own (see the
        module's docstring), concurrently; their deltas merged under the choices' indices."""
        merged: asyncio.Queue[tuple[int, TokenDelta | BaseException | None]] = asyncio.Queue()

        async def run(index: int) -> None:
            sub = request.for_choice(index)
            try:
                async with aclosing(self.generate(sub)) as deltas:
                    async for delta in deltas:
                        await merged.put((index, delta))
                await merged.put((index, None))
            except (EngineFailure, NoEngineError) as exc:
                await merged.put((index, exc))

        tasks = {i: asyncio.get_running_loop().create_task(run(i))
                 for i in request.open_choices()}
        try:
            running = len(tasks)
            while running:
                index, item = await merged.get()
                if item is None:
                    running -= 1
                    continue
                if isinstance(item, BaseException):
                    reason = item.reason if isinstance(item, EngineFailure) else "no_engine"
                    raise EngineFailure(f"choice {index}: {item}", started=True,
                                        reason=reason)
                choice = request.choices[index]
                choice.token_ids.extend(item.token_ids)
                if item.finish_reason:
                    choice.is_engine_finished = True
                yield msgspec.structs.replace(item, index=index)
        finally:
            for task in tasks.values():
                task.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)

    async def _attempt(self, request: RouterRequest,
                       attempt: Attempt) -> AsyncIterator[TokenDelta]:
        """One pass through the engines from the attempt's tokens on (none: a fresh request;
        else a migration, whose first engine prefills prompt + those tokens)."""
        req_id, outputs, legs = attempt.wire_id, attempt.output_token_ids, attempt.legs
        prompt_token_ids, sampling = request.prompt_token_ids, request.sampling
        wire = GenerateRequest(req_id=req_id, prompt_token_ids=prompt_token_ids,
                               sampling=sampling, output_token_ids=list(outputs),
                               cache_salt=request.cache_salt, lora_name=request.lora_name)
        # The tokens whose KV this pass computes and moves: a migration's outputs too, keyed
        # as the engines key them (the adapter's seed, then the tenant's salt).
        keys = RequestKeys(prompt_token_ids + outputs, request.cache_salt, request.lora_name,
                           self.pool.lora_adapters().get(request.lora_name, ""))
        # A fallback (nothing sent yet) avoids the paths tried; a migration chooses afresh.
        tried = set() if attempt.is_migration else {a.path.path for a in request.attempts
                                                     if a.path is not None}
        attempt.path = self.pool.choose_path(keys, sampling.max_tokens, exclude=tried)
        # The request's line: its path and why (info only where there was a choice to make).
        logger.log(logging.DEBUG if attempt.path.reason == ONLY_PATH else logging.INFO,
                   "request %s: %d prompt tokens, path %s", req_id, len(keys.token_ids),
                   attempt.path.describe())
        if not attempt.is_migration and not tried:  # a fresh request: SLO-aware admission
            self.pool.admit(attempt.path.path, keys, sampling.max_tokens)
        try:
            disaggregated = attempt.path.path == DISAGGREGATED
            # With another path live and untried, a role without a live engine is no reason
            # to wait for one: the request takes the other path (generate).
            first_leg, first = await self._first_delta(
                PROMPT if disaggregated else NORMAL, wire, keys, legs,
                may_wait=self._untried_path(request) is None)
            if attempt.is_migration:
                self._observe_migrated_prefill(req_id, first, len(prompt_token_ids) + len(outputs))
            else:
                self.metrics.ttft.observe(time.monotonic() - request.arrival)
            if not disaggregated:
                async for delta in self._follow(first_leg, request, last=time.monotonic(),
                                                first=first):
                    yield delta
                return
            firsts = await self._first_choices(first_leg, first, sampling.n)
            for delta in firsts:
                request.choices[delta.index].is_engine_finished = bool(delta.finish_reason)
            if not request.open_choices():
                for delta in firsts:
                    yield delta
                return
            going = [d for d in firsts if not d.finish_reason]
            handle = next((d.kv_handle for d in firsts if d.kv_handle), b"")
            if not handle:
                raise EngineFailure(f"prompt engine {first_leg.record.engine_id} sent no "
                                    "KV handle", started=False, role=PROMPT)
            # The prompt engine's part of the work is done: its blocks wait for the pull only.
            self.pool.add_blocks(first_leg.record.address, -first_leg.num_blocks)
            first_leg.num_blocks = 0
            leg = await self._send(COMPLETION, _completion_request(
                req_id, prompt_token_ids, sampling, handle, going, outputs, request.cache_salt,
                request.lora_name),
                keys, legs)
            handed_at = time.monotonic()
            # The prompt engine's tokens, with whatever they carry (top and prompt logprobs),
            # less the handle, which is the completion engine's business.
            for delta in firsts:
                yield msgspec.structs.replace(delta, req_id=req_id, kv_handle=b"")
            async for delta in self._follow(leg, request, last=handed_at, kv_since=handed_at):
                first_leg.is_finished = True  # the completion engine has claimed the KV lease
                yield delta
        finally:
            self._end(req_id, legs)

    def _observe_migrated_prefill(self, req_id: str, first: TokenDelta, num_tokens: int) -> None:
        """A migration's re-prefill: how much of it the prefix cache spared."""
        self.metrics.migration_tokens.labels("prefilled").inc(num_tokens)
        self.metrics.migration_tokens.labels("cached").inc(first.num_cached_tokens)
        logger.info("request %s: re-prefilled %d tokens, %d of them from the prefix cache",
                    req_id, num_tokens, first.num_cached_tokens)

    async def _first_delta(self, role: str, request: GenerateRequest, keys: RequestKeys,
                           legs: list[Leg], may_wait: bool = True) -> tuple[Leg, TokenDelta]:
        failed_up: set[str] = set()  # engines that failed the request and are still up
        last_error = ""
        for attempt in range(1 + self.prompt_retry_limit):
            try:
                leg = await self._send(role, request, keys, legs, exclude=failed_up,
                                       may_wait=may_wait)
            except NoEngineError as exc:
                if not last_error:
                    raise
                raise EngineFailure(f"{last_error}; retry impossible: {exc}", started=False,
                                    role=role) from None
            if attempt:
                self.metrics.retries.labels(role).inc()
            delta = await self._wait(leg, self.first_token_timeout_s)
            if not is_error(delta):
                self.pool.prefilled(leg.record.address, leg.work)
                return leg, delta
            last_error = f"{role} engine {leg.record.engine_id} failed: {delta.error or delta.finish_reason}"
            logger.warning("request %s: %s (attempt %d)", request.req_id, last_error, attempt + 1)
            self.pool.mark_failed(leg.record.address)
            # A dead engine is not live again before its restart has reconnected: the next
            # _send waits for it then (or takes another); one still up failed for a reason.
            if delta.finish_reason not in (DISCONNECTED, _GONE):
                failed_up.add(leg.record.address)
            await self._abort_before_retry(request.req_id, leg)
        raise EngineFailure(last_error, started=False, role=role)

    async def _abort_before_retry(self, req_id: str, leg: Leg) -> None:
        """Abort `leg` now, not in a task: a retry on the same socket (the engine restarted
        behind the same address) must not overtake its own abort."""
        leg.is_finished = True
        leg.client.close_request(req_id)
        try:
            async with asyncio.timeout(_ABORT_SEND_S):  # not wait_for: see _wait
                await leg.client.abort(req_id)
        except (TimeoutError, OSError) as exc:
            logger.warning("request %s: abort to %s not sent: %s", req_id, leg.record.address, exc)

    async def _send(self, role: str, request: GenerateRequest, keys: RequestKeys,
                    legs: list[Leg], exclude: set[str] = frozenset(),
                    may_wait: bool = True) -> Leg:
        record, num_blocks, overlap = (await self.pool.wait_choose(role, keys, exclude)
                                       if may_wait else self.pool.choose(role, keys, exclude))
        client = self.pool.client(record.address)
        num_tokens = len(keys.token_ids)
        # What it prefills there: the tokens past its cached prefix (the last one always).
        num_prefill = 0 if role == COMPLETION else max(
            1, num_tokens - overlap * (record.block_size or DEFAULT_BLOCK_SIZE))
        work = LegWork(num_prefill, num_tokens)
        self.pool.acquire(record.address, num_blocks, work)
        leg = Leg(record, client, client.open(request.req_id), num_blocks=num_blocks, work=work)
        legs.append(leg)
        await client.send(request)
        return leg

    async def _first_choices(self, leg: Leg, first: TokenDelta, n: int) -> list[TokenDelta]:
        """A prompt engine's first delta of each of the n choices (one token each; the KV
        handle on one of them unless every choice finished); EngineFailure otherwise."""
        firsts = [first]
        while True:
            delta = firsts[-1]
            if is_error(delta):
                raise EngineFailure(f"prompt engine {leg.record.engine_id} failed: "
                                    f"{delta.error or delta.finish_reason}", started=False,
                                    role=PROMPT, reason=delta.finish_reason)
            if len(delta.token_ids) != 1 or not 0 <= delta.index < n or \
                    any(d.index == delta.index for d in firsts[:-1]):
                raise EngineFailure(f"prompt engine {leg.record.engine_id} sent "
                                    f"{len(delta.token_ids)} first tokens for choice "
                                    f"{delta.index} of {n}", started=False, role=PROMPT)
            if len(firsts) == n:
                return firsts
            firsts.append(await self._wait(leg, self.first_token_timeout_s))

    async def _follow(self, leg: Leg, request: RouterRequest, last: float,
                      kv_since: float | None = None,
                      first: TokenDelta | None = None) -> AsyncIterator[TokenDelta]:
        """Deltas of `leg` (from `first`, when given) until each of the request's open choices
        has a finish reason; an error delta raises EngineFailure."""
        role, engine_id = leg.record.role, leg.record.engine_id
        while True:
            timeout = self.first_token_timeout_s if kv_since is not None else self.token_timeout_s
            is_first = first is not None  # already awaited (and timed) by the caller
            delta, first = (first, None) if is_first else (await self._wait(leg, timeout), None)
            now = time.monotonic()
            if kv_since is not None:  # this gap is the KV pull, not an inter-token latency
                self.metrics.kv_transfer.observe(now - kv_since)
                kv_since, last = None, now
            if is_error(delta):
                self.pool.mark_failed(leg.record.address)
                raise EngineFailure(f"{role} engine {engine_id} failed: "
                                    f"{delta.error or delta.finish_reason}", started=True,
                                    role=role, reason=delta.finish_reason)
            if not request.is_open(delta.index):  # from a socket: not (or no more) running
                raise EngineFailure(f"{role} engine {engine_id} sent choice {delta.index}, "
                                    f"not one of {request.open_choices()}", started=True,
                                    role=role)
            if delta.token_ids and not is_first:
                per_token = (now - last) / len(delta.token_ids)
                for _ in delta.token_ids:
                    self.metrics.itl.observe(per_token)
                last = now
            if delta.finish_reason:
                request.choices[delta.index].is_engine_finished = True
                leg.is_finished = not request.open_choices()
            yield delta
            if not request.open_choices():
                return

    async def _wait(self, leg: Leg, timeout_s: float) -> TokenDelta:
        """The leg's next delta, or a synthetic error delta on timeout or a vanished engine."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return TokenDelta(req_id="", finish_reason="timeout",
                                  error=f"no answer within {timeout_s:g}s")
            try:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for returns the item and
                # drops a cancellation that lands as the item arrives (cpython #86296), so a
                # client who left just as a token came kept its request running to the end.
                async with asyncio.timeout(min(remaining, _WATCH_SLICE_S)):
                    return await leg.queue.get()
            except TimeoutError:
                if not self.pool.is_live(leg.record.address):
                    return TokenDelta(req_id="", finish_reason=_GONE,
                                      error="engine left the registry or disconnected")

    def _abort_leg(self, req_id: str, leg: Leg) -> None:
        leg.is_finished = True
        leg.client.close_request(req_id)
        task = asyncio.get_running_loop().create_task(leg.client.abort(req_id))
        self._abort_tasks.add(task)
        task.add_done_callback(self._abort_tasks.discard)

    def _end(self, req_id: str, legs: list[Leg]) -> None:
        for leg in legs:
            self.pool.release(leg.record.address, leg.num_blocks, leg.work)
            if not leg.is_finished:
                self._abort_leg(req_id, leg)
            leg.client.close_request(req_id)

    async def drain_aborts(self) -> None:
        """Let pending AbortRequests leave before the sockets close."""
        if self._abort_tasks:
            await asyncio.wait(self._abort_tasks, timeout=1.0)
