"""Block-id validation and descriptor building: every id from a socket passes here before NIXL."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np

from kv_transfer.config import PoolSpec
from kv_transfer.errors import BadHandleError


def check_block_ids(block_ids: Sequence[int], num_blocks: int, what: str) -> list[int]:
    """Return block_ids as a list of ints if each lies in 1..num_blocks-1 and none repeats."""
    ids = []
    for b in block_ids:
        # bool is an int subclass; a True on the wire is a bug, not block 1.
        try:
            i = -1 if isinstance(b, bool) else operator.index(b)
        except TypeError:
            i = -1
        if not 1 <= i < num_blocks:
            raise BadHandleError(f"{what}: block id {b!r} outside 1..{num_blocks - 1}")
        ids.append(i)
    if not ids:
        raise BadHandleError(f"{what}: empty block id list")
    if len(set(ids)) != len(ids):
        raise BadHandleError(f"{what}: duplicate block ids")
    return ids


def merge_runs(local_ids: Sequence[int], remote_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(local_start, remote_start, count) runs where both sides advance by one block together:
    each run becomes one descriptor, since NIXL costs ~4 us per descriptor."""
    assert len(local_ids) == len(remote_ids)
    runs: list[tuple[int, int, int]] = []
    for loc, rem in zip(local_ids, remote_ids, strict=True):
        if runs:
            l0, r0, n = runs[-1]
            if loc == l0 + n and rem == r0 + n:
                runs[-1] = (l0, r0, n + 1)
                continue
        runs.append((loc, rem, 1))
    return runs


def descriptor_rows(
    runs: list[tuple[int, int, int]], local: PoolSpec, remote: PoolSpec
) -> tuple[np.ndarray, np.ndarray]:
    """Nx3 uint64 (address, length, device id) arrays for the local and the remote side."""
    arr = np.asarray(runs, dtype=np.uint64).reshape(-1, 3)
    loc = np.zeros_like(arr)
    rem = np.zeros_like(arr)
    loc[:, 0] = np.uint64(local.address) + arr[:, 0] * np.uint64(local.block_bytes)
    rem[:, 0] = np.uint64(remote.address) + arr[:, 1] * np.uint64(remote.block_bytes)
    loc[:, 1] = rem[:, 1] = arr[:, 2] * np.uint64(local.block_bytes)
    loc[:, 2], rem[:, 2] = local.device_id, remote.device_id
    return loc, rem
