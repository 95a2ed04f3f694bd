"""Peers killed with SIGKILL before, during and after a pull; restarts; the TCP path."""

from __future__ import annotations

import socket

import pytest
from kv_helpers import BLOCK_BYTES, FAST, NUM_BLOCKS, assert_whole, wait_until
from kv_peer import ImporterProcess, PeerProcess

from kv_transfer import TransferState

pytestmark = pytest.mark.timeout(90)

TCP = {"UCX_TLS": "^cma"}
BIG_BLOCKS, BIG_BYTES = 97, 1 << 20  # 96 MiB per pull: long enough to kill mid-transfer


def _pull(importer, local, handle, seed):
    ids = local.allocate(len(handle.block_ids))
    try:
        result = importer.transfer(handle, ids)
        exact = result.state == TransferState.DONE and local.is_exact(ids, seed)
    finally:
        local.release(ids)
    return result, exact


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_peer_killed_before_pull_then_restarted(importer, local_pool):
    port = _free_port()
    cfg = {**FAST, "side_channel_port": port}
    first = PeerProcess(NUM_BLOCKS, BLOCK_BYTES, cfg=cfg)
    try:
        ok, exact = _pull(importer, local_pool, first.hold("a", [1, 2], seed=1), seed=1)
        assert ok.state == TransferState.DONE and exact
        stale = first.hold("b", [3, 4], seed=2)
        first.kill()
        result, _ = _pull(importer, local_pool, stale, seed=2)
        # The claim's own deadline (rpc_timeout_s) fails it, not transfer()'s longer limit.
        assert result.reason == "peer_gone", result
        assert result.message.startswith("no claim answer from ") and \
            result.message.endswith(f"within {FAST['rpc_timeout_s']}s"), result
        # Same address, new process: the importer handshakes again (new instance id).
        second = PeerProcess(NUM_BLOCKS, BLOCK_BYTES, cfg=cfg)
        assert second.instance_id != first.instance_id
        handle = second.hold("c", [3, 4, 9], seed=3)
        result, exact = _pull(importer, local_pool, handle, seed=3)
        assert result.state == TransferState.DONE and exact, result
        result, _ = _pull(importer, local_pool, stale, seed=2)
        assert result.reason == "peer_restarted", result
        assert_whole(second, importer, local_pool)
        second.stop()
    finally:
        first.stop()


def test_peer_killed_after_pull_survivor_stays_usable(peer, importer, local_pool):
    doomed = PeerProcess(NUM_BLOCKS, BLOCK_BYTES, cfg=FAST)
    result, exact = _pull(importer, local_pool, doomed.hold("x", [5], seed=5), seed=5)
    assert result.state == TransferState.DONE and exact
    doomed.kill()
    result, exact = _pull(importer, local_pool, peer.hold("y", [5, 6], seed=6), seed=6)
    assert result.state == TransferState.DONE and exact
    assert_whole(peer, importer, local_pool)


@pytest.fixture(scope="module")
def tcp_importer():
    imp = ImporterProcess(BIG_BLOCKS, BIG_BYTES, cfg=FAST, env=TCP)
    yield imp
    imp.stop()


def test_cross_host_path_is_byte_exact(tcp_importer):
    exporter = PeerProcess(BIG_BLOCKS, BIG_BYTES, cfg=FAST, env=TCP)
    try:
        for name, ids in [("one", [40]), ("scattered", [90, 2, 3, 4, 61, 17]),
                          ("all", list(range(1, BIG_BLOCKS)))]:
            handle = exporter.hold(name, ids, seed=len(ids))
            local = list(range(BIG_BLOCKS - 1, BIG_BLOCKS - 1 - len(ids), -1))
            state, reason, message, exact, _ = tcp_importer.pull(handle, local, len(ids))
            assert state == TransferState.DONE and exact, (name, reason, message)
        assert wait_until(lambda: exporter.stats()[:2] == (BIG_BLOCKS - 1, 0))
    finally:
        exporter.stop()


def _kill_mid_transfer(victim, importer, handle, seed):
    importer.call("start", handle, list(range(1, len(handle.block_ids) + 1)), seed)
    assert wait_until(lambda: importer.call("state", handle.request_id) != 0, 5)
    victim.kill()


def test_exporter_killed_during_pull(tcp_importer):
    exporter = PeerProcess(BIG_BLOCKS, BIG_BYTES, cfg=FAST, env=TCP)
    try:
        handle = exporter.hold("mid", list(range(1, BIG_BLOCKS)), seed=4)
        _kill_mid_transfer(exporter, tcp_importer, handle, seed=4)
        state, reason, message, _, _ = tcp_importer.call("wait", "mid", 5.0)
        # A race can let the copy finish before the kill lands; a failure must be NIXL seeing
        # the peer disconnect, not a deadline (transfer_timeout_s) running out.
        assert state == TransferState.DONE or (
            reason == "peer_gone" and "peer disconnected" in message), (reason, message)
        assert tcp_importer.call("stats")[0] == 0
    finally:
        exporter.stop()
    # The survivor stays usable with a fresh peer.
    fresh = PeerProcess(BIG_BLOCKS, BIG_BYTES, cfg=FAST, env=TCP)
    try:
        state, reason, *_ = tcp_importer.pull(fresh.hold("after", [3, 4], seed=8), [5, 6], 8)
        assert state == TransferState.DONE, reason
    finally:
        fresh.stop()


def test_importer_killed_during_pull_frees_the_lease():
    cfg = {**FAST, "transfer_timeout_s": 0.5, "claim_ttl_s": 1.0}
    exporter = PeerProcess(BIG_BLOCKS, BIG_BYTES, cfg=cfg, env=TCP)
    victim = ImporterProcess(BIG_BLOCKS, BIG_BYTES, cfg=cfg, env=TCP)
    try:
        handle = exporter.hold("orphan", list(range(1, BIG_BLOCKS)), seed=4)
        _kill_mid_transfer(victim, victim, handle, seed=4)
        assert wait_until(lambda: exporter.stats()[:2] == (BIG_BLOCKS - 1, 0), 5)
        survivor = ImporterProcess(BIG_BLOCKS, BIG_BYTES, cfg=cfg, env=TCP)
        state, reason, *_ = survivor.pull(exporter.hold("next", [7], seed=9), [7], 9)
        assert state == TransferState.DONE, reason
        survivor.stop()
    finally:
        victim.stop()
        exporter.stop()
