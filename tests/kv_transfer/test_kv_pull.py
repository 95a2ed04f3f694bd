"""Real NIXL agents in two processes: byte-exact pulls and every refusal path."""

from __future__ import annotations

import msgspec
import pytest
from kv_helpers import FAST, NUM_BLOCKS, assert_whole, wait_until
from kv_peer import PeerProcess, fingerprint

from kv_transfer import KVImporter, TransferConfig, TransferState

pytestmark = pytest.mark.timeout(60)


def pull(importer, local, handle, seed):
    ids = local.allocate(len(handle.block_ids))
    try:
        result = importer.transfer(handle, ids)
        exact = result.state == TransferState.DONE and local.is_exact(ids, seed)
    finally:
        local.release(ids)
    return result, exact


@pytest.mark.parametrize("blocks", [[7], [1, 2, 3, 4], [60, 3, 17, 18, 19, 42, 5, 2],
                                    list(range(1, NUM_BLOCKS))], ids=["one", "run", "scattered",
                                                                       "all"])
def test_pull_is_byte_exact(peer, importer, local_pool, blocks):
    handle = peer.hold(f"exact-{len(blocks)}-{blocks[0]}", blocks, seed=len(blocks))
    result, exact = pull(importer, local_pool, handle, seed=len(blocks))
    assert result.state == TransferState.DONE, result
    assert exact
    assert result.num_bytes == len(blocks) * local_pool.data.shape[1]
    assert_whole(peer, importer, local_pool)


def test_pull_from_a_block_on_reads_only_the_rest(peer, importer, local_pool):
    """A prefix-cache hit of the first blocks: the lease is claimed and released whole, only
    the blocks after the hit are read."""
    import numpy as np
    from kv_peer import pattern

    handle = peer.hold("partial", [9, 4, 21, 22, 30], seed=11)
    ids = local_pool.allocate(3)
    try:
        importer.start_pull(handle, ids, first_block=2)
        results = []
        assert wait_until(lambda: results.extend(importer.collect()) or results, 10)
        result = results[0]
        assert result.state == TransferState.DONE, result
        assert result.num_bytes == 3 * local_pool.data.shape[1]
        for j, b in enumerate(ids):
            assert np.array_equal(local_pool.data[b], pattern(11, 2 + j, local_pool.data.shape[1]))
    finally:
        local_pool.release(ids)
    assert_whole(peer, importer, local_pool)  # the lease ended: every peer block is back


def test_pull_from_a_block_past_the_handle_is_refused(peer, importer, local_pool):
    handle = peer.hold("partial-bad", [5, 6], seed=2)
    ids = local_pool.allocate(1)
    try:
        importer.start_pull(handle, ids, first_block=2)
        results = []
        assert wait_until(lambda: results.extend(importer.collect()) or results, 10)
        assert results[0].reason == "bad_handle", results[0]
    finally:
        local_pool.release(ids)
    peer.call("abort", "partial-bad")
    assert_whole(peer, importer, local_pool)


def test_consecutive_blocks_merge_into_one_descriptor(peer, importer, local_pool):
    local_pool.free.sort()
    handle = peer.hold("merge", list(range(10, 30)), seed=3)
    result, exact = pull(importer, local_pool, handle, seed=3)
    assert exact and result.num_descs == 1
    assert_whole(peer, importer, local_pool)


def test_64_concurrent_pulls(peer, importer, local_pool):
    handles = [peer.hold(f"conc-{i}", [i], seed=100 + i) for i in range(1, 64)]
    ids = {h.request_id: local_pool.allocate(1) for h in handles}
    for h in handles:
        importer.start_pull(h, ids[h.request_id])
    results = []
    assert wait_until(lambda: results.extend(importer.collect()) or len(results) == 63, 20)
    for r in results:
        assert r.state == TransferState.DONE, r
        seed = 100 + int(r.request_id.split("-")[1])
        assert local_pool.is_exact(ids[r.request_id], seed)
        local_pool.release(ids[r.request_id])
    assert_whole(peer, importer, local_pool)


def test_fingerprint_mismatch_is_refused(importer, local_pool):
    odd = PeerProcess(8, local_pool.data.shape[1], cfg=FAST, fp={"model": "other-model"})
    try:
        handle = odd.hold("fp", [1, 2], seed=1)
        result, _ = pull(importer, local_pool, handle, seed=1)
        assert result.reason == "fingerprint_mismatch"
        assert "other-model" in result.message and "test-model" in result.message
        assert odd.stats()[2].get("leases_claimed", 0) == 0  # nothing claimed or read
        odd.call("abort", "fp")
        assert odd.stats()[:2] == (7, 0)
    finally:
        odd.stop()


def _forged(handle, **changes):
    return msgspec.structs.replace(handle, **changes)


@pytest.mark.parametrize("bad_ids", [[0, 1], [1, NUM_BLOCKS], [2, 2], [-1, 3]],
                         ids=["null-block", "past-end", "duplicate", "negative"])
def test_out_of_range_block_ids_are_refused(peer, importer, local_pool, bad_ids):
    handle = peer.hold("oob", [5, 6], seed=9)
    result, _ = pull(importer, local_pool, _forged(handle, block_ids=bad_ids), seed=9)
    assert result.state == TransferState.FAILED and result.reason == "bad_handle", result
    # The real lease is untouched and still claimable.
    result, exact = pull(importer, local_pool, handle, seed=9)
    assert result.state == TransferState.DONE and exact
    assert_whole(peer, importer, local_pool)


def test_ids_that_differ_from_the_lease_are_refused(peer, importer, local_pool):
    handle = peer.hold("swap", [5, 6], seed=9)
    result, _ = pull(importer, local_pool, _forged(handle, block_ids=[6, 7]), seed=9)
    assert result.reason == "bad_handle"
    assert peer.call("abort", "swap")
    assert_whole(peer, importer, local_pool)


def test_local_ids_are_checked(peer, importer, local_pool):
    handle = peer.hold("local", [5, 6], seed=9)
    with pytest.raises(ValueError):
        importer.start_pull(handle, [0, 1])
    result = importer.transfer(handle, [1])  # count mismatch comes back as a failed result
    assert result.reason == "bad_handle"
    assert peer.call("abort", "local")
    assert_whole(peer, importer, local_pool)


def test_unknown_request(peer, importer, local_pool):
    handle = peer.hold("known", [8], seed=1)
    result, _ = pull(importer, local_pool, _forged(handle, request_id="nope"), seed=1)
    assert result.reason == "unknown_request"
    assert peer.call("abort", "known")
    assert_whole(peer, importer, local_pool)


def test_double_claim(peer, importer, local_pool):
    handle = peer.hold("twice", [9, 10], seed=2)
    first, exact = pull(importer, local_pool, handle, seed=2)
    second, _ = pull(importer, local_pool, handle, seed=2)
    assert first.state == TransferState.DONE and exact
    assert second.reason == "already_claimed"
    assert_whole(peer, importer, local_pool)


def test_claim_after_expiry(peer, importer, local_pool):
    handle = peer.hold("late", [11, 12], seed=2, ttl_s=0.2)
    assert wait_until(lambda: peer.stats()[1] == 0)  # expired, blocks freed by on_free
    result, _ = pull(importer, local_pool, handle, seed=2)
    assert result.reason == "lease_expired"
    assert peer.stats()[2]["leases_expired"] >= 1
    assert_whole(peer, importer, local_pool)


def test_aborted_lease(peer, importer, local_pool):
    handle = peer.hold("gone", [13], seed=2)
    assert peer.call("abort", "gone")
    result, _ = pull(importer, local_pool, handle, seed=2)
    assert result.reason in ("aborted", "unknown_request")
    assert_whole(peer, importer, local_pool)


def test_importer_abort_before_result(peer, importer, local_pool):
    handle = peer.hold("imp-abort", [14, 15], seed=2)
    ids = local_pool.allocate(2)
    importer.start_pull(handle, ids)
    importer.abort("imp-abort")
    assert wait_until(lambda: importer.num_pending() == 0)
    (result,) = importer.collect()
    assert result.state in (TransferState.DONE, TransferState.FAILED)
    local_pool.release(ids)
    if result.state == TransferState.FAILED:
        assert result.reason == "aborted"
        # the exporter learns through the release note or, if never claimed, its abort
        peer.call("abort", "imp-abort")
    assert_whole(peer, importer, local_pool)


def test_metrics_snapshot(peer, importer, local_pool):
    """The counters move by what this test does (one pull, one refusal), whatever ran before."""
    before, peer_before = importer.metrics(), peer.stats()[2]
    handle = peer.hold("metrics", [16, 17], seed=5)
    result, exact = pull(importer, local_pool, handle, seed=5)
    assert result.state == TransferState.DONE and exact
    refused = peer.hold("metrics-bad", [18], seed=5)
    result, _ = pull(importer, local_pool, _forged(refused, block_ids=[18, 19]), seed=5)
    assert result.reason == "bad_handle"
    assert peer.call("abort", "metrics-bad")
    assert_whole(peer, importer, local_pool)  # the release note has landed too
    snap, stats = importer.metrics(), peer.stats()[2]

    def moved(now, then, key):
        return now.get(key, 0) - then.get(key, 0)

    assert moved(snap, before, "transfers_done") == 1
    assert moved(snap, before, "bytes_total") == 2 * local_pool.data.shape[1]
    assert moved(snap, before, "failed_bad_handle") == 1
    assert moved(stats, peer_before, "leases_released") == 1
    assert moved(stats, peer_before, "leases_aborted") == 1
    assert stats["handshakes_served"] >= 1  # the module's importer met this peer once
    assert isinstance(msgspec.json.encode(snap), bytes)


def test_timeouts_are_validated():
    with pytest.raises(ValueError, match="rpc_timeout_s"):
        TransferConfig(rpc_timeout_s=0)
    with pytest.raises(ValueError, match="op"):
        TransferConfig(op="PUSH")
    with pytest.raises(ValueError):
        KVImporter(bytearray(10), TransferConfig(), fingerprint())


def test_side_channel_survives_garbage(peer, importer, local_pool, cluster_keys):
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    cluster_keys.apply_client(sock)  # an authenticated peer sending garbage
    sock.connect(peer.address)
    try:
        for junk in [b"", b"\xff\x00garbage", msgspec.msgpack.encode(["claim", 1, 2, 3])]:
            sock.send(junk)
            assert sock.poll(2000), "no answer to a malformed frame"
            assert msgspec.msgpack.decode(sock.recv())[0] == "err"
        sock.send(msgspec.msgpack.encode(["claim", 1, "r", peer.instance_id, "a", [2**64 - 1]]))
        assert sock.poll(2000)
        assert msgspec.msgpack.decode(sock.recv())[:5] == ["claim_ok", 1, "r", False, "bad_handle"]
        sock.send(b"x" * (9 << 20))  # over max_msg_bytes: the connection is dropped
    finally:
        sock.close()
    result, exact = pull(importer, local_pool, peer.hold("after-junk", [3], seed=4), seed=4)
    assert result.state == TransferState.DONE and exact
    assert_whole(peer, importer, local_pool)
