"""KV integrity: the one checksum of a KV block, the reader of a pool's blocks, and the test-only
fault plan that proves the checks work.

What must match for two pools' blocks to be interchangeable is the `Fingerprint` (a wire type,
so it lives in protocol.py); what must match for one block to be the one its producer computed
is its checksum, taken here. Every tier that moves or keeps KV blocks uses both: the hand-off
(the exporter checksums a prompt's blocks when it leases them, the importer verifies what
landed before the request may decode), and later a disk or a shared tier (a block written
with its checksum and the producer's fingerprint, verified when read back).

    producer (prompt engine)                         consumer (completion engine)
    prefill -> hold(): checksums(blocks) -> handle   pull lands -> verify(landed, checksums)
                                                     -> DONE, or FAILED checksum_mismatch

The checksum is CRC-32 (zlib): xxhash is not a dependency, and CRC-32 finds any flipped bit
and any torn run shorter than 32 bits for sure, and the rest with odds of 2^-32 per block.
It is not a defence against an attacker (the wires are authenticated for that), only against
bugs and bad memory. Measured: 260 us per 720 KiB block (SmolLM2-135M, float32) at load 6.8
on this 2-core host, 2.8 GB/s. Per prompt (bench/kv_integrity_bench.py, load 6-8): hold() of
a 1024-token prompt 21.6 ms with checksums against 0.08 ms without, and its pull 31.0 ms
against 13.4 ms, both next to a 12.1 s prefill (one torch thread): 0.3% of the time to first
token together, hence "all" by default.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kv_transfer.config import CHECKSUM_MODES, PoolSpec
from kv_transfer.protocol import Fingerprint

logger = logging.getLogger(__name__)

# The "sample" mode of CHECKSUM_MODES: one handed-off prompt in this many carries checksums
# (whole prompts, so a fault tied to a block's place in a prompt is still caught).
SAMPLE_EVERY = 8
# The test-only faults come from this environment variable of the engine process, never from a
# socket (see FaultPlan).
FAULTS_ENV = "BATON_TEST_KV_FAULTS"


def checksum(data: Any) -> int:
    """The checksum of one block's bytes (any buffer): an unsigned 32-bit int."""
    return zlib.crc32(data)


class BlockReader:
    """The bytes of a pool's blocks: host memory is read in place (no copy), a GPU pool's block
    is copied to the host first (the tensor's own `.cpu()`: kv_transfer imports no torch)."""

    def __init__(self, pool: Any, spec: PoolSpec | None = None) -> None:
        self.spec = spec or PoolSpec.of(pool)
        self._pool = pool  # keeps the memory alive

    def block(self, block_id: int) -> Any:
        """A buffer over block `block_id`'s bytes, valid while the block is not rewritten."""
        spec = self.spec
        assert 0 < block_id < spec.num_blocks, block_id
        if spec.mem_type == "DRAM":
            return memoryview((ctypes.c_char * spec.block_bytes).from_address(
                spec.block_address(block_id))).cast("B")
        host = self._pool[block_id].contiguous().cpu()
        return ctypes.string_at(host.data_ptr(), spec.block_bytes)

    def checksums(self, block_ids: Sequence[int]) -> list[int]:
        return [checksum(self.block(b)) for b in block_ids]

    def mismatches(self, block_ids: Sequence[int], expected: Sequence[int]) -> list[int]:
        """Positions i where block_ids[i]'s bytes do not have the checksum expected[i]."""
        assert len(block_ids) == len(expected)
        return [i for i, (b, want) in enumerate(zip(block_ids, expected, strict=True))
                if checksum(self.block(b)) != want]

    def invert(self, block_id: int) -> None:
        """Invert every byte of a host block (K/V values a decode cannot miss): only FaultPlan's
        hook calls this."""
        assert self.spec.mem_type == "DRAM", "fault injection needs a host pool"
        data = np.frombuffer(self.block(block_id), dtype=np.uint8)
        np.bitwise_not(data, out=data)


def fingerprint_mismatch(ours: Fingerprint, theirs: Fingerprint) -> str:
    """"" when blocks computed under `theirs` may be used as ours, else the fields that
    differ (theirs != ours), for the reason a refusal gives."""
    fields = [f for f in ours.__struct_fields__ if getattr(ours, f) != getattr(theirs, f)]
    return ", ".join(f"{f} {getattr(theirs, f)!r} != {getattr(ours, f)!r}" for f in fields)


def checksum_for(mode: str, ordinal: int) -> bool:
    """Whether the `ordinal`-th (from 1) handed-off prompt carries checksums in `mode`."""
    assert mode in CHECKSUM_MODES, mode
    return mode == "all" or (mode == "sample" and ordinal % SAMPLE_EVERY == 1)


@dataclasses.dataclass(frozen=True)
class FaultPlan:
    """Faults a test arms in an engine process to see the integrity checks catch them.

    Read once from the process's environment (`FAULTS_ENV`, e.g. "corrupt_pull=2,3"), never
    from a request or a side-channel message: nothing on a wire can arm it. The process logs a
    warning when any fault is armed.
    """

    # Pulls (1-based, in the order they land) whose first landed block is inverted after the
    # NIXL read and before the checksum verification.
    corrupt_pulls: frozenset[int] = frozenset()
    # The exporter advertises other weights in its handshake, as an engine that loaded another
    # file under the same name would.
    foreign_weights: bool = False

    @property
    def is_armed(self) -> bool:
        return bool(self.corrupt_pulls) or self.foreign_weights

    @classmethod
    def parse(cls, text: str) -> FaultPlan:
        """"corrupt_pull=N[,N...]" and/or "foreign_weights", separated by ";"."""
        corrupt: set[int] = set()
        foreign = False
        for item in filter(None, (part.strip() for part in text.split(";"))):
            name, _, value = item.partition("=")
            if name == "corrupt_pull":
                try:
                    corrupt.update(int(v) for v in value.split(","))
                except ValueError:
                    raise ValueError(f"{FAULTS_ENV}: bad pull numbers in {item!r}") from None
            elif name == "foreign_weights" and not value:
                foreign = True
            else:
                raise ValueError(f"{FAULTS_ENV}: unknown fault {item!r} (corrupt_pull=N, "
                                 "foreign_weights)")
        if any(n < 1 for n in corrupt):
            raise ValueError(f"{FAULTS_ENV}: pull numbers start at 1, got {sorted(corrupt)}")
        return cls(frozenset(corrupt), foreign)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> FaultPlan:
        plan = cls.parse(environ.get(FAULTS_ENV, ""))
        if plan.is_armed:
            logger.warning("TEST FAULTS ARMED (%s=%r): this process corrupts KV on purpose",
                           FAULTS_ENV, environ[FAULTS_ENV])
        return plan
