"""The local disk tier below the KV pool (docs/scheduler.md P10; files: kv_disk_store.py).

A keyed block's life across the two tiers, all on the engine's thread but the two I/O threads:

1. Spill: after every scheduler call that can allocate (a step's `schedule`, a completion
   engine's `allocate_prompted`, an adoption) `spill()` drains the scheduler's log of blocks
   evicted for reuse, copies their bytes out of the pool (`Runner.read_blocks`) before anything
   rewrites them, and queues those not on disk yet for the writer thread. The queue is bounded
   in bytes: past it a spill is dropped (counted), so the step loop never waits on the disk.
   The writer appends each batch to a segment file in one sequential write.
2. Load: a new prompt whose full blocks past the pool's run are on disk is read and adopted
   by the load path every tier shares (baton/engine/kv_tier.py: plan, land, load_now).
3. Any failure (a refused block, an I/O error, a full disk, no room in the pool) is a miss:
   the prompt computes what it did not get, a warning says why; never a failed request.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np

from baton.engine.kv_disk_store import DiskStore
from baton.engine.kv_tier import TierLoader

logger = logging.getLogger(__name__)

# Bytes of copied blocks waiting for the writer; past it spills are dropped.
DEFAULT_QUEUE_BYTES = 256 << 20


class DiskTier(TierLoader):
    """One engine's disk tier: its store and the spills; the reader, the writer's queue and
    the load path are TierLoader's."""

    name = "disk"

    def __init__(self, store: DiskStore, scheduler, runner,
                 queue_bytes: int = DEFAULT_QUEUE_BYTES) -> None:
        self.num_errors = 0  # failed writes (stats.extra kv_tier_errors_disk)
        scheduler.set_spill_capacity(4 * scheduler.num_total_blocks())
        super().__init__(store, scheduler, runner, queue_bytes)

    def describe(self) -> str:
        store = self.store
        return (f"disk {store.directory}: {len(store.index)} blocks ({store.num_bytes / 2**20:.1f}"
                f" MiB) in {len(store.segments)} files, budget {store.budget_bytes / 2**20:.1f}"
                f" MiB (~{store.capacity_blocks} blocks)")

    # ------------------------------------------------------------------ 1. spill
    def spill(self, wait: bool = False) -> None:
        """Copy out the blocks evicted since the last call; the writer keeps them. `wait`:
        for room in the queue instead of dropping (an engine closing)."""
        keys, parents, ids, tokens = self.scheduler.drain_spills()
        if wait:
            step = max(1, self.queue_bytes // (2 * self.store.block_bytes))
            for i in range(0, len(keys), step):
                while self._queued_bytes and self._queued_bytes + step * self.store.block_bytes \
                        > self.queue_bytes:
                    time.sleep(0.005)
                self._queue(keys[i:i + step], parents[i:i + step], ids[i:i + step],
                            tokens[i:i + step])
            return
        self._queue(keys, parents, ids, tokens)

    def _queue(self, keys, parents, ids, tokens) -> None:
        if not len(keys):
            return
        keep = np.fromiter((not self.store.has(int(k)) for k in keys), bool, len(keys))
        if keep.any():
            super()._queue(keys[keep], parents[keep], ids[keep], tokens[keep])

    def _write(self, keys, parents, tokens, data) -> int:
        return self.store.append(keys, parents, tokens, data)

    def _write_failed(self, exc: OSError, num_blocks: int) -> None:
        self.num_errors += 1
        self._warn("KV disk tier: writing %d blocks failed (%s); they will be recomputed when "
                   "needed", num_blocks, exc)

    def after_adopt(self) -> None:
        self.spill()  # the adoption may have evicted: those bytes leave before these land

    # ------------------------------------------------------------------ stats, close
    def stats(self) -> dict[str, float]:
        store = self.store
        return {"kv_tier_blocks_disk": float(len(store.index)),
                "kv_tier_bytes_disk": float(store.num_bytes),
                "kv_tier_capacity_bytes_disk": float(store.budget_bytes),
                **self.load_stats(),
                "kv_tier_written_blocks_disk": float(self.num_written_blocks),
                "kv_tier_dropped_blocks_disk": float(self.num_dropped_blocks
                                                     + self.scheduler.num_spills_dropped()),
                "kv_tier_errors_disk": float(self.num_errors),
                "kv_integrity_failures_disk": float(store.num_integrity_failures)}

    def close(self) -> None:
        super().close()
        self.store._close_open()


def open_disk_tier(directory: str, budget_bytes: int, fingerprint, block_bytes: int,
                   scheduler, runner) -> DiskTier | None:
    """The tier over `directory` (its index rebuilt from the files there), or None with a
    warning when the directory cannot be used: the engine then recomputes, as without one."""
    store = DiskStore(Path(directory), budget_bytes, fingerprint, block_bytes)
    try:
        store.open()
    except OSError as exc:
        logger.warning("KV disk tier off: %s is not usable (%s); evicted blocks will be "
                       "recomputed", directory, exc)
        return None
    return DiskTier(store, scheduler, runner)
