"""What every KV tier below the pool shares (docs/scheduler.md P10, P11): the load path, the
write queue and the KV events' ledger.

A tier (the disk's, kv_disk.py; the shared cluster store's, kv_shared.py) has a store that
answers `run_length(keys, start)` (how many of a chain's blocks it may hold), `read(keys,
tokens)` (the verified run of them), `keys()`, `forget_all()` and `clear()`, and keeps its KV
events in a `KeyLedger`. This base gives it the rest, on the engine's thread but for its reader
and writer threads:

1. Plan: a new prompt whose full blocks past the pool's run may be in the tier (`plan`) is
   queued unschedulable (S15: it holds the head of `waiting`) and its blocks go to the reader
   thread, which reads and checks them (checksum, producer fingerprint, key chain, tokens).
2. Land: before the next `schedule`, `land()` adopts what was read into the pool (P10: keyed,
   cached-free), writes the bytes (`Runner.write_blocks`) and makes the prompt schedulable; its
   admission hits the blocks like any cached block (P3), and `cached_tokens` counts them. A
   read past the tier's `timeout_s` is given up: the prompt computes, never waits longer.
   A completion engine loads the same way but at once (`load_now`), before `allocate_prompted`
   pins the run: the blocks it finds need no pull.
3. Any failure (a refused block, an I/O error, a store that is down, no room in the pool) is
   a miss: the prompt computes what it did not get; never a failed request.
4. Write: blocks a tier keeps (the disk's spills, the shared tier's published blocks) are
   copied out of the pool (`Runner.read_blocks`) into a queue bounded in bytes (past it they
   are dropped, counted: the step loop never waits on a store); the writer thread hands each
   batch to the subclass's `_write`. `clear()` drops what was queued before it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from baton.engine.block_keys import compute_block_keys

WARN_EVERY_S = 30.0  # an I/O error is logged at most this often (each is counted)


@dataclass
class LoadJob:
    """One prompt's blocks [first_block, first_block + len(keys)) to read from a tier."""

    request_id: str
    token_ids: np.ndarray  # int32: the prompt through the last block to load
    seed: int
    first_block: int
    keys: np.ndarray
    num_prompt_blocks: int  # the whole prompt's, the last one partial
    deadline: float = float("inf")  # time.monotonic() past which the reader stops
    data: np.ndarray | None = None  # uint8 [r, block_bytes], r <= len(keys): verified blocks
    seconds: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)


class KeyLedger:
    """A tier's KV events: the keys that entered and left it since the last drain (net),
    guarded by its store's lock."""

    def __init__(self, lock: threading.Lock) -> None:
        self.lock = lock
        self._stored: set[int] = set()
        self._removed: set[int] = set()

    def note(self, key: int, stored: bool) -> None:
        """`key` entered (`stored`) or left the tier; the caller holds the lock."""
        (self._stored if stored else self._removed).add(key)
        (self._removed if stored else self._stored).discard(key)

    def drain(self) -> tuple[list[int], list[int]]:
        """(entered, left) since the last drain, each sorted."""
        with self.lock:
            stored, removed = sorted(self._stored), sorted(self._removed)
            self._stored.clear()
            self._removed.clear()
        return stored, removed


class TierLoader:
    """A tier's reader and writer threads and its engine glue; a subclass says how a batch is
    written (`_write`) and what its engine does with the tier (spill, publish)."""

    name = ""  # the tier's label: stats keys kv_tier_*_<name>, warnings, thread names
    timeout_s = float("inf")  # most seconds a prompt waits for this tier's read
    writer_tick_s: float | None = None  # the writer wakes this often with nothing queued

    def __init__(self, store, scheduler, runner, queue_bytes: int) -> None:
        """Starts both threads: a subclass sets what they read before calling this."""
        self.store, self.scheduler, self.runner = store, scheduler, runner
        self.block_size = store.block_size
        self._reads: queue.Queue = queue.Queue()
        self._finished: deque[LoadJob] = deque()
        self._pending: dict[str, LoadJob] = {}
        self._wake = threading.Event()
        self._last_warning = 0.0
        self.queue_bytes = queue_bytes  # copied blocks waiting for the writer; past it: dropped
        self._writes: queue.Queue = queue.Queue()
        self._queued_bytes = 0
        self._generation = 0  # a clear() drops what was queued before it
        self._lock = threading.Lock()
        # Counters (stats.extra kv_tier_*_<name>).
        self.num_loaded_blocks = 0  # adopted into the pool
        self.num_loads = 0
        self.load_seconds = 0.0
        self.num_missed_blocks = 0  # planned but not loaded (refused, evicted, late, no room)
        self.num_timeouts = 0  # reads given up at timeout_s
        self.num_written_blocks = 0
        self.num_dropped_blocks = 0  # queued past queue_bytes, or their write failed
        self._reader = threading.Thread(target=self._read_loop, name=f"kv-{self.name}-reader",
                                        daemon=True)
        self._writer = threading.Thread(target=self._write_loop, name=f"kv-{self.name}-writer",
                                        daemon=True)
        self._reader.start()
        self._writer.start()

    def _warn(self, msg: str, *args) -> None:
        now = time.monotonic()
        if now - self._last_warning >= WARN_EVERY_S:
            self._last_warning = now
            logging.getLogger(type(self).__module__).warning(msg, *args)

    # ------------------------------------------------------------------ 1. plan
    def plan(self, request_id: str, token_ids, seed: int) -> bool:
        """A new prompt: True when blocks past the pool's run may be in the tier and are
        being read (the caller queues it unschedulable until `land` makes it schedulable)."""
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
        num_prompt_blocks = -(-len(token_ids) // bs)
        reserve = num_prompt_blocks - held - num
        num = min(num, self.scheduler.num_total_blocks() - held - reserve)
        if num <= 0:
            return None
        return LoadJob(request_id, token_ids[:(held + num) * bs], int(seed), held,
                       keys[held:held + num], num_prompt_blocks,
                       deadline=time.monotonic() + self.timeout_s)

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
            job.data = self.store.read(job.keys.tolist(), tokens, job.deadline)
        except Exception as exc:  # a miss, never a failed request
            self._warn("KV %s tier: load for %s failed (%s): recomputing", self.name,
                       job.request_id, exc)
            job.data = np.empty((0, self.store.block_bytes), dtype=np.uint8)
        job.seconds = time.perf_counter() - t0

    # ------------------------------------------------------------------ 2. land
    @property
    def num_pending(self) -> int:
        """Prompts waiting for their reads."""
        return len(self._pending)

    def land(self, wait_s: float = 0.0) -> None:
        """Adopt every finished read and make its prompt schedulable; `wait_s`: block that
        long for one when nothing has finished (an engine with nothing else to run). A read
        past `timeout_s` is given up: its prompt computes."""
        if wait_s and self._pending and not self._finished:
            self._wake.wait(wait_s)
        self._wake.clear()
        while self._finished:
            job = self._finished.popleft()
            if self._pending.get(job.request_id) is not job:
                continue  # aborted or given up meanwhile
            del self._pending[job.request_id]
            self._adopt(job)
            self.scheduler.set_schedulable(job.request_id, True)
        if self.timeout_s != float("inf") and self._pending:
            now = time.monotonic()
            for request_id, job in list(self._pending.items()):
                if now > job.deadline + 0.05:  # the reader stops at the deadline itself
                    del self._pending[request_id]
                    self.num_timeouts += 1
                    self.num_missed_blocks += len(job.keys)
                    self.scheduler.set_schedulable(request_id, True)

    def load_now(self, token_ids, seed: int) -> int:
        """Load a prompt's blocks past the pool's run at once (a completion engine's
        admission, which must know before it allocates what it will not pull); how many."""
        job = self._job("", token_ids, seed)
        if job is None:
            return 0
        self._read(job)
        return self._adopt(job)

    def _adopt(self, job: LoadJob) -> int:
        self.num_loads += 1
        self.load_seconds += job.seconds
        num = len(job.data)
        self.num_missed_blocks += len(job.keys) - num
        if num == 0:
            return 0
        t0 = time.perf_counter()
        end = (job.first_block + num) * self.block_size
        reserve = job.num_prompt_blocks - job.first_block - num  # what the rest still needs
        ids = self.scheduler.adopt_blocks(job.token_ids[:end], job.seed, job.first_block,
                                          reserve)
        self.after_adopt()
        ok = ids >= 0
        if ok.any():
            self.runner.write_blocks(ids[ok], job.data[:len(ids)][ok])
        self.num_loaded_blocks += int(ok.sum())
        self.num_missed_blocks += num - int(ok.sum())
        self.load_seconds += time.perf_counter() - t0
        return int(ok.sum())

    def after_adopt(self) -> None:
        """An adoption may have evicted blocks (the disk tier spills them here)."""

    def forget(self, request_id: str) -> None:
        """An aborted request: its read, if any, is not adopted."""
        self._pending.pop(request_id, None)

    def load_stats(self) -> dict[str, float]:
        """The load side's counters, as kv_tier_<what>_<name>."""
        n = self.name
        return {f"kv_tier_hit_tokens_{n}": float(self.num_loaded_blocks * self.block_size),
                f"kv_tier_loaded_blocks_{n}": float(self.num_loaded_blocks),
                f"kv_tier_missed_blocks_{n}": float(self.num_missed_blocks),
                f"kv_tier_loads_{n}": float(self.num_loads),
                f"kv_tier_load_seconds_{n}": self.load_seconds}

    # ------------------------------------------------------------------ 4. write
    def _queue(self, keys, parents, ids, tokens) -> None:
        """Copy blocks `ids` out of the pool for the writer, unless the queue is full."""
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
            try:
                item = self._writes.get(timeout=self.writer_tick_s)
            except queue.Empty:
                item = ()
            if item is None:
                return
            self._between_writes()
            if not item:
                continue
            if item == "clear":
                self.store.clear()
                continue
            generation, keys, parents, tokens, data = item
            try:
                if generation == self._generation:  # else queued before a clear
                    self.num_written_blocks += self._write(keys, parents, tokens, data)
            except OSError as exc:
                self.num_dropped_blocks += len(keys)
                self._write_failed(exc, len(keys))
            finally:
                with self._lock:
                    self._queued_bytes -= data.nbytes

    def _write(self, keys, parents, tokens, data) -> int:
        """Write a batch to the store (on the writer's thread); how many blocks were new.
        OSError when the store failed."""
        raise NotImplementedError

    def _write_failed(self, exc: OSError, num_blocks: int) -> None:
        """A batch's write raised (its blocks are counted dropped)."""

    def _between_writes(self) -> None:
        """On the writer's thread, at every wake-up (a store that is down is retried here)."""

    # ------------------------------------------------------------------ reset, events, stop
    def clear(self) -> None:
        """Forget every block of the tier now; the writer removes them from the store."""
        self._generation += 1
        self.store.forget_all()
        self._writes.put("clear")

    def drain_events(self) -> tuple[list[int], list[int]]:
        """Keys that entered and left the tier since the last drain (KV events)."""
        return self.store.events.drain()

    def keys(self) -> list[int]:
        return self.store.keys()

    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until the writer has written what was queued (tests, benchmarks, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while (self._queued_bytes or not self._writes.empty()) and time.monotonic() < deadline:
            time.sleep(0.005)

    def close(self) -> None:
        """Write what is queued (at most twice the tier's timeout), then stop both threads."""
        self.flush(timeout_s=min(10.0, 2 * self.timeout_s))
        self._writes.put(None)
        self._writer.join(timeout=5.0)
        self._reads.put(None)
        self._reader.join(timeout=5.0)
