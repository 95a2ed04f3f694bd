"""Pure parts without NIXL: block checks, descriptor runs, the lease table, config, wire."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from kv_transfer import KVHandle, PoolSpec, TransferConfig
from kv_transfer import protocol as proto
from kv_transfer.blocks import check_block_ids, descriptor_rows, merge_runs
from kv_transfer.errors import BadHandleError, FailReason
from kv_transfer.leases import LeaseTable
from kv_transfer.peers import check_address


@pytest.mark.parametrize("ids", [[], [0], [8], [1, 1], [True], ["1"], [1.0], [-3]])
def test_bad_block_ids(ids):
    with pytest.raises(BadHandleError):
        check_block_ids(ids, 8, "t")


def test_good_block_ids_accept_numpy_ints():
    assert check_block_ids(np.array([7, 1, 3]), 8, "t") == [7, 1, 3]


def test_merge_runs_needs_both_sides_consecutive():
    assert merge_runs([1, 2, 3, 9], [5, 6, 7, 8]) == [(1, 5, 3), (9, 8, 1)]
    assert merge_runs([1, 2], [6, 5]) == [(1, 6, 1), (2, 5, 1)]
    local, remote = PoolSpec(4096, 8 * 16, 8, 16), PoolSpec(1 << 20, 8 * 16, 8, 16)
    loc, rem = descriptor_rows([(1, 5, 3)], local, remote)
    assert loc.tolist() == [[4096 + 16, 48, 0]] and rem.tolist() == [[(1 << 20) + 80, 48, 0]]


def test_lease_lifecycle():
    t = LeaseTable(16)
    cred = t.hold("a", [1, 2], 32, deadline=10.0).credential
    # A prompt sharing a's first block through the prefix cache is leased on its own.
    t.hold("b", [1, 3], 32, deadline=10.0)
    assert t.num_leased_blocks() == 3
    assert t.abort("b").block_ids == [1, 3] and t.num_leased_blocks() == 2
    with pytest.raises(ValueError, match="already holds"):
        t.hold("a", [4], 16, deadline=10.0)
    assert t.claim("a", "imp", [2, 1], 20.0, 1.0, cred)[0] == FailReason.BAD_HANDLE
    assert t.claim("a", "imp", [1, 2], 20.0, 1.0, cred) == (None, "")
    assert t.claim("a", "imp", [1, 2], 20.0, 1.0, cred)[0] == FailReason.ALREADY_CLAIMED
    assert t.release("a", "someone-else") is None
    assert t.release("a", "imp").block_ids == [1, 2]
    assert t.claim("a", "imp", [1, 2], 20.0, 1.0, cred)[0] == FailReason.ALREADY_CLAIMED
    assert t.claim("zzz", "imp", [1], 20.0, now=1.0)[0] == FailReason.UNKNOWN_REQUEST
    assert not t.leases and t.num_leased_blocks() == 0


def test_lease_expiry_and_abort():
    t = LeaseTable(16)
    x = t.hold("x", [1], 16, deadline=1.0).credential
    t.hold("y", [2], 16, deadline=5.0)
    z = t.hold("z", [3], 16, deadline=5.0).credential
    assert t.claim("x", "imp", [1], 9.0, 2.0, x)[0] == FailReason.LEASE_EXPIRED
    assert [x.request_id for x in t.expire(now=2.0)] == ["x"]
    assert t.claim("x", "imp", [1], 9.0, 2.0, x)[0] == FailReason.LEASE_EXPIRED
    assert t.abort("y").block_ids == [2]
    assert t.claim("z", "imp", [3], 9.0, 2.0, z) == (None, "")
    assert t.abort("z") is None  # claimed: freed when the reader lets go
    assert t.release("z", "imp").block_ids == [3]
    assert t.counters["leases_expired"] == 1 and t.counters["leases_aborted"] == 2
    assert not t.leases


def test_claimed_lease_expires_at_claim_deadline():
    t = LeaseTable(16)
    cred = t.hold("c", [4], 16, deadline=1.0).credential
    assert t.claim("c", "imp", [4], 3.0, 0.5, cred) == (None, "")
    assert t.expire(now=2.0) == []
    assert [x.request_id for x in t.expire(now=3.5)] == ["c"]
    assert t.counters["claims_expired"] == 1


@pytest.mark.parametrize("kwargs", [
    {"host": ""}, {"side_channel_port": 70000}, {"lease_ttl_s": 0},
    {"claim_ttl_s": 1.0, "transfer_timeout_s": 2.0}, {"op": "PUSH"},
    {"poll_interval_s": 1.0}, {"max_msg_bytes": 10}, {"ucx_env": {"PATH": "/"}},
])
def test_config_rejects(kwargs):
    with pytest.raises(ValueError):
        TransferConfig(**kwargs)


def test_config_defaults_are_loopback():
    cfg = TransferConfig()
    assert cfg.host == "127.0.0.1" and cfg.op == "READ" and cfg.side_channel_port == 0


def test_pool_spec_from_tensor_and_array():
    torch = pytest.importorskip("torch")
    kv = torch.zeros(5, 2, 2, 4, 1, 8)
    spec = PoolSpec.of(kv)
    assert (spec.num_blocks, spec.block_bytes) == (5, 2 * 2 * 4 * 8 * 4)
    with pytest.raises(ValueError):
        PoolSpec.of(kv.transpose(0, 1))
    arr = np.zeros((4, 100), np.uint8)
    assert PoolSpec.of(arr).block_bytes == 100
    with pytest.raises(ValueError):
        PoolSpec(1, 10, 1, 10)


def test_wire_is_tagged_array_like():
    fp = proto.Fingerprint("m", "float32", 2, 2, 64, 16)
    claim = proto.Claim(3, "r", "inst", "agent", [1, 2], b"\x01" * 16)
    raw = proto.encode(claim)
    assert msgspec.msgpack.decode(raw)[0] == "claim"
    assert proto.decode_to_exporter(raw) == claim
    h = KVHandle("p0", "tcp://127.0.0.1:5000", "inst", "r", [1, 2], 32, [], b"\x02" * 16)
    assert proto.decode_handle(proto.encode(h)) == h
    reply = proto.HandshakeReply(1, "p0", "i", "a", b"md", 4096, 8, 16, fp)
    assert proto.decode_to_importer(proto.encode(reply)) == reply
    with pytest.raises(msgspec.ValidationError):
        proto.decode_to_exporter(msgspec.msgpack.encode(["claim", "x"]))


@pytest.mark.parametrize("addr", ["ipc:///tmp/x", "tcp://h", "tcp://h:0", "tcp://h:99999",
                                  "tcp://" + "a" * 300 + ":1"])
def test_bad_side_channel_addresses(addr):
    with pytest.raises(ValueError):
        check_address(addr)


def test_pool_memory_type_follows_the_tensor():
    """Host tensors register as NIXL DRAM; a CUDA tensor would register as VRAM of its GPU
    (these machines have no GPU: the VRAM path is checked through PoolSpec, not NIXL); other
    devices are refused by name. Descriptor rows carry each side's device id."""
    import torch

    assert PoolSpec.of(torch.zeros(4, 16)).mem_type == "DRAM"
    with pytest.raises(ValueError, match="meta"):
        PoolSpec.of(torch.empty(4, 16, device="meta"))
    with pytest.raises(ValueError, match="mem_type"):
        PoolSpec(4096, 8 * 16, 8, 16, "GPU")
    local, remote = PoolSpec(4096, 128, 8, 16), PoolSpec(1 << 20, 128, 8, 16, "VRAM", 3)
    loc, rem = descriptor_rows(merge_runs([1, 2], [5, 6]), local, remote)
    assert loc[:, 2].tolist() == [0] and rem[:, 2].tolist() == [3]


def test_handshake_carries_the_pool_memory_type():
    from kv_transfer.peers import check_handshake

    fp = proto.Fingerprint("m", "float32", 2, 2, 64, 16)
    local = PoolSpec(4096, 8 * 16, 8, 16)
    old = proto.HandshakeReply(1, "p0", "i", "a", b"md", 4096, 8, 16, fp)
    assert check_handshake(proto.decode_to_importer(proto.encode(old)), local, fp)[0].mem_type == "DRAM"
    gpu = proto.HandshakeReply(1, "p0", "i", "a", b"md", 4096, 8, 16, fp, "VRAM", 1)
    remote, mismatch = check_handshake(proto.decode_to_importer(proto.encode(gpu)), local, fp)
    assert (remote.mem_type, remote.device_id, mismatch) == ("VRAM", 1, "")
    forged = proto.HandshakeReply(1, "p0", "i", "a", b"md", 4096, 8, 16, fp, "DISK", 1)
    with pytest.raises(ValueError, match="mem_type"):
        check_handshake(forged, local, fp)
