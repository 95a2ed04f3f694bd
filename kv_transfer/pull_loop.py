"""The importer's poller thread: the only thread that touches its NIXL agent and sockets.

Each turn: take new pulls and aborts, wait up to a poll period for side-channel replies,
advance every pull (route -> handshake -> claim -> post -> check), enforce every deadline,
drive UCX progress. See importer.py for the life of one pull. The loop talks to the engine's
threads only through its PullTable (pulls.py): it takes the inbox and writes states and results.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

import msgspec
import zmq

from kv_transfer import protocol as proto
from kv_transfer.agent import NixlAgent
from kv_transfer.blocks import check_block_ids
from kv_transfer.config import PoolSpec, TransferConfig
from kv_transfer.errors import (
    BadHandleError,
    FailReason,
    KVTransferError,
    PeerGoneError,
    TransferState,
)
from kv_transfer.integrity import BlockReader, FaultPlan
from kv_transfer.peers import Peer, check_address, check_handshake
from kv_transfer.pulls import Pull, PullTable, TransferResult

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 100


class PullLoop:
    """The poller of one importer: owns its side-channel sockets and drives its NIXL agent.

    `reader` reads the local pool (its spec and `fingerprint` are checked against every peer's
    handshake, its blocks against the handles' checksums); `table` is where pulls come in and
    results go out; `faults` are a test's (integrity.FaultPlan); run() returns after stop().
    """

    def __init__(self, agent: NixlAgent, config: TransferConfig, reader: BlockReader,
                 fingerprint: proto.Fingerprint, table: PullTable, ctx: zmq.Context,
                 faults: FaultPlan) -> None:
        self.cfg = config
        self.agent = agent
        self.reader = reader
        self.spec: PoolSpec = reader.spec
        self.faults = faults
        self.num_landed = 0  # pulls whose bytes landed, the faults' ordinal
        self.fingerprint = fingerprint
        self.table = table
        self.ctx = ctx
        self._stop = threading.Event()
        self.pulls: dict[str, Pull] = {}
        self.peers: dict[str, Peer] = {}  # by side-channel address
        self.claims: dict[int, Pull] = {}  # by claim seq
        self.in_flight = collections.Counter[str]()  # posted xfers per NIXL peer name
        self.retired: set[str] = set()  # peer names to remove once no xfer names them
        self.seq = 0
        self.poller = zmq.Poller()
        self.poller.register(table.wake_fd, zmq.POLLIN)

    @property
    def is_stopping(self) -> bool:
        return self._stop.is_set()

    def stop(self) -> None:
        """Ask run() to return; pending pulls then fail with 'closed'."""
        self._stop.set()
        self.table.wake()

    def run(self) -> None:
        fast_ms = max(1, int(self.cfg.poll_interval_s * 1000))
        try:
            while not self._stop.is_set():
                self._take_inbox()
                events = dict(self.poller.poll(fast_ms if self.pulls else _IDLE_POLL_MS))
                if self.table.wake_fd in events:
                    self.table.clear_wake()
                for peer in list(self.peers.values()):
                    if peer.sock in events:
                        self._drain(peer)
                self._advance(time.monotonic())
        except Exception:
            logger.exception("KV importer poller crashed; failing every pull")
        finally:
            self._shutdown()

    # ---- intake ----

    def _take_inbox(self) -> None:
        for kind, item in self.table.take_inbox():
            if kind == "pull":
                self._accept(item)
            else:
                self._abort(item)

    def _accept(self, pull: Pull) -> None:
        h = pull.handle
        try:
            check_address(h.side_channel)
            if not 0 <= pull.first_block < len(h.block_ids) or \
                    len(h.block_ids) - pull.first_block != len(pull.local_ids):
                raise BadHandleError(f"handle has {len(h.block_ids)} blocks, "
                                     f"{len(pull.local_ids)} local blocks given from block "
                                     f"{pull.first_block}")
            if not h.instance_id or len(h.instance_id) > 64:
                raise BadHandleError(f"bad instance id {h.instance_id!r:.80}")
            if h.checksums and len(h.checksums) != len(h.block_ids):
                raise BadHandleError(f"handle has {len(h.checksums)} checksums for "
                                     f"{len(h.block_ids)} blocks")
        except (ValueError, BadHandleError) as exc:
            self.pulls[h.request_id] = pull
            self._finish(pull, FailReason.BAD_HANDLE, str(exc))
            return
        self.pulls[h.request_id] = pull

    def _abort(self, request_id: str) -> None:
        pull = self.pulls.get(request_id)
        if pull is None or pull.is_aborted:
            return
        pull.is_aborted = True
        if pull.state == TransferState.TRANSFERRING:
            self._cancel(pull, FailReason.ABORTED, "aborted during transfer")
        elif pull.seq < 0:  # no claim in flight: nothing on the peer to undo
            self._finish(pull, FailReason.ABORTED, "aborted before claim")
        # else: the claim reply decides (a granted claim is released at once)

    # ---- replies ----

    def _drain(self, peer: Peer) -> None:
        while self.peers.get(peer.address) is peer:
            try:
                data = peer.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = proto.decode_to_importer(data)
            except msgspec.DecodeError as exc:
                logger.warning("undecodable side-channel reply from %s: %s", peer.address, exc)
                continue
            if isinstance(msg, proto.HandshakeReply):
                if msg.seq == peer.hs_seq:
                    self._on_handshake(peer, msg)
            elif isinstance(msg, proto.ClaimReply):
                pull = self.claims.pop(msg.seq, None)
                if pull is not None and pull.handle.request_id == msg.request_id:
                    self._on_claim(pull, msg)
            elif msg.seq == peer.hs_seq:
                self._peer_failed(peer, FailReason.TRANSFER_ERROR, f"peer error: {msg.message}")
            elif (pull := self.claims.pop(msg.seq, None)) is not None:
                self._finish(pull, FailReason.TRANSFER_ERROR, f"peer error: {msg.message}")

    def _on_handshake(self, peer: Peer, msg: proto.HandshakeReply) -> None:
        peer.hs_seq = -1
        try:
            remote, mismatch = check_handshake(msg, self.spec, self.fingerprint)
            if not mismatch and msg.agent_name != peer.agent_name:
                name = self.agent.add_peer(msg.agent_metadata)
                if name != msg.agent_name:
                    raise ValueError(f"metadata names agent {name!r}, reply {msg.agent_name!r}")
                self._retire(peer.agent_name)
        except (ValueError, KVTransferError) as exc:
            self._peer_failed(peer, FailReason.BAD_HANDLE, f"bad handshake from "
                              f"{peer.address}: {exc}")
            return
        peer.instance_id, peer.spec, peer.fingerprint = msg.instance_id, remote, msg.fingerprint
        peer.mismatch = mismatch
        peer.hs_time = time.monotonic()
        if not mismatch:
            peer.agent_name = msg.agent_name
        self.table.count("handshakes")
        logger.debug("handshake with %s: instance %s", peer.address, peer.instance_id)

    def _on_claim(self, pull: Pull, msg: proto.ClaimReply) -> None:
        pull.seq = -1
        if not msg.ok:
            reasons = {r.value: r for r in FailReason}
            reason = reasons.get(msg.reason, FailReason.TRANSFER_ERROR)
            self._finish(pull, reason, msg.message or f"claim refused: {msg.reason}")
            return
        pull.is_claimed = True
        if pull.is_aborted:
            self._release_note(pull)
            self._finish(pull, FailReason.ABORTED, "aborted during claim")
            return
        self._post(pull)

    # ---- advancing ----

    def _advance(self, now: float) -> None:
        for pull in list(self.pulls.values()):
            if pull.state == TransferState.TRANSFERRING:
                self._check(pull, now)
            elif pull.seq >= 0:
                if now > pull.deadline and pull.peer is not None:
                    self._peer_failed(pull.peer, FailReason.PEER_GONE,
                                      f"no claim answer from {pull.peer.address} within "
                                      f"{self.cfg.rpc_timeout_s}s")
            else:
                self._route(pull, now)
        for peer in list(self.peers.values()):
            if peer.hs_seq >= 0 and now > peer.hs_deadline:
                self._peer_failed(peer, FailReason.PEER_GONE,
                                  f"no handshake answer from {peer.address} within "
                                  f"{self.cfg.rpc_timeout_s}s")
        if self.pulls:
            for raw_list in self.agent.notifs().values():  # drives UCX progress
                logger.debug("importer ignored %d notifications", len(raw_list))

    def _route(self, pull: Pull, now: float) -> None:
        h = pull.handle
        peer = self.peers.get(h.side_channel)
        if peer is None:
            peer = Peer.connect(self.ctx, h.side_channel, self.cfg.max_msg_bytes, self.cfg.keys)
            self.peers[peer.address] = peer
            self.poller.register(peer.sock, zmq.POLLIN)
        if peer.hs_seq >= 0:
            return  # handshake in flight
        if peer.is_ready and peer.instance_id == h.instance_id:
            if peer.mismatch:
                self._finish(pull, FailReason.FINGERPRINT_MISMATCH, peer.mismatch)
            else:
                self._send_claim(pull, peer, now)
        elif peer.is_ready and peer.hs_time >= pull.started:
            self._finish(pull, FailReason.PEER_RESTARTED,
                         f"handle names instance {h.instance_id}, {peer.address} runs "
                         f"{peer.instance_id}")
        else:
            self.seq += 1
            peer.hs_seq, peer.hs_deadline = self.seq, now + self.cfg.rpc_timeout_s
            peer.sock.send(proto.encode(proto.Handshake(self.seq)))

    def _send_claim(self, pull: Pull, peer: Peer, now: float) -> None:
        h = pull.handle
        try:
            remote_ids = check_block_ids(h.block_ids, peer.spec.num_blocks, "handle block ids")
        except BadHandleError as exc:
            self._finish(pull, FailReason.BAD_HANDLE, str(exc))
            return
        self.seq += 1
        pull.seq, pull.peer, pull.deadline = self.seq, peer, now + self.cfg.rpc_timeout_s
        self.claims[self.seq] = pull
        peer.sock.send(proto.encode(proto.Claim(self.seq, h.request_id, h.instance_id,
                                                self.agent.name, remote_ids, h.credential)))

    def _post(self, pull: Pull) -> None:
        peer, h = pull.peer, pull.handle
        note = proto.encode(proto.Release(h.request_id, h.instance_id))
        pull.posted = time.monotonic()
        try:
            xfer, pull.num_descs, state = self.agent.post(
                "READ", peer.agent_name, peer.spec, pull.local_ids,
                list(h.block_ids[pull.first_block:]), note)
        except PeerGoneError as exc:
            self._finish(pull, FailReason.PEER_GONE, str(exc))
            self._peer_failed(peer, FailReason.PEER_GONE, str(exc))
            return
        except KVTransferError as exc:
            self._release_note(pull)
            self._finish(pull, FailReason.TRANSFER_ERROR, str(exc))
            return
        pull.xfer, pull.state = xfer, TransferState.TRANSFERRING
        pull.deadline = time.monotonic() + self.cfg.transfer_timeout_s
        self.in_flight[peer.agent_name] += 1
        self.table.set_state(h.request_id, TransferState.TRANSFERRING)
        if state == "DONE":
            self._complete(pull)

    def _check(self, pull: Pull, now: float) -> None:
        try:
            state = self.agent.check(pull.xfer)
        except KVTransferError as exc:
            gone = isinstance(exc, PeerGoneError)
            self._drop_xfer(pull, force=True)
            if not gone:
                self._release_note(pull)
            self._finish(pull, FailReason.PEER_GONE if gone else FailReason.TRANSFER_ERROR,
                         str(exc))
            if gone and pull.peer is not None and self.peers.get(pull.peer.address) is pull.peer:
                self._peer_failed(pull.peer, FailReason.PEER_GONE, str(exc))
            return
        if state == "DONE":
            self._complete(pull)
        elif pull.fail is not None:
            self._cancel(pull, *pull.fail)  # retry the cancel NIXL refused last turn
        elif now > pull.deadline:
            self._cancel(pull, FailReason.TIMEOUT,
                         f"transfer exceeded {self.cfg.transfer_timeout_s}s")

    def _complete(self, pull: Pull) -> None:
        pull.xfer_seconds = time.monotonic() - pull.posted
        self._drop_xfer(pull, force=True)
        if pull.fail is not None or pull.is_aborted:
            reason, text = pull.fail or (FailReason.ABORTED, "aborted")
            self._finish(pull, reason, text)
            return
        self.num_landed += 1
        if self.num_landed in self.faults.corrupt_pulls:
            logger.warning("TEST FAULT: corrupting landed pull %d (%s)", self.num_landed,
                           pull.handle.request_id)
            self.reader.invert(pull.local_ids[0])
        bad = self._verify(pull)
        self._finish(pull, FailReason.CHECKSUM_MISMATCH if bad else None, bad)

    def _verify(self, pull: Pull) -> str:
        """"" when every pulled block has its checksum (or the handle carries none), else what
        differs. The blocks before first_block were here already (verified when they came)."""
        sums = pull.handle.checksums
        if not sums:
            return ""
        start = time.perf_counter()
        bad = self.reader.mismatches(pull.local_ids, sums[pull.first_block:])
        self.table.add_time("verify_seconds", time.perf_counter() - start)
        if not bad:
            return ""
        h = pull.handle
        return (f"{len(bad)} of {len(pull.local_ids)} pulled blocks differ from their checksum "
                f"at {h.engine_id} (first: block {h.block_ids[pull.first_block + bad[0]]} there, "
                f"{pull.local_ids[bad[0]]} here)")

    def _cancel(self, pull: Pull, reason: FailReason, text: str) -> None:
        """Fail a posted transfer, but only once NIXL let go of it: until then the local
        blocks may still be written."""
        pull.fail = (reason, text)
        if self._drop_xfer(pull, force=False):
            self._release_note(pull)
            self._finish(pull, reason, text)

    def _drop_xfer(self, pull: Pull, force: bool) -> bool:
        if pull.xfer is None:
            return True
        if not self.agent.release(pull.xfer) and not force:
            return False
        pull.xfer = None
        name = pull.peer.agent_name
        self.in_flight[name] -= 1
        if self.in_flight[name] <= 0:
            del self.in_flight[name]
            if name in self.retired:
                self._retire(name)
        return True

    # ---- endings ----

    def _retire(self, name: str) -> None:
        """Forget a peer agent in NIXL once no posted transfer names it."""
        if not name:
            return
        if self.in_flight.get(name, 0) > 0:
            self.retired.add(name)
            return
        self.retired.discard(name)
        self.agent.remove_peer(name)

    def _peer_failed(self, peer: Peer, reason: FailReason, text: str) -> None:
        """Drop the peer's socket and cache; every pull waiting on its side channel fails."""
        if self.peers.get(peer.address) is peer:
            del self.peers[peer.address]
            self.poller.unregister(peer.sock)
            peer.sock.close(linger=0)
            self._retire(peer.agent_name)
            logger.warning("KV peer %s failed: %s", peer.address, text)
        for pull in list(self.pulls.values()):
            if (pull.handle.side_channel == peer.address
                    and pull.state == TransferState.PENDING):
                self._finish(pull, reason, text)

    def _release_note(self, pull: Pull) -> None:
        """Tell the exporter we are done with a claimed lease we will not (fully) read."""
        peer = pull.peer
        if not pull.is_claimed or peer is None or self.peers.get(peer.address) is not peer:
            return
        note = proto.encode(proto.Release(pull.handle.request_id, pull.handle.instance_id))
        try:
            self.agent.send_notif(peer.agent_name, note)
        except KVTransferError as exc:
            logger.debug("release note for %s not sent: %s", pull.handle.request_id, exc)

    def _finish(self, pull: Pull, reason: FailReason | None, text: str) -> None:
        rid = pull.handle.request_id
        if self.pulls.get(rid) is not pull:
            return
        del self.pulls[rid]
        if pull.seq >= 0:
            self.claims.pop(pull.seq, None)
        done = reason is None
        result = TransferResult(
            rid, TransferState.DONE if done else TransferState.FAILED,
            "" if done else reason.value, text,
            len(pull.local_ids) * self.spec.block_bytes if done else 0,
            pull.num_descs, time.monotonic() - pull.started,
            pull.xfer_seconds if done else 0.0)
        if not done:
            logger.debug("pull %s failed: %s: %s", rid, reason.value, text)
        self.table.finish(result)

    def _shutdown(self) -> None:
        for pull in list(self.pulls.values()):
            self._drop_xfer(pull, force=True)
            self._finish(pull, FailReason.CLOSED, "importer closed")
        for peer in self.peers.values():
            peer.sock.close(linger=0)
        self.peers.clear()
