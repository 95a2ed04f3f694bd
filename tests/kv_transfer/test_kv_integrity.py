"""KV integrity over real NIXL agents in two processes: every pulled block is verified against
the checksum its exporter took, and a block that differs (a test fault inverts it after the
read) or an exporter with other weights fails the pull, never a silent success."""

from __future__ import annotations

import os

import msgspec
import numpy as np
import pytest
from kv_helpers import BLOCK_BYTES, FAST, LocalPool, assert_whole, wait_until
from kv_peer import PeerProcess, fingerprint, pattern

from kv_transfer import KVImporter, TransferConfig, TransferState
from kv_transfer.integrity import FAULTS_ENV, SAMPLE_EVERY, BlockReader, FaultPlan, checksum

pytestmark = pytest.mark.timeout(60)


def _pull(importer, local, handle, seed, first_block=0):
    ids = local.allocate(len(handle.block_ids) - first_block)
    try:
        importer.start_pull(handle, ids, first_block=first_block)
        assert wait_until(lambda: importer.poll(handle.request_id) >= TransferState.DONE, 10)
        result = next(r for r in importer.collect() if r.request_id == handle.request_id)
        exact = result.state == TransferState.DONE and all(
            np.array_equal(local.data[b], pattern(seed, first_block + i, BLOCK_BYTES))
            for i, b in enumerate(ids))
    finally:
        local.release(ids)
    return result, exact


def test_checksum_finds_one_flipped_bit_in_a_host_pool():
    pool = np.arange(4 * 4096, dtype=np.uint32).reshape(4, -1)
    original = pool.copy()
    reader = BlockReader(pool)
    sums = reader.checksums([1, 2, 3])
    assert sums == [checksum(pool[b].tobytes()) for b in (1, 2, 3)]
    pool.view(np.uint8)[3, 4095] ^= 0x10
    assert reader.mismatches([1, 2, 3], sums) == [2]
    pool[3] = original[3]
    reader.invert(1)  # the fault hook's corruption, in place
    assert reader.mismatches([1, 2, 3], sums) == [0]
    assert np.array_equal(pool[1], ~original[1])


def test_fault_plan_comes_only_from_the_environment_and_is_checked():
    assert not FaultPlan.from_env({}).is_armed
    plan = FaultPlan.from_env({FAULTS_ENV: "corrupt_pull=2,5; foreign_weights"})
    assert plan.corrupt_pulls == {2, 5} and plan.foreign_weights
    for bad in ("corrupt_pull=x", "corrupt_pull=0", "flip_all"):
        with pytest.raises(ValueError, match=FAULTS_ENV):
            FaultPlan.parse(bad)
    with pytest.raises(ValueError, match="checksum='most'"):
        TransferConfig(checksum="most")


def test_handle_carries_checksums_and_a_clean_pull_verifies(peer, importer, local_pool):
    handle = peer.hold("sum-ok", [3, 9, 10, 11], seed=21)
    assert handle.checksums == [checksum(pattern(21, i, BLOCK_BYTES)) for i in range(4)]
    result, exact = _pull(importer, local_pool, handle, seed=21)
    assert result.state == TransferState.DONE and exact, result
    # From a block on (a prefix-cache hit): only the pulled blocks are checked, by position.
    handle = peer.hold("sum-part", [12, 13, 14], seed=22)
    result, exact = _pull(importer, local_pool, handle, seed=22, first_block=1)
    assert result.state == TransferState.DONE and exact, result
    assert_whole(peer, importer, local_pool)


def test_a_block_corrupted_in_flight_fails_the_pull_with_a_reason(peer):
    local = LocalPool()
    faults = FaultPlan(corrupt_pulls=frozenset({2}))
    importer = KVImporter(local.data, TransferConfig(**FAST), fingerprint(), faults=faults)
    try:
        first, exact = _pull(importer, local, peer.hold("c1", [4, 5], seed=31), seed=31)
        assert first.state == TransferState.DONE and exact
        bad, _ = _pull(importer, local, peer.hold("c2", [6, 7, 8], seed=32), seed=32)
        assert bad.state == TransferState.FAILED and bad.reason == "checksum_mismatch", bad
        assert bad.message.startswith("1 of 3 pulled blocks differ from their checksum at p0 "
                                      "(first: block 6 there"), bad.message
        again, exact = _pull(importer, local, peer.hold("c3", [6, 7, 8], seed=32), seed=32)
        assert again.state == TransferState.DONE and exact, again
        metrics = importer.metrics()
        assert metrics["failed_checksum_mismatch"] == 1 and metrics["transfers_done"] == 2
        # The lease of the refused pull ended as any read one does: nothing leaks.
        assert_whole(peer, importer, local)
    finally:
        importer.close()


def test_a_forged_checksum_list_is_a_bad_handle(peer, importer, local_pool):
    handle = peer.hold("sum-short", [15, 16], seed=41)
    forged = msgspec.structs.replace(handle, checksums=handle.checksums[:1])
    result, _ = _pull(importer, local_pool, forged, seed=41)
    assert result.reason == "bad_handle" and "1 checksums for 2 blocks" in result.message
    peer.call("abort", "sum-short")
    assert_whole(peer, importer, local_pool)


def test_an_exporter_with_other_weights_is_refused(importer, local_pool):
    odd = PeerProcess(8, BLOCK_BYTES, cfg=FAST, fp={"weights": "0123abcd"})
    try:
        result, _ = _pull(importer, local_pool, odd.hold("w", [1, 2], seed=1), seed=1)
        assert result.reason == "fingerprint_mismatch", result
        assert "computes other KV: weights '0123abcd' != ''" in result.message, result.message
        assert odd.stats()[2].get("leases_claimed", 0) == 0  # nothing read
        odd.call("abort", "w")
    finally:
        odd.stop()


def test_sample_mode_checksums_one_prompt_in_n_and_off_none():
    sampled = PeerProcess(4, BLOCK_BYTES, cfg={**FAST, "checksum": "sample"})
    off = PeerProcess(4, BLOCK_BYTES, cfg={**FAST, "checksum": "off"})
    try:
        carried = []
        for i in range(SAMPLE_EVERY + 1):
            handle = sampled.hold(f"s{i}", [1], seed=i)
            carried.append(bool(handle.checksums))
            sampled.call("abort", f"s{i}")
        assert carried == [True] + [False] * (SAMPLE_EVERY - 1) + [True]
        assert off.hold("o", [1], seed=0).checksums == []
        assert sampled.stats()[2]["checksummed_blocks"] == 2
    finally:
        sampled.stop()
        off.stop()


def test_the_copy_path_of_gpu_pools_reads_the_same_bytes():
    """A GPU pool's block is copied to the host before its checksum (no GPU here: the copy path
    runs on a host tensor described as VRAM); both paths agree, and the fault hook refuses it."""
    import torch

    from kv_transfer.config import PoolSpec

    pool = torch.randn(6, 2, 16, 8, dtype=torch.bfloat16)
    host = BlockReader(pool)
    spec = host.spec
    as_gpu = BlockReader(pool, PoolSpec(spec.address, spec.nbytes, spec.num_blocks,
                                        spec.block_bytes, "VRAM", 0))
    assert as_gpu.checksums([1, 4, 5]) == host.checksums([1, 4, 5])
    assert as_gpu.checksums([2]) == [checksum(pool[2].view(torch.uint8).numpy().tobytes())]
    with pytest.raises(AssertionError, match="host pool"):
        as_gpu.invert(1)


def test_the_weights_identity_follows_the_bytes_and_the_quantization_not_the_mtime(tmp_path):
    from baton.service.worker import weights_digest

    model = tmp_path / "a" / "m.gguf"
    model.parent.mkdir()
    model.write_bytes(bytes(range(256)) * 64)
    digest = weights_digest(str(model), "none")
    copy = tmp_path / "b" / "m.gguf"  # another host's copy: same bytes, another mtime
    copy.parent.mkdir()
    copy.write_bytes(model.read_bytes())
    os.utime(copy, (1, 1))
    assert weights_digest(str(copy), "none") == digest
    assert weights_digest(str(model), "int4") != digest
    copy.write_bytes(model.read_bytes()[:-1] + b"\x00")  # one byte of other weights
    assert weights_digest(str(copy), "none") != digest
    assert weights_digest("mock/tiny", "none") == ""  # a mock runner has no files
