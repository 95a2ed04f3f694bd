"""The agent wrapper's WRITE op (the push direction), two agents in one process."""

from __future__ import annotations

import time

import numpy as np

from kv_transfer import PoolSpec
from kv_transfer.agent import NixlAgent


def test_write_pushes_merged_runs_and_notifies():
    src = np.arange(9 * 4096, dtype=np.uint8).reshape(9, 4096)
    dst = np.zeros_like(src)
    a = NixlAgent("write-src", PoolSpec.of(src), {})
    b = NixlAgent("write-dst", PoolSpec.of(dst), {})
    try:
        peer = a.add_peer(b.metadata)
        xfer, num_descs, state = a.post("WRITE", peer, b.pool, [1, 2, 3, 7], [4, 5, 6, 1], b"n1")
        assert num_descs == 2
        end = time.monotonic() + 5
        notes: dict = {}
        while (state != "DONE" or not notes) and time.monotonic() < end:
            state = state if state == "DONE" else a.check(xfer)
            for k, v in b.notifs().items():
                notes.setdefault(k, []).extend(v)
        a.release(xfer)
        assert state == "DONE" and notes == {"write-src": [b"n1"]}
        assert np.array_equal(dst[[4, 5, 6, 1]], src[[1, 2, 3, 7]])
        assert not dst[[0, 2, 3, 7, 8]].any()
    finally:
        a.close()
        b.close()
