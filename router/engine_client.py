"""One DEALER socket per engine address, with one receive task that demultiplexes by req_id.

Every request the router sends to an engine opens a queue keyed by its req_id; the receive task
takes each `EngineOutputs` (one per engine step) apart and puts each TokenDelta into the queue of
its request. A socket monitor notices a dropped
connection at once, so requests on a killed engine fail in milliseconds instead of waiting for
their timeout.

With a `KvIndex` (cache-aware routing) the client subscribes to the engine's KV events on every
(re)connection and feeds them to the index; a dropped connection drops the engine's entries,
and a message the index refuses (a gap, a restart) makes it subscribe again.

Every socket dials CURVE with the cluster's client key pair (kv_transfer/auth.py, passed in by
the router's membership from its config) unless the router runs `--insecure`.
"""

from __future__ import annotations

import asyncio
import logging
import time

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from baton import protocol
from baton.protocol import (
    AbortRequest,
    ControlReply,
    EngineOutputs,
    EngineStats,
    GenerateRequest,
    KvEvents,
    LoadLoraAdapter,
    ResetPrefixCache,
    StatsRequest,
    SubscribeKvEvents,
    TokenDelta,
    UnloadLoraAdapter,
)
from kv_transfer.auth import ClusterKeys
from router.kv_index import KvIndex

logger = logging.getLogger(__name__)

# Error finish reason the router puts into a request's queue when its engine's connection drops.
DISCONNECTED = "engine_disconnected"

class EngineClient:
    """The router's side of one engine: send requests, receive their deltas."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, kv_index: KvIndex | None = None,
                 keys: ClusterKeys | None = None, asks_lora: bool = False):
        """`asks_lora`: learn the engine's LoRA adapters from its stats on every connection
        (a router without a registry, whose records cannot carry them)."""
        self.address = address
        self.asks_lora = asks_lora
        self.lora_adapters: dict[str, str] = {}  # what the engine last said it serves
        self.kv_index = kv_index
        self.kv_subscribed_at = -1e9  # monotonic time of the last SubscribeKvEvents sent
        self.is_connected = False  # set by the monitor; False until the first handshake
        self.created_at = time.monotonic()
        self.has_dropped = False  # the connection was up once and went down since
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)  # never drop a message: every wait has a timeout
        self._sock.setsockopt(zmq.RCVHWM, 0)
        # A larger frame would be refused by the decoder anyway: ZMQ drops the connection
        # instead of first buffering it (every request on it then fails at once).
        self._sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
        if keys is not None:
            keys.apply_client(self._sock)
        self._monitor = self._sock.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
        self._sock.connect(address)
        self._queues: dict[str, asyncio.Queue[TokenDelta]] = {}
        # Control requests (and stats asked) by nonce.
        self._replies: dict[int, asyncio.Future[ControlReply | EngineStats]] = {}
        self._next_nonce = 1
        self._tasks = [asyncio.create_task(self._recv_loop(), name=f"recv {address}"),
                       asyncio.create_task(self._monitor_loop(), name=f"monitor {address}")]

    def is_usable(self, connect_grace_s: float) -> bool:
        """Connected, or still within its first `connect_grace_s` (the handshake takes ms)."""
        if self.is_connected:
            return True
        return not self.has_dropped and time.monotonic() - self.created_at < connect_grace_s

    @property
    def num_open(self) -> int:
        return len(self._queues)

    def open(self, req_id: str) -> asyncio.Queue[TokenDelta]:
        assert req_id not in self._queues, f"request {req_id} already open on {self.address}"
        queue: asyncio.Queue[TokenDelta] = asyncio.Queue()
        self._queues[req_id] = queue
        return queue

    def close_request(self, req_id: str) -> None:
        self._queues.pop(req_id, None)

    async def send(self, request: GenerateRequest) -> None:
        """Send a request whose queue `open` made; its deltas land in that queue."""
        await self._sock.send(protocol.encode(request))

    async def abort(self, req_id: str) -> None:
        self.close_request(req_id)
        await self._sock.send(protocol.encode(AbortRequest(req_id=req_id)))

    async def reset_prefix_cache(self, timeout_s: float, pool_only: bool = False,
                                 shared: bool = False) -> ControlReply:
        """Ask the engine to forget its cached-free KV blocks (and its disk tier's, unless
        `pool_only`); TimeoutError past timeout_s."""
        return await self._control(lambda nonce: ResetPrefixCache(nonce, pool_only, shared),
                                   timeout_s)

    async def load_lora_adapter(self, name: str, path: str, timeout_s: float) -> ControlReply:
        """Ask the engine to load a LoRA adapter; TimeoutError past timeout_s."""
        return await self._control(lambda nonce: LoadLoraAdapter(name, path, nonce), timeout_s)

    async def unload_lora_adapter(self, name: str, timeout_s: float) -> ControlReply:
        return await self._control(lambda nonce: UnloadLoraAdapter(name, nonce), timeout_s)

    async def refresh_lora_adapters(self, timeout_s: float = 5.0) -> None:
        """Ask the engine which LoRA adapters it serves (its stats); TimeoutError past
        timeout_s, the last answer kept."""
        stats = await self._control(StatsRequest, timeout_s)
        self.lora_adapters = dict(stats.lora_adapters)

    async def _learn_lora_adapters(self) -> None:
        try:
            await self.refresh_lora_adapters()
        except TimeoutError:
            logger.warning("engine %s did not say which LoRA adapters it serves", self.address)

    async def _control(self, make, timeout_s: float):
        """Send `make(nonce)` and wait for the `ControlReply` of that nonce."""
        nonce, self._next_nonce = self._next_nonce, self._next_nonce + 1
        reply = self._replies[nonce] = asyncio.get_running_loop().create_future()
        try:
            await self._sock.send(protocol.encode(make(nonce)))
            async with asyncio.timeout(timeout_s):  # wait_for may drop a cancellation (3.11)
                return await reply
        finally:
            self._replies.pop(nonce, None)

    async def subscribe_kv_events(self) -> None:
        """Ask for a snapshot of the engine's block keys and the deltas after it."""
        self.kv_subscribed_at = time.monotonic()
        nonce, self._next_nonce = self._next_nonce, self._next_nonce + 1
        await self._sock.send(protocol.encode(SubscribeKvEvents(nonce)))

    async def _on_kv_events(self, msg: KvEvents) -> None:
        if self.kv_index is not None and not self.kv_index.apply(self.address, msg):
            await self.subscribe_kv_events()

    async def _recv_loop(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            try:
                msg = protocol.decode_to_router(frames[-1])
            except protocol.ProtocolError as exc:
                logger.warning("dropping a bad message from %s: %s", self.address, exc)
                continue
            if isinstance(msg, KvEvents):
                await self._on_kv_events(msg)
                continue
            if isinstance(msg, (ControlReply, EngineStats)):
                reply = self._replies.get(msg.nonce)
                if reply is not None and not reply.done():
                    reply.set_result(msg)
                continue
            if not isinstance(msg, EngineOutputs):  # the router asks no stats: none come
                continue
            for delta in msg.outputs:
                queue = self._queues.get(delta.req_id)
                if queue is not None:  # else: a late delta of a request already given up
                    queue.put_nowait(delta)

    async def _monitor_loop(self) -> None:
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())["event"]
            if event in (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL):
                # Keys of another cluster (or none, or CURVE on one side only): TCP connects,
                # the handshake never completes, and the engine stays unusable.
                logger.error("engine %s refused the handshake: check that it and this router "
                             "share the cluster keys (--cluster-key-dir / --insecure)",
                             self.address)
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:  # TCP up is not enough under CURVE
                self.is_connected = True
                if self.asks_lora:  # (the earlier connections' asks are done: drop them)
                    self._tasks = [t for t in self._tasks if not t.done()]
                    self._tasks.append(asyncio.create_task(self._learn_lora_adapters()))
                if self.kv_index is not None:
                    # A new connection is a new engine-side subscriber list: ask again.
                    await self.subscribe_kv_events()
            elif event == zmq.EVENT_DISCONNECTED:
                self.is_connected = False
                self.has_dropped = True
                if self.kv_index is not None:
                    self.kv_index.drop(self.address)  # a restarted engine's cache is empty
                logger.warning("engine %s disconnected; failing its %d open requests",
                               self.address, len(self._queues))
                self._fail_open_requests()

    def _fail_open_requests(self) -> None:
        for req_id, queue in list(self._queues.items()):
            queue.put_nowait(TokenDelta(req_id=req_id, finish_reason=DISCONNECTED,
                                        error=f"engine {self.address} disconnected"))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
