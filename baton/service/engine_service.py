"""The engine service loop shared by the NORMAL, PROMPT and COMPLETION roles.

One process, one thread of control:

1. Messages arrive on a ZMQ ROUTER socket bound to the configured host (127.0.0.1 by default):
   `GenerateRequest`, `AbortRequest`, `StatsRequest`, `ResetPrefixCache`, `SubscribeKvEvents`,
   `LoadLoraAdapter`, `UnloadLoraAdapter` (baton/protocol.py). Each is decoded with
   size and type checks; an undecodable message is dropped and counted, never trusted.
2. A `GenerateRequest` goes to the role's worker (`add_request`); the router's identity is kept
   per request so every later `TokenDelta` goes back to the socket that asked: whatever one
   step (or one message) produced for one router travels as one `EngineOutputs`.
3. While the worker has work, the loop alternates "drain the socket" and `worker.step()`; with
   no work it blocks in poll for a few milliseconds, so an idle engine costs no CPU.
4. SIGTERM/SIGINT: stop taking work (new requests finish at once with reason `abort` and an
   error), publish itself as draining at once (routers send it nothing new, as in a role
   change, so a pod scaled down on Kubernetes bounces nothing), let in-flight work finish for
   `drain_timeout_s`, abort what is left (the router migrates it), deregister from the
   registry, close the socket.
With `ServiceConfig.keys` the socket serves CURVE and its ZAP handler admits only the cluster's
client key (kv_transfer/auth.py): a peer without it never gets an answer, and each refused
handshake is counted (`baton_auth_refused_total{endpoint="engine"}`).
5. `ChangeRole` (docs/scheduler.md S41): with a `role_factory`, the engine stops taking new
   work (new requests finish at once with reason `abort`: the router retries them elsewhere)
   and publishes itself as draining (routers send it nothing new but do not fail over what it
   runs); once it holds no request, no pull, no lease and no block, the factory builds the
   new role's worker over the same runner (weights and KV pool), the old worker closes, the
   record moves to the new role. What still runs after `drain_timeout_s` is aborted (the
   router migrates it). A change asked while one runs is refused with the reason.
With `metrics` (baton/service/metrics.py) the loop also publishes a stats snapshot for Prometheus at
the registry-snapshot cadence, times and counts every request it tracks, and stops the HTTP
server last. Every step's `worker.step()` (the forward and its booking; sending its deltas
excluded) is timed with one monotonic() pair: the engine's busy seconds (`stats.extra["busy_s"]`,
`baton_engine_busy_seconds_total`), what `baton sim` calls an engine's busy time.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import zmq

from baton.engine.kv_events import KvEventPublisher
from baton.ops.dp import DPGroup
from baton.ops.ports import listener_range
from baton.ops.registry import EngineRecord, Heartbeat, Registry
from baton.protocol import (
    MAX_MESSAGE_BYTES,
    ROLES,
    AbortRequest,
    ChangeRole,
    ControlReply,
    EngineOutputs,
    EngineStats,
    GenerateRequest,
    KvEvents,
    LoadLoraAdapter,
    ProtocolError,
    ResetPrefixCache,
    StatsRequest,
    SubscribeKvEvents,
    TokenDelta,
    UnloadLoraAdapter,
    decode_to_engine,
    encode,
)
from baton.service.metrics import EngineMetrics
from kv_transfer.auth import ClusterKeys, RefusalCounter

logger = logging.getLogger(__name__)


class RoleWorker(Protocol):
    """What a role (NORMAL, PROMPT, COMPLETION) plugs into the service loop."""

    role: str

    def add_request(self, req: GenerateRequest) -> list[TokenDelta]: ...
    def abort_request(self, req_id: str) -> list[TokenDelta]: ...
    def step(self) -> list[TokenDelta]: ...
    def tick(self) -> list[TokenDelta]: ...  # every iteration: transfers, leases, admission
    def has_work(self) -> bool: ...  # steps to run now
    def has_pending(self) -> bool: ...  # waiting on others (KV pulls); the loop polls briefly
    def fill_stats(self, stats: EngineStats) -> None: ...
    def fill_record(self, record: EngineRecord) -> None: ...
    def reset_prefix_cache(self, pool_only: bool = False, shared: bool = False) -> bool: ...
    def load_lora(self, name: str, path: str) -> str: ...  # ValueError: refused, why
    def unload_lora(self, name: str) -> None: ...
    def close(self) -> None: ...


@dataclass
class ServiceConfig:
    engine_id: str
    host: str = "127.0.0.1"  # bind address of the request socket; never 0.0.0.0 by default
    advertise_host: str = ""  # the address others dial (registry); default: host
    port: int = 0  # 0 = an ephemeral port (printed at start-up)
    idle_poll_ms: int = 20  # how long an idle loop blocks in poll
    drain_timeout_s: float = 30.0  # SIGTERM: how long in-flight work may still run
    max_messages_per_step: int = 256  # bound on socket draining between two steps
    heartbeat_s: float = 1.0
    # CURVE keys of the request socket (kv_transfer/auth.py); None = plain TCP, which only
    # `--insecure` asks for (benchmarks).
    keys: ClusterKeys | None = None

    def __post_init__(self) -> None:
        if not self.engine_id:
            raise ValueError("engine_id must not be empty")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.host in ("0.0.0.0", "::", "*") and not self.advertise_host:
            raise ValueError(f"binding {self.host} needs an advertise host (--advertise-host): "
                             "other processes cannot dial a wildcard address")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")


@dataclass
class _Counters:
    num_bad_messages: int = 0
    num_requests: int = 0
    num_requests_finished: int = 0
    num_steps: int = 0
    busy_s: float = 0.0  # seconds in worker.step(): the forward and its booking
    # Seconds of the iterations that ran a step, from the poll's return to the iteration's end:
    # busy_s plus the service's own work around each step (the socket drained, the deltas
    # encoded and sent, KV events published, stats snapshots): (loop_s - busy_s) / num_steps
    # is what the service adds to a step (0.1-0.3 ms here: README, the metrics table).
    loop_s: float = 0.0
    started_at: float = field(default_factory=time.time)


# Builds the worker of another role over the old worker's engine runner (S41).
RoleFactory = Callable[[str, RoleWorker], RoleWorker]


@dataclass
class _RoleChange:
    role: str
    asked_at: float  # time.monotonic()
    aborted: bool = False  # the drain timed out and what ran was aborted


class EngineService:
    def __init__(self, worker: RoleWorker, config: ServiceConfig,
                 registry: Registry | None = None, ctx: zmq.Context | None = None,
                 dp: DPGroup | None = None, metrics: EngineMetrics | None = None,
                 role_factory: RoleFactory | None = None):
        self.worker = worker
        self.role_factory = role_factory
        self._change: _RoleChange | None = None
        self.metrics = metrics
        self.dp = dp if dp is not None and dp.size > 1 else None
        self.config = config
        self.registry = registry
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unroutable reply raises, not vanishes
        # ZMQ drops (and disconnects) a peer whose message exceeds this, before we see it.
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.refusals: RefusalCounter | None = None
        if config.keys is not None:
            config.keys.apply_server(self.sock, "engine")
            self.refusals = RefusalCounter(self.sock, "engine")
        if config.port:
            self.sock.bind(f"tcp://{config.host}:{config.port}")
        else:
            self.sock.bind_to_random_port(f"tcp://{config.host}", *listener_range())
        bound = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        port = bound.rsplit(":", 1)[1]
        self.address = f"tcp://{config.advertise_host or config.host}:{port}"
        self.req_to_identity: dict[str, bytes] = {}
        # n > 1: the choices of a request not finished yet (it ends with its last one).
        self.req_to_choices: dict[str, set[int]] = {}
        self.counters = _Counters()
        self._stop = threading.Event()  # set by signals or stop(): begin draining
        self._heartbeat: Heartbeat | None = None
        self.side_channel = ""
        # The heartbeat thread publishes this snapshot; only the loop thread touches the
        # worker (the scheduler is not thread-safe), refreshing it every `_snapshot_every_s`.
        self._snapshot: EngineRecord | None = None
        self._snapshot_at = 0.0
        self._snapshot_every_s = min(0.25, config.heartbeat_s / 2)
        # Cache-aware routing (baton/engine/kv_events.py): None for a worker without a prefix cache.
        source = getattr(worker, "kv_event_source", None)
        self.kv_events = KvEventPublisher(source()) if source is not None else None

    # --- lifecycle -------------------------------------------------------------------------
    def stop(self) -> None:
        self._stop.set()

    def run(self, on_ready: Callable[[EngineService], None] | None = None) -> None:
        if self.registry is not None:
            self._snapshot = self.record()
            self._heartbeat = Heartbeat(self.registry, lambda: self._snapshot,
                                        self.config.heartbeat_s).start()
        if self.metrics is not None:
            self.metrics.publish(self.stats())
        logger.info("%s engine %s listening on %s", self.worker.role, self.config.engine_id,
                    self.address)
        if on_ready:
            on_ready(self)
        try:
            while not self._stop.is_set():
                self._iterate()
            self._drain()
        finally:
            if self._heartbeat is not None:
                self._heartbeat.stop()
            self.worker.close()
            if self.refusals is not None:
                self.refusals.close()
            self.sock.close(0)
            if self.metrics is not None:
                self.metrics.close()
            logger.info("%s engine %s stopped", self.worker.role, self.config.engine_id)

    def _drain(self) -> None:
        deadline = time.monotonic() + self.config.drain_timeout_s
        self._snapshot, self._snapshot_at = self.record(), time.monotonic()  # draining
        if self.registry is not None and self._heartbeat is not None:
            try:
                self.registry.publish(self._snapshot)  # not a beat later: routers stop now
            except Exception as exc:  # the heartbeat publishes it again within a beat
                logger.warning("registry publish of the drain failed: %s", exc)
        logger.info("draining: %d requests in flight", len(self.req_to_identity))
        while self._busy() and time.monotonic() < deadline:
            self._iterate()
        for req_id in list(self.req_to_identity):
            self._send_all(self.worker.abort_request(req_id))
        while self._busy() and time.monotonic() < deadline + 5.0:
            self._iterate()  # let aborted sequences and pulls free their blocks

    def _busy(self) -> bool:
        return self.worker.has_work() or self.worker.has_pending()

    # --- one iteration ---------------------------------------------------------------------
    def _iterate(self) -> None:
        if self.worker.has_work():
            timeout = 0
        elif self.worker.has_pending():
            timeout = 1
        else:
            timeout = self.config.idle_poll_ms
        polled = self.sock.poll(timeout, zmq.POLLIN)
        iteration_started = time.monotonic()
        if polled:
            for _ in range(self.config.max_messages_per_step):
                try:
                    identity, payload = self._recv()
                except zmq.Again:
                    break
                if identity is not None:
                    self._handle(identity, payload)
        self._send_all(self.worker.tick())
        has_work = self.worker.has_work()
        if self.dp is not None:
            # Ranks step in lockstep: while any rank has work every rank steps (possibly an
            # empty prompt step), so the scheduler's votes meet the same collectives everywhere.
            has_work = self.dp.any(has_work)
        if has_work:
            self.counters.num_steps += 1
            started = time.monotonic()
            deltas = self.worker.step()
            self.counters.busy_s += time.monotonic() - started
            self._send_all(deltas)
        if self.kv_events is not None and self.kv_events.subscribers:
            self._publish_kv_events()
        if self._change is not None:
            self._continue_role_change()
        now = time.monotonic()
        if now - self._snapshot_at >= self._snapshot_every_s:
            if self.refusals is not None:
                self.refusals.drain()
            self._snapshot, self._snapshot_at = self.record(), now
            if self.metrics is not None:
                self.metrics.publish(self.stats())
        if has_work:
            self.counters.loop_s += time.monotonic() - iteration_started

    def _recv(self) -> tuple[bytes | None, bytes]:
        frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=True)
        if len(frames) != 2:
            self.counters.num_bad_messages += 1
            logger.warning("dropping a message of %d frames", len(frames))
            return None, b""
        return frames[0], frames[1]

    def _handle(self, identity: bytes, payload: bytes) -> None:
        try:
            msg = decode_to_engine(payload)
        except ProtocolError as exc:
            self.counters.num_bad_messages += 1
            logger.warning("dropping a bad message: %s", exc)
            return
        if isinstance(msg, GenerateRequest):
            self._on_generate(identity, msg)
        elif isinstance(msg, AbortRequest):
            # A handed-off prompt is no longer tracked here but may still hold a KV lease:
            # the worker decides; replies for untracked requests go to whoever aborted.
            self._send_all(self.worker.abort_request(msg.req_id), fallback=identity)
        elif isinstance(msg, StatsRequest):
            self._send(identity, self.stats(msg.nonce))
        elif isinstance(msg, ResetPrefixCache):
            try:
                ok = self.worker.reset_prefix_cache(msg.pool_only, msg.shared)
                why = "" if ok else "KV pulls into cached blocks are in flight; retry"
            except ValueError as exc:  # pool_only with shared
                ok, why = False, str(exc)
            self._send(identity, ControlReply(msg.nonce, ok, why))
        elif isinstance(msg, (LoadLoraAdapter, UnloadLoraAdapter)):
            self._send(identity, self._lora_control(msg))
        elif isinstance(msg, ChangeRole):
            ok, why = self._ask_role_change(msg.role)
            self._send(identity, ControlReply(msg.nonce, ok, why))
        elif isinstance(msg, SubscribeKvEvents):
            if self.kv_events is None:
                self._send(identity, ControlReply(msg.nonce, False, "no KV events here"))
            else:
                self._send_kv_events(identity, self.kv_events.subscribe(identity, msg.nonce))

    def _lora_control(self, msg: LoadLoraAdapter | UnloadLoraAdapter) -> ControlReply:
        """Load or unload an adapter (on the loop: the steps wait for the read), then publish
        the record at once, so routers list (or stop listing) it without waiting a beat."""
        try:
            if isinstance(msg, LoadLoraAdapter):
                adapter_id = self.worker.load_lora(msg.lora_name, msg.lora_path)
                why = f"loaded LoRA adapter {msg.lora_name!r} ({adapter_id})"
            else:
                self.worker.unload_lora(msg.lora_name)
                why = f"unloaded LoRA adapter {msg.lora_name!r}"
        except ValueError as exc:
            logger.warning("%s", exc)
            return ControlReply(msg.nonce, False, str(exc))
        logger.info("%s", why)
        self._snapshot, self._snapshot_at = self.record(), time.monotonic()
        if self.registry is not None:
            try:
                self.registry.publish(self._snapshot)
            except Exception as exc:  # the heartbeat publishes it again within a beat
                logger.warning("registry publish after %s failed: %s", why, exc)
        return ControlReply(msg.nonce, True, why)

    def _on_generate(self, identity: bytes, req: GenerateRequest) -> None:
        if self._stop.is_set() or self._change is not None:
            why = ("engine is shutting down" if self._stop.is_set() else
                   f"engine is changing its role to {self._change.role}")
            self._send(identity, EngineOutputs([TokenDelta(req.req_id, finish_reason="abort",
                                                           error=why)]))
            return
        if req.req_id in self.req_to_identity:
            self._send(identity, EngineOutputs([TokenDelta(
                req.req_id, finish_reason="error", error=f"duplicate request id {req.req_id!r}")]))
            return
        self.counters.num_requests += 1
        self.req_to_identity[req.req_id] = identity
        if req.sampling.n > 1:
            self.req_to_choices[req.req_id] = set(req.choice_indices or range(req.sampling.n))
        if self.metrics is not None:
            self.metrics.on_arrival(req.req_id)
        self._send_all(self.worker.add_request(req))

    # --- role changes (S41) -------------------------------------------------------------------
    def _ask_role_change(self, role: str) -> tuple[bool, str]:
        if role not in ROLES:
            return False, f"unknown role {role!r}: one of {', '.join(ROLES)}"
        if self._change is not None:
            return False, f"a change to {self._change.role} is in progress"
        if self._stop.is_set():
            return False, "engine is shutting down"
        if self.role_factory is None:
            return False, "this engine cannot change its role (data parallel ranks restart)"
        if role == self.worker.role:
            return True, f"already {role}"
        self._change = _RoleChange(role, time.monotonic())
        self._snapshot = self.record()  # draining, in the registry's next heartbeat
        logger.info("role change %s -> %s: draining %d requests", self.worker.role, role,
                    len(self.req_to_identity))
        return True, f"changing to {role}: draining {len(self.req_to_identity)} requests"

    def _is_empty(self) -> bool:
        if self._busy() or self.req_to_identity:
            return False
        stats = self.stats()
        return (stats.num_free_blocks == stats.num_total_blocks
                and not stats.extra.get("kv_leases_active", 0)
                and not stats.extra.get("kv_pulls_active", 0))

    def _continue_role_change(self) -> None:
        change = self._change
        if not change.aborted and time.monotonic() - change.asked_at > self.config.drain_timeout_s:
            change.aborted = True
            logger.warning("role change to %s: %d requests still running after %.0f s; aborting "
                           "them (the router migrates them)", change.role,
                           len(self.req_to_identity), self.config.drain_timeout_s)
            for req_id in list(self.req_to_identity):
                self._send_all(self.worker.abort_request(req_id))
        if not self._is_empty():
            return
        old = self.worker
        old.close()  # the KV agent deregisters the pool before another role registers it
        try:
            self.worker = self.role_factory(change.role, old)
        except Exception:  # the old role goes on: a failed change must not kill the engine
            logger.exception("role change to %s failed; staying %s", change.role, old.role)
            self.worker = self.role_factory(old.role, old)
        self.side_channel = getattr(self.worker, "side_channel", "")
        source = getattr(self.worker, "kv_event_source", None)
        # A new publisher: a new instance id, so routers drop their index of the old cache.
        self.kv_events = KvEventPublisher(source()) if source is not None else None
        self._change = None
        self._snapshot = self.record()  # the heartbeat publishes the new role from now on
        if self.registry is not None and old.role != self.worker.role:
            self.registry.remove(old.role, self.config.engine_id)
        logger.info("role change done: %s engine %s is now %s", old.role, self.config.engine_id,
                    self.worker.role)

    # --- replies ---------------------------------------------------------------------------
    def _send_all(self, deltas: list[TokenDelta], fallback: bytes | None = None) -> None:
        """One `EngineOutputs` per router connection. A delta of a request not (or no longer)
        tracked goes to `fallback`, or nowhere (it was already finished and forgotten)."""
        batches: dict[bytes, list[TokenDelta]] = {}
        for delta in deltas:
            identity = self.req_to_identity.get(delta.req_id)
            ends = identity is not None and self._ends_request(delta)
            if self.metrics is not None:  # of the requests it saw arrive; others pass
                self.metrics.on_delta(delta, ends)
            if identity is None:
                if fallback is None:
                    continue
                identity = fallback
            elif ends:
                del self.req_to_identity[delta.req_id]
                self.counters.num_requests_finished += 1
            batches.setdefault(identity, []).append(delta)
        for identity, batch in batches.items():
            self._send(identity, EngineOutputs(batch))

    def _ends_request(self, delta: TokenDelta) -> bool:
        """A KV handle ends a PROMPT request, a finish reason its choice; an error or abort
        reason, or the last choice's finish, the request."""
        if not (delta.finish_reason or delta.kv_handle):
            return False
        left = self.req_to_choices.get(delta.req_id)
        if left is not None and not delta.kv_handle and delta.finish_reason in ("stop", "length"):
            left.discard(delta.index)
            if left:
                return False
        self.req_to_choices.pop(delta.req_id, None)
        return True

    def _send(self, identity: bytes, msg: EngineOutputs | EngineStats | ControlReply) -> None:
        try:
            self.sock.send_multipart([identity, encode(msg)], zmq.NOBLOCK)
        except (zmq.Again, zmq.ZMQError) as exc:
            # The router is gone or its queue is full: its requests are lost to it anyway;
            # finishing them here keeps the pools whole.
            logger.warning("cannot reach router %r: %s", identity, exc)
            if isinstance(msg, EngineOutputs):
                self._abort_for_identity(identity)

    def _publish_kv_events(self) -> None:
        msg = self.kv_events.poll()
        if msg is not None:
            for identity in list(self.kv_events.subscribers):
                self._send_kv_events(identity, msg)

    def _send_kv_events(self, identity: bytes, msg: KvEvents) -> None:
        # Unlike a request's reply, a lost event costs only routing quality: a full queue skips
        # one (the router sees the seq gap and resubscribes), a vanished router is forgotten.
        try:
            self.sock.send_multipart([identity, encode(msg)], zmq.NOBLOCK)
        except zmq.Again:
            logger.debug("KV events to %r skipped: its queue is full", identity)
        except zmq.ZMQError as exc:
            logger.info("KV event subscriber %r is gone (%s)", identity, exc)
            self.kv_events.unsubscribe(identity)

    def _abort_for_identity(self, identity: bytes) -> None:
        for req_id, ident in list(self.req_to_identity.items()):
            if ident == identity:
                self.req_to_identity.pop(req_id, None)
                self.req_to_choices.pop(req_id, None)
                if self.metrics is not None:
                    self.metrics.forget(req_id)
                self.worker.abort_request(req_id)

    # --- introspection ---------------------------------------------------------------------
    def stats(self, nonce: int = 0) -> EngineStats:
        stats = EngineStats(
            engine_id=self.config.engine_id, role=self.worker.role, nonce=nonce,
            num_steps=self.counters.num_steps,
            num_requests_finished=self.counters.num_requests_finished,
            draining=self._stop.is_set() or self._change is not None,
        )
        self.worker.fill_stats(stats)
        stats.extra["num_bad_messages"] = float(self.counters.num_bad_messages)
        stats.extra["uptime_s"] = time.time() - self.counters.started_at
        stats.extra["busy_s"] = self.counters.busy_s
        stats.extra["loop_s"] = self.counters.loop_s
        if self.refusals is not None:
            stats.extra["auth_refused"] = float(self.refusals.num_refused)
        return stats

    def record(self) -> EngineRecord:
        record = EngineRecord(role=self.worker.role, engine_id=self.config.engine_id,
                              address=self.address, side_channel=self.side_channel,
                              draining=self._stop.is_set() or self._change is not None)
        self.worker.fill_record(record)
        if self.kv_events is not None:
            record.instance_id = self.kv_events.instance_id
        return record
