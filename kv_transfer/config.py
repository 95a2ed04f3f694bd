"""TransferConfig and PoolSpec: the typed inputs of the exporter and the importer."""

from __future__ import annotations

import dataclasses
import ipaddress
from typing import Any

from kv_transfer.auth import ClusterKeys

OPS = ("READ", "WRITE")
MEM_TYPES = ("DRAM", "VRAM")  # NIXL memory types: host memory, a GPU's memory
# Which handed-off prompts carry block checksums (kv_transfer/integrity.py): every one, one in
# integrity.SAMPLE_EVERY, none. The producer decides; an importer verifies whatever it gets.
CHECKSUM_MODES = ("all", "sample", "off")


@dataclasses.dataclass
class TransferConfig:
    # Interface the side channel binds to; loopback unless the operator opens it up.
    host: str = "127.0.0.1"
    # Side-channel TCP port; 0 picks an ephemeral one (read it back from exporter.address).
    side_channel_port: int = 0
    # Seconds an unclaimed lease lives before its blocks are freed.
    lease_ttl_s: float = 30.0
    # Seconds a claimed lease waits for the release note before the exporter frees it anyway;
    # longer than transfer_timeout_s so blocks are never freed under a live reader.
    claim_ttl_s: float = 60.0
    # Seconds to wait for a side-channel answer (handshake, claim); silence means peer_gone.
    rpc_timeout_s: float = 1.5
    # Seconds a posted NIXL transfer may take before it is cancelled and fails with timeout.
    transfer_timeout_s: float = 30.0
    # Poll period of the poller thread while work is pending (NIXL progress thread is off).
    poll_interval_s: float = 0.001
    # NIXL op: READ = the completion side pulls (the default, and the only one KVImporter
    # runs today); WRITE (push) is available through NixlAgent.post, not yet as a flow.
    op: str = "READ"
    # Largest side-channel frame accepted (ids lists and agent metadata are bounded by it).
    max_msg_bytes: int = 8 << 20
    # Environment for UCX, applied before the NIXL agent starts (e.g. {"UCX_TLS": "^cma"}).
    ucx_env: dict[str, str] = dataclasses.field(default_factory=dict)
    # CURVE keys of the side channel (kv_transfer/auth.py): the exporter serves with the server
    # pair and admits only the cluster's client key, the importer dials with the client pair.
    # None = plain TCP, for benchmarks and tests of the insecure mode only.
    keys: ClusterKeys | None = None
    # The exporter's checksum policy (CHECKSUM_MODES): "all" adds 0.1-0.4% of a prompt's
    # prefill on each side of the hand-off (bench/kv_integrity_bench.py).
    checksum: str = "all"

    def __post_init__(self) -> None:
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            if not self.host or "*" in self.host:
                raise ValueError(f"host={self.host!r} is not an address or host name") from None
        if not 0 <= self.side_channel_port <= 65535:
            raise ValueError(f"side_channel_port={self.side_channel_port} not in 0..65535")
        for name in ("lease_ttl_s", "claim_ttl_s", "rpc_timeout_s", "transfer_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        if not 0 < self.poll_interval_s <= 0.1:
            raise ValueError(f"poll_interval_s={self.poll_interval_s} not in (0, 0.1]")
        if self.claim_ttl_s <= self.transfer_timeout_s:
            raise ValueError(
                f"claim_ttl_s={self.claim_ttl_s} must exceed "
                f"transfer_timeout_s={self.transfer_timeout_s}"
            )
        if self.op not in OPS:
            raise ValueError(f"op={self.op!r} not one of {OPS}")
        if self.checksum not in CHECKSUM_MODES:
            raise ValueError(f"checksum={self.checksum!r} not one of {list(CHECKSUM_MODES)}")
        if self.max_msg_bytes < 4096:
            raise ValueError(f"max_msg_bytes={self.max_msg_bytes} below 4096")
        for key, value in self.ucx_env.items():
            if not (key.startswith("UCX_") or key.startswith("NIXL_")):
                raise ValueError(f"ucx_env key {key!r} is not a UCX_/NIXL_ variable")
            if not isinstance(value, str):
                raise ValueError(f"ucx_env[{key!r}]={value!r} is not a string")


@dataclasses.dataclass(frozen=True)
class PoolSpec:
    """A block-major KV pool as one contiguous host buffer.

    address                                                    address + nbytes
    |  block 0 (null)  |  block 1  |  block 2  | ... | block num_blocks-1 |
    each block = [layers, 2, block_size, kv_heads, head_dim] elements = block_bytes

    The buffer lives where its tensor does: host memory (NIXL DRAM) or GPU `device_id`'s
    memory (NIXL VRAM, a CUDA tensor); NIXL registers and moves it by that memory type.
    """

    address: int
    nbytes: int
    num_blocks: int
    block_bytes: int
    mem_type: str = "DRAM"
    device_id: int = 0  # the GPU index for VRAM; 0 for DRAM

    def __post_init__(self) -> None:
        if self.address <= 0:
            raise ValueError(f"address={self.address} must be > 0")
        if self.num_blocks < 2:
            raise ValueError(f"num_blocks={self.num_blocks} < 2 (block 0 is the null block)")
        if self.block_bytes <= 0:
            raise ValueError(f"block_bytes={self.block_bytes} must be > 0")
        if self.nbytes != self.num_blocks * self.block_bytes:
            raise ValueError(
                f"nbytes={self.nbytes} != num_blocks={self.num_blocks} * "
                f"block_bytes={self.block_bytes}"
            )
        if self.mem_type not in MEM_TYPES:
            raise ValueError(f"mem_type={self.mem_type!r} is not one of {list(MEM_TYPES)}")
        if not 0 <= self.device_id < 1024:
            raise ValueError(f"device_id={self.device_id} out of range")

    @classmethod
    def of(cls, pool: Any) -> PoolSpec:
        """Accept a PoolSpec, a contiguous torch tensor (host or CUDA memory) or a contiguous
        numpy array whose first dimension is the block dimension."""
        if isinstance(pool, PoolSpec):
            return pool
        if hasattr(pool, "data_ptr"):  # torch.Tensor
            if not pool.is_contiguous():
                raise ValueError("KV pool tensor must be contiguous")
            kind = pool.device.type
            if kind not in ("cpu", "cuda"):
                raise ValueError(f"KV pool on {pool.device}: NIXL takes host or CUDA memory")
            nbytes = pool.numel() * pool.element_size()
            return cls(pool.data_ptr(), nbytes, pool.shape[0], nbytes // pool.shape[0],
                       "DRAM" if kind == "cpu" else "VRAM",
                       0 if kind == "cpu" else pool.device.index or 0)
        if hasattr(pool, "__array_interface__"):  # numpy.ndarray
            if not pool.flags["C_CONTIGUOUS"]:
                raise ValueError("KV pool array must be C-contiguous")
            addr = pool.__array_interface__["data"][0]
            return cls(addr, pool.nbytes, pool.shape[0], pool.nbytes // pool.shape[0])
        raise ValueError(f"unsupported pool type {type(pool).__name__}")

    def block_address(self, block_id: int) -> int:
        return self.address + block_id * self.block_bytes
