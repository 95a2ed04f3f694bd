"""The local disk tier below the KV pool (docs/scheduler.md P10; files: kv_disk_store.py).

A keyed block's life across the two tiers, all on the engine's thread but the two I/O threads:

1. Spill: after every scheduler call that can allocate (a step's `schedule`, a completion
   engine's `allocate_prompted`, an adoption) `spill()` drains the scheduler's log of blocks
   evicted for reuse, copies their bytes out of the pool (`Runner.read_blocks`) before anything
   rewrites them, and queues those not on disk yet for the writer thread. The queue is bounded
   in bytes: past it a spill is dropped (counted), so the step loop never waits on the disk.
   The writer appends each batch to a segment file in one sequential write.
2. Plan: a new prompt whose full blocks past the pool's run are on disk (`plan`) is queued
   unschedulable (S15: it holds the head of `waiting`) and its blocks go to the reader thread,
   which reads them and checks checksum, producer fingerprint, key chain and tokens.
3. Land: before the next `schedule`, `land()` adopts what was read into the pool (P10: keyed,
   cached-free), writes the bytes (`Runner.write_blocks`) and makes the prompt schedulable;
   its admission hits the blocks like any cached block (P3), and `cached_tokens` counts them.
   A completion engine loads the same way but at once (`load_now`), before `allocate_prompted`
   pins the run: the blocks it finds need no pull.
4. Any failure (a refused block, an I/O error, a full disk, no room in the pool) is a miss:
   the prompt computes what it did not get, a warning says why; never a failed request.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from baton.engine.block_keys import compute_block_keys
from baton.engine.kv_disk_store import DiskStore

logger = logging.getLogger(__name__)

# Bytes of copied blocks waiting for the writer; past it spills are dropped.
DEFAULT_QUEUE_BYTES = 256 << 20
WARN_EVERY_S = 30.0  # an I/O error is logged at most this often (each is counted)


@dataclass
class LoadJob:
    """One prompt's blocks [first_block, first_block + len(keys)) to read from disk."""

    request_id: str
    token_ids: np.ndarray  # int32: the prompt through the last block to load
    seed: int
    first_block: int
    keys: np.ndarray
    reserve: int  # pool blocks the rest of the prompt still needs
    data: np.ndarray | None = None  # uint8 [r, block_bytes], r <= len(keys): verified blocks
    seconds: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)


class DiskTier:
    """One engine's disk tier: its store, its writer and reader threads, the engine glue."""

    def __init__(self, store: DiskStore, scheduler, runner,
                 queue_bytes: int = DEFAULT_QUEUE_BYTES) -> None:
        self.store, self.scheduler, self.runner = store, scheduler, runner
        self.block_size = store.block_size
        self.queue_bytes = queue_bytes
        self._writes: queue.Queue = queue.Queue()
        self._reads: queue.Queue = queue.Queue()
        self._finished: deque[LoadJob] = deque()
        self._pending: dict[str, LoadJob] = {}
        self._queued_bytes = 0
        self._generation = 0  # a clear() drops what was queued before it
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._last_warning = 0.0
        # Counters (stats.extra kv_tier_*_disk and kv_integrity_failures_disk).
        self.num_written_blocks = 0
        self.num_dropped_blocks = 0
        self.num_errors = 0
        self.num_loaded_blocks = 0  # adopted into the pool
        self.num_loads = 0
        self.load_seconds = 0.0
        self.num_missed_blocks = 0  # planned but not loaded (refused, evicted, no room)
        scheduler.set_spill_capacity(4 * scheduler.num_total_blocks())
        self._threads = [threading.Thread(target=self._write_loop, name="kv-disk-writer",
                                          daemon=True),
                         threading.Thread(target=self._read_loop, name="kv-disk-reader",
                                          daemon=True)]
        for t in self._threads:
            t.start()

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

    def _warn(self, msg: str, *args) -> None:
        now = time.monotonic()
        if now - self._last_warning >= WARN_EVERY_S:
            self._last_warning = now
            logger.warning(msg, *args)

    # ------------------------------------------------------------------ 2. plan
    def plan(self, request_id: str, token_ids, seed: int) -> bool:
        """A new prompt: True when blocks past the pool's run are on disk and are being read
        (the caller queues it unschedulable until `land` makes it schedulable)."""
        job = self._job(request_id, token_ids, seed)
        if job is None:
            return False
        self._pending[request_id] = job
        self._reads.put(job)
        return True

    def _job(self, request_id: str, token_ids, seed: int) -> LoadJob | None:
        bs = self.block_size
        token_ids = np.asarray(token_ids, dtype=np.int32)
        max_hits = (len(token_ids) - 1) // bs  # the last token is always computed (P3)
        if max_hits <= 0:
            return None
        keys = compute_block_keys(token_ids[:max_hits * bs], bs, seed)
        held = self.scheduler.num_held_prefix_blocks(keys)
        num = self.store.run_length(keys, held)
        reserve = -(-len(token_ids) // bs) - held - num
        num = min(num, self.scheduler.num_total_blocks() - held - reserve)
        if num <= 0:
            return None
        return LoadJob(request_id, token_ids[:(held + num) * bs], int(seed), held,
                       keys[held:held + num], reserve)

    def _read_loop(self) -> None:
        while True:
            job = self._reads.get()
            if job is None:
                return
            self._read(job)
            self._finished.append(job)
            job.done.set()
            self._wake.set()

    def _read(self, job: LoadJob) -> None:
        t0 = time.perf_counter()
        bs, first = self.block_size, job.first_block
        tokens = job.token_ids[first * bs:].reshape(-1, bs)
        try:
            job.data = self.store.read(job.keys.tolist(), tokens)
        except Exception as exc:  # a miss, never a failed request
            logger.warning("KV disk tier: load for %s failed (%s): recomputing",
                           job.request_id, exc)
            job.data = np.empty((0, self.store.block_bytes), dtype=np.uint8)
        job.seconds = time.perf_counter() - t0

    # ------------------------------------------------------------------ 3. land
    @property
    def num_pending(self) -> int:
        """Prompts waiting for their disk reads."""
        return len(self._pending)

    def land(self, wait_s: float = 0.0) -> None:
        """Adopt every finished read and make its prompt schedulable; `wait_s`: block that
        long for one when nothing has finished (an engine with nothing else to run)."""
        if wait_s and self._pending and not self._finished:
            self._wake.wait(wait_s)
        self._wake.clear()
        while self._finished:
            job = self._finished.popleft()
            if self._pending.get(job.request_id) is not job:
                continue  # aborted meanwhile
            del self._pending[job.request_id]
            self._adopt(job)
            self.scheduler.set_schedulable(job.request_id, True)

    def load_now(self, token_ids, seed: int) -> None:
        """Load a prompt's blocks past the pool's run at once (a completion engine's
        admission, which must know before it allocates what it will not pull)."""
        job = self._job("", token_ids, seed)
        if job is not None:
            self._read(job)
            self._adopt(job)

    def _adopt(self, job: LoadJob) -> None:
        self.num_loads += 1
        self.load_seconds += job.seconds
        num = len(job.data)
        self.num_missed_blocks += len(job.keys) - num
        if num == 0:
            return
        t0 = time.perf_counter()
        end = (job.first_block + num) * self.block_size
        ids = self.scheduler.adopt_blocks(job.token_ids[:end], job.seed, job.first_block,
                                          job.reserve)
        self.spill()  # the adoption may have evicted: those bytes leave before these land
        ok = ids >= 0
        if ok.any():
            self.runner.write_blocks(ids[ok], job.data[:len(ids)][ok])
        self.num_loaded_blocks += int(ok.sum())
        self.num_missed_blocks += num - int(ok.sum())
        self.load_seconds += time.perf_counter() - t0

    def forget(self, request_id: str) -> None:
        """An aborted request: its read, if any, is not adopted."""
        self._pending.pop(request_id, None)

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
                "kv_tier_hit_tokens_disk": float(self.num_loaded_blocks * self.block_size),
                "kv_tier_loaded_blocks_disk": float(self.num_loaded_blocks),
                "kv_tier_missed_blocks_disk": float(self.num_missed_blocks),
                "kv_tier_loads_disk": float(self.num_loads),
                "kv_tier_load_seconds_disk": self.load_seconds,
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
        self._reads.put(None)
        for t in self._threads:
            t.join(timeout=5.0)
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
