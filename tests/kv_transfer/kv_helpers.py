"""Shared by the kv_transfer tests: pool accounting, waits and the leak check.

(Not in conftest.py: several test folders have one, and "from conftest import" is ambiguous.)
"""

from __future__ import annotations

import time

import kv_peer
import numpy as np

from kv_transfer import KVImporter
from kv_transfer.auth import keys_from_env

NUM_BLOCKS = 64
BLOCK_BYTES = 16384
# Short timeouts so a dead peer shows within a second or two.
# With the session's cluster keys (tests/conftest.py): the side channel is CURVE, as in Baton.
FAST = dict(rpc_timeout_s=1.0, transfer_timeout_s=5.0, claim_ttl_s=8.0, lease_ttl_s=20.0,
            keys=keys_from_env())


class LocalPool:
    """The importer's pool plus the free-block accounting a completion engine would keep."""

    def __init__(self, num_blocks: int = NUM_BLOCKS, block_bytes: int = BLOCK_BYTES) -> None:
        self.data = np.zeros((num_blocks, block_bytes), dtype=np.uint8)
        self.free = list(range(1, num_blocks))

    def allocate(self, n: int) -> list[int]:
        ids, self.free = self.free[:n], self.free[n:]
        assert len(ids) == n
        self.data[ids] = 0
        return ids

    def release(self, ids: list[int]) -> None:
        assert not set(ids) & set(self.free)
        self.free.extend(ids)

    def is_exact(self, ids: list[int], seed: int) -> bool:
        return all(np.array_equal(self.data[b], kv_peer.pattern(seed, i, self.data.shape[1]))
                   for i, b in enumerate(ids))


def wait_until(pred, timeout: float = 3.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


def assert_whole(peer: kv_peer.PeerProcess, importer: KVImporter, local: LocalPool) -> None:
    """Nothing leaked on either side: every block free, no lease, no pull left."""
    assert wait_until(lambda: peer.stats()[:2] == (peer.num_blocks - 1, 0)), peer.stats()
    assert importer.num_pending() == 0
    assert sorted(local.free) == list(range(1, local.data.shape[0]))
