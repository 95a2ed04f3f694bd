"""The importer's view of one exporter: its side-channel socket and its cached handshake."""

from __future__ import annotations

import dataclasses
import logging

import zmq

from kv_transfer import protocol as proto
from kv_transfer.auth import ClusterKeys
from kv_transfer.config import PoolSpec
from kv_transfer.integrity import fingerprint_mismatch

logger = logging.getLogger(__name__)

_MAX_ADDRESS = 256


def check_address(address: str) -> str:
    """A side-channel address from a handle: tcp://host:port, nothing else."""
    if not isinstance(address, str) or len(address) > _MAX_ADDRESS:
        raise ValueError(f"side channel address {address!r:.80} is not a short string")
    if not address.startswith("tcp://") or ":" not in address[6:]:
        raise ValueError(f"side channel address {address!r} is not tcp://host:port")
    port = address.rsplit(":", 1)[1]
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"side channel address {address!r} has no valid port")
    return address


@dataclasses.dataclass
class Peer:
    """One exporter. Ready once its handshake reply passed every check."""

    address: str
    sock: zmq.Socket
    instance_id: str = ""
    agent_name: str = ""  # NIXL name, unique per exporter instance
    spec: PoolSpec | None = None
    fingerprint: proto.Fingerprint | None = None
    mismatch: str = ""  # non-empty: incompatible, every pull fails with this message
    hs_seq: int = -1  # handshake in flight when >= 0
    hs_deadline: float = 0.0
    hs_time: float = -1.0  # monotonic time of the last good handshake

    @property
    def is_ready(self) -> bool:
        return bool(self.instance_id) and self.hs_seq < 0

    @classmethod
    def connect(cls, ctx: zmq.Context, address: str, max_msg_bytes: int,
                keys: ClusterKeys | None = None) -> Peer:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)
        if keys is not None:
            keys.apply_client(sock)
        sock.connect(address)
        return cls(address, sock)


def check_handshake(reply: proto.HandshakeReply, local: PoolSpec,
                    fingerprint: proto.Fingerprint) -> tuple[PoolSpec, str]:
    """(remote pool, mismatch text) from a handshake reply; ValueError if it is malformed."""
    if not reply.instance_id or not reply.agent_name or not reply.agent_metadata:
        raise ValueError("handshake reply lacks instance id, agent name or metadata")
    if len(reply.instance_id) > 64 or len(reply.agent_name) > 256:
        raise ValueError("handshake reply ids too long")
    if reply.num_blocks > (1 << 40) or reply.block_bytes > (1 << 40):
        raise ValueError(f"pool shape {reply.num_blocks}x{reply.block_bytes} out of range")
    remote = PoolSpec(reply.base_address, reply.num_blocks * reply.block_bytes,
                      reply.num_blocks, reply.block_bytes, reply.mem_type, reply.device_id)
    differs = fingerprint_mismatch(fingerprint, reply.fingerprint)
    if differs:
        return remote, (f"peer {reply.engine_id} computes other KV: {differs} (peer "
                        f"{reply.fingerprint.describe()}, here {fingerprint.describe()})")
    if remote.block_bytes != local.block_bytes:
        return remote, (f"peer {reply.engine_id} block_bytes={remote.block_bytes} "
                        f"!= local block_bytes={local.block_bytes}")
    return remote, ""
