"""The importer's side of the KV side channel fed untrusted bytes (issue 32): a stand-in
exporter, holding the cluster's server key (so its bytes reach the importer's decoder), answers
every handshake and claim with a random, truncated, bit-flipped or wrong-shape reply, or none.
Every pull must end (DONE or FAILED, never hang), the importer's loop must live, nothing may
leak, and a pull from the real exporter process must still be exact afterwards.
(The exporter's side: tests/services/test_fuzz.py.) BATON_FUZZ_SECONDS (default 3) sets how
long; e.g. BATON_FUZZ_SECONDS=120 for a long run."""

from __future__ import annotations

import os
import random
import threading
import time

import msgspec
import pytest
import zmq
from kv_helpers import assert_whole

from kv_transfer import TransferState
from kv_transfer import protocol as proto
from kv_transfer.auth import keys_from_env, stop_authenticator
from tests.services.test_fuzz import mutations

pytestmark = pytest.mark.timeout(120)

FUZZ_SECONDS = float(os.environ.get("BATON_FUZZ_SECONDS", "3"))


class _HostileExporter:
    """A ROUTER with the cluster's server key answering with hostile replies, in a thread."""

    def __init__(self, valid_handshake: proto.HandshakeReply, seed: int):
        self.rng = random.Random(seed)
        self.valid_handshake = valid_handshake
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        keys_from_env().apply_server(self.sock, "fuzz_exporter")
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.num_answered = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _reply(self, msg) -> list[bytes]:
        if isinstance(msg, proto.Handshake):
            valid = proto.encode(msgspec.structs.replace(self.valid_handshake, seq=msg.seq))
        else:
            valid = proto.encode(proto.ClaimReply(msg.seq, msg.request_id,
                                                  self.rng.random() < 0.3))
        roll = self.rng.random()
        if roll < 0.15:
            return []  # no answer: the importer's own timeout
        if roll < 0.3:
            return [valid]
        return [self.rng.choice(mutations(self.rng, [valid]))]

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            ident, data = self.sock.recv_multipart()[:2]
            try:
                msg = proto.decode_to_exporter(data)
            except msgspec.DecodeError:
                continue
            for frame in self._reply(msg):
                self.sock.send_multipart([ident, frame])
                self.num_answered += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.sock.close(linger=0)
        stop_authenticator(self.ctx)
        self.ctx.term()


def _handshake_of(peer) -> proto.HandshakeReply:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    keys_from_env().apply_client(sock)
    sock.connect(peer.address)
    try:
        sock.send(proto.encode(proto.Handshake(1)))
        assert sock.poll(5000), "the real exporter does not answer"
        return proto.decode_to_importer(sock.recv())
    finally:
        sock.close(linger=0)


def fuzz_importer(peer, importer, local, seconds: float, seed: int) -> tuple[int, int]:
    """Pulls from a hostile exporter for `seconds`; returns how many ended, and failed."""
    from test_kv_pull import pull

    hostile = _HostileExporter(_handshake_of(peer), seed)
    num_pulls, num_failed, deadline = 0, 0, time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            handle = peer.hold(f"fz-{seed}-{num_pulls}", 2, seed=5)
            fake = msgspec.structs.replace(handle, side_channel=hostile.address)
            ids = local.allocate(2)
            try:
                result = importer.transfer(fake, ids)  # bounded by the config's timeouts
            finally:
                local.release(ids)
            assert result.state in (TransferState.DONE, TransferState.FAILED), result
            num_pulls += 1
            num_failed += result.state == TransferState.FAILED
            peer.call("abort", handle.request_id)  # the real lease nobody claimed from it
    finally:
        hostile.close()
    assert hostile.num_answered > 0
    result, exact = pull(importer, local, peer.hold(f"fz-{seed}-after", [3], seed=4), seed=4)
    assert result.state == TransferState.DONE and exact
    return num_pulls, num_failed


def test_importer_survives_a_hostile_exporter(peer, importer, local_pool):
    num_pulls, num_failed = fuzz_importer(peer, importer, local_pool, FUZZ_SECONDS, seed=21)
    assert num_pulls > 0 and num_failed > 0, (num_pulls, num_failed)
    assert_whole(peer, importer, local_pool)
