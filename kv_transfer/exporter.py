"""Prompt side: keeps finished prompts' KV blocks under leases and lets importers pull them.

Life of one request on the prompt engine:
1. prefill ends; the engine calls hold(request_id, block_ids, num_tokens) and gets a KVHandle
   for the router, with the blocks' checksums (config.checksum says which prompts carry them,
   kv_transfer/integrity.py); the lease runs for lease_ttl_s.
2. an importer handshakes once (agent metadata, pool shape, fingerprint), then sends a Claim
   for the request over the side channel with the handle's lease credential (wrong or reused:
   refused); the lease now waits for the reader (claim_ttl_s).
3. the importer READs the blocks; the Release notification that NIXL delivers after the read
   ends the lease and on_free(request_id, block_ids) gives the blocks back to the engine.
   The side channel is CURVE with a ZAP check when config.keys is set (kv_transfer/auth.py): a
   peer without the cluster's client key never gets an answer, and is counted (auth_refused).
4. a lease nobody claims in time, a claim with no release in time, or abort(request_id)
   ends it the same way (abort of a claimed lease waits for the reader to let go).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from kv_transfer import protocol as proto
from kv_transfer.agent import NixlAgent
from kv_transfer.auth import RefusalCounter
from kv_transfer.blocks import check_block_ids
from kv_transfer.config import PoolSpec, TransferConfig
from kv_transfer.errors import BadHandleError, FailReason
from kv_transfer.integrity import BlockReader, FaultPlan, checksum_for
from kv_transfer.leases import Lease, LeaseTable

logger = logging.getLogger(__name__)

OnFree = Callable[[str, list[int]], None]
# Poll period while no claimed lease needs NIXL progress: only expiries wait on it.
_IDLE_POLL_MS = 10


class KVExporter:
    """Side channel + lease table + NIXL agent of one prompt engine.

    on_free(request_id, block_ids) is called from the exporter's poller thread (or from the
    caller of abort()) each time a lease ends; it must be thread-safe and must not block.
    """

    def __init__(self, pool: Any, config: TransferConfig, fingerprint: proto.Fingerprint,
                 on_free: OnFree, engine_id: str = "prompt-0",
                 faults: FaultPlan | None = None) -> None:
        self.config = config
        self.spec = PoolSpec.of(pool)
        self._pool = pool  # keeps the registered memory alive
        self._reader = BlockReader(pool, self.spec)
        self.engine_id = engine_id
        if faults is not None and faults.foreign_weights:
            fingerprint = msgspec.structs.replace(fingerprint,
                                                  weights="foreign-" + fingerprint.weights)
        self.fingerprint = fingerprint
        self._num_holds = 0
        self.instance_id = uuid.uuid4().hex[:16]
        self._on_free = on_free
        self._table = LeaseTable(self.spec.num_blocks)
        self._lock = threading.Lock()
        self.agent = NixlAgent(f"{engine_id}-{self.instance_id}", self.spec, config.ucx_env)
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, config.max_msg_bytes)
        self._refusals: RefusalCounter | None = None
        if config.keys is not None:
            config.keys.apply_server(self._sock, "kv_side_channel")
            self._refusals = RefusalCounter(self._sock, "kv_side_channel")
        else:
            logger.warning("KV side channel of %s is NOT authenticated (no cluster keys)",
                           engine_id)
        port = config.side_channel_port or "*"
        self._sock.bind(f"tcp://{config.host}:{port}")
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._num_refused = 0  # written by the poller thread under the lock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-exporter-{engine_id}",
                                        daemon=True)
        self._thread.start()
        logger.info("KV exporter %s instance %s on %s: %d blocks x %d bytes, %s",
                    engine_id, self.instance_id, self.address, self.spec.num_blocks,
                    self.spec.block_bytes, fingerprint.describe())

    # ---- engine-facing API (any thread) ----

    def hold(self, request_id: str, block_ids: list[int], num_tokens: int,
             ttl_s: float | None = None, block_keys: list[int] = ()) -> proto.KVHandle:
        """Keep block_ids for request_id until claimed+released, expired or aborted.
        `block_keys` (the prompt's prefix-cache keys) travel in the handle."""
        ttl = self.config.lease_ttl_s if ttl_s is None else ttl_s
        if not ttl > 0:
            raise ValueError(f"ttl_s={ttl_s} must be > 0")
        with self._lock:
            lease = self._table.hold(request_id, list(block_ids), num_tokens,
                                     time.monotonic() + ttl)
            self._num_holds += 1
            ordinal = self._num_holds
        checksums = []
        if checksum_for(self.config.checksum, ordinal):
            # The blocks are the lease's now: nothing writes them until it ends, so their bytes
            # at this point are what every reader must get.
            start = time.perf_counter()
            checksums = self._reader.checksums(lease.block_ids)
            with self._lock:
                self._table.counters["checksummed_blocks"] += len(checksums)
                self._table.counters["checksum_seconds"] += time.perf_counter() - start
        return proto.KVHandle(self.engine_id, self.address, self.instance_id, request_id,
                              list(lease.block_ids), num_tokens, list(block_keys),
                              lease.credential, checksums)

    def abort(self, request_id: str) -> bool:
        """Drop the lease; True if its blocks were freed now (False: unknown or claimed,
        in which case they are freed when the reader releases or its claim expires)."""
        with self._lock:
            lease = self._table.abort(request_id)
        if lease is not None:
            self._free(lease)
        return lease is not None

    def num_leases(self) -> int:
        with self._lock:
            return len(self._table.leases)

    def metrics(self) -> dict[str, Any]:
        with self._lock:
            snap: dict[str, Any] = dict(self._table.counters)
            snap["leases_active"] = len(self._table.leases)
            snap["leases_claimed_active"] = sum(
                1 for x in self._table.leases.values() if x.claimed_by)
            if self._refusals is not None:
                snap["auth_refused"] = self._num_refused
        snap["instance_id"] = self.instance_id
        return snap

    def close(self) -> None:
        """Stop the poller, close the socket and the NIXL agent. Live leases are not freed:
        the engine owns its pool and is shutting down."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=5)
        if self._refusals is not None:
            self._refusals.close()
        self._sock.close(linger=0)
        self.agent.close()

    # ---- poller thread ----

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        fast_ms = max(1, int(self.config.poll_interval_s * 1000))
        while not self._stop.is_set():
            with self._lock:
                busy = self._table.has_claimed()
            events = dict(poller.poll(fast_ms if busy else _IDLE_POLL_MS))
            try:
                if self._sock in events:
                    self._drain_socket()
                self._handle_notifs()
                self._expire()
                if self._refusals is not None:
                    num_refused = self._refusals.drain()
                    with self._lock:
                        self._num_refused = num_refused
            except Exception:  # a bug must not kill the side channel silently
                logger.exception("KV exporter poller step failed")

    def _drain_socket(self) -> None:
        for _ in range(256):  # bounded so expiries and notifs still run under a flood
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                logger.warning("side channel: dropped a %d-frame message", len(frames))
                continue
            ident, data = frames
            self._sock.send_multipart([ident, proto.encode(self._answer(data))])

    def _answer(self, data: bytes) -> msgspec.Struct:
        try:
            msg = proto.decode_to_exporter(data)
        except msgspec.DecodeError as exc:
            return proto.ErrorReply(-1, f"undecodable message: {exc}")
        if isinstance(msg, proto.Handshake):
            with self._lock:
                self._table.counters["handshakes_served"] += 1
            return proto.HandshakeReply(
                msg.seq, self.engine_id, self.instance_id, self.agent.name, self.agent.metadata,
                self.spec.address, self.spec.num_blocks, self.spec.block_bytes, self.fingerprint,
                self.spec.mem_type, self.spec.device_id)
        return self._answer_claim(msg)

    def _answer_claim(self, msg: proto.Claim) -> proto.ClaimReply:
        if msg.instance_id != self.instance_id:
            reason, text = FailReason.PEER_RESTARTED, (
                f"handle names instance {msg.instance_id!r}, this is {self.instance_id!r}")
        else:
            try:
                ids = check_block_ids(msg.block_ids, self.spec.num_blocks, "claim")
            except BadHandleError as exc:
                reason, text = FailReason.BAD_HANDLE, str(exc)
            else:
                deadline = time.monotonic() + self.config.claim_ttl_s
                with self._lock:
                    reason, text = self._table.claim(msg.request_id, msg.agent_name, ids,
                                                     deadline, time.monotonic(),
                                                     msg.credential)
                    if reason is not None:
                        self._table.counters[f"claims_rejected_{reason.value}"] += 1
        if reason is None:
            return proto.ClaimReply(msg.seq, msg.request_id, True)
        logger.debug("claim of %s rejected: %s", msg.request_id, text)
        return proto.ClaimReply(msg.seq, msg.request_id, False, reason.value, text)

    def _handle_notifs(self) -> None:
        for peer, msgs in self.agent.notifs().items():
            for raw in msgs:
                try:
                    rel = proto.decode_release(raw)
                except msgspec.DecodeError:
                    logger.warning("dropped an undecodable notification from %s", peer)
                    continue
                if rel.instance_id != self.instance_id:
                    continue  # a note for a previous life of this engine
                with self._lock:
                    lease = self._table.release(rel.request_id, peer)
                if lease is not None:
                    self._free(lease)

    def _expire(self) -> None:
        with self._lock:
            ended = self._table.expire(time.monotonic())
        for lease in ended:
            logger.debug("lease of %s expired", lease.request_id)
            self._free(lease)

    def _free(self, lease: Lease) -> None:
        try:
            self._on_free(lease.request_id, list(lease.block_ids))
        except Exception:
            logger.exception("on_free(%s) raised", lease.request_id)
