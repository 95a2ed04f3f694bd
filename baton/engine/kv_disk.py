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
import queue
import threading
import time
from pathlib import Path

import numpy as np

from baton.engine.kv_disk_store import DiskStore
from baton.engine.kv_tier import TierLoader

logger = logging.getLogger(__name__)

# Bytes of copied blocks waiting for the writer; past it spills are dropped.
DEFAULT_QUEUE_BYTES = 256 << 20


class DiskTier(TierLoader):
    """One engine's disk tier: its store, its writer thread, the spills; the reader and the
    load path are TierLoader's."""

    name = "disk"

    def __init__(self, store: DiskStore, scheduler, runner,
                 queue_bytes: int = DEFAULT_QUEUE_BYTES) -> None:
        super().__init__(store, scheduler, runner)
        self.queue_bytes = queue_bytes
        self._writes: queue.Queue = queue.Queue()
        self._queued_bytes = 0
        self._generation = 0  # a clear() drops what was queued before it
        self._lock = threading.Lock()
        # Counters (stats.extra kv_tier_*_disk and kv_integrity_failures_disk).
        self.num_written_blocks = 0
        self.num_dropped_blocks = 0
        self.num_errors = 0
        scheduler.set_spill_capacity(4 * scheduler.num_total_blocks())
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer",
                                        daemon=True)
        self._writer.start()

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
        if not keep.any():
            return
        keys, parents, ids, tokens = keys[keep], parents[keep], ids[keep], tokens[keep]
        nbytes = len(ids) * self.store.block_bytes
        with self._lock:
            if self._queued_bytes + nbytes > self.queue_bytes:
                self.num_dropped_blocks += len(ids)
                return
            self._queued_bytes += nbytes
        data = self.runner.read_blocks(ids)
        self._writes.put((self._generation, keys.copy(), parents.copy(), tokens.copy(), data))

    def _write_loop(self) -> None:
        while True:
            item = self._writes.get()
            if item is None:
                return
            if item == "clear":
                self.store.clear()
                continue
            generation, keys, parents, tokens, data = item
            try:
                if generation == self._generation:
                    self.num_written_blocks += self.store.append(keys, parents, tokens, data)
            except OSError as exc:
                self.num_errors += 1
                self.num_dropped_blocks += len(keys)
                self._warn("KV disk tier: writing %d blocks failed (%s); they will be "
                           "recomputed when needed", len(keys), exc)
            finally:
                with self._lock:
                    self._queued_bytes -= data.nbytes

    def after_adopt(self) -> None:
        self.spill()  # the adoption may have evicted: those bytes leave before these land

    # ------------------------------------------------------------------ reset, stats, events
    def clear(self) -> None:
        """Forget every block on disk now; the writer deletes the files."""
        self._generation += 1
        with self.store.lock:
            for key in self.store.index:
                self.store._note(key, stored=False)
            self.store.index.clear()
        self._writes.put("clear")

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

    def drain_events(self) -> tuple[list[int], list[int]]:
        return self.store.drain_events()

    def keys(self) -> list[int]:
        return self.store.keys()

    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until the writer has written what was queued (tests, benchmarks, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while (self._queued_bytes or not self._writes.empty()) and time.monotonic() < deadline:
            time.sleep(0.005)

    def close(self) -> None:
        self.flush()
        self._writes.put(None)
        self._writer.join(timeout=5.0)
        self.stop_reader()
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
