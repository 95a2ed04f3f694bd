"""The shared cluster tier (docs/scheduler.md P11): KV blocks in a store every engine reaches.

A block computed by one engine is usable by every engine of the same fingerprint, and it
outlives any one of them: it lives in the store (Redis: baton/ops/kv_store.py), whose size limit
and eviction (maxmemory, allkeys-lru) are the store's own. A block's life, all on the engine's
thread but the two I/O threads:

1. Publish: after a prompt step, `publish()` copies out of the pool (`Runner.read_blocks`) the
   full prompt blocks that step computed and queues them for the writer thread. The queue is
   bounded in bytes: past it a block is dropped (counted), so the step loop never waits on the
   store. The writer encodes each block as the disk tier does (kv_disk_store.py: the producer's
   fingerprint, then the record: key, parent key, checksum, tokens, bytes) and writes a batch
   in one round trip, under a name that holds the fingerprint's digest
   (`bkv:<digest>:<key>`), so engines of another model, weights or KV dtype never meet.
2. Load: a new prompt whose full blocks past the pool's run are not on this engine's disk is
   read by the load path every tier shares (baton/engine/kv_tier.py): the reader asks the store
   for the chain in batches and stops at the first block missing, refused (checksum,
   fingerprint, key chain, tokens: counted in kv_integrity_failures_shared) or late
   (`timeout_s`); what it got is adopted into the pool as cached blocks (P10, P11).
3. A store that cannot be reached marks the tier down with one warning: prompts recompute,
   publishing drops (counted); the writer pings it every RETRY_S and the tier is up again with
   one line in the log. Never a failed request.
4. KV events (tier `shared`): the keys this engine knows to be in the store (written or read
   by it, at most `capacity_blocks`, least recently used forgotten first: the store's own LRU
   as seen from here). The router joins them over every engine of the same `tier_id`.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

import msgspec
import numpy as np

from baton.engine.kv_disk_store import (
    COLLISION,
    RECORD,
    check_record,
    encode_record,
    fingerprint_header,
    split_header,
)
from baton.engine.kv_tier import KeyLedger, TierLoader
from kv_transfer.integrity import fingerprint_mismatch
from kv_transfer.protocol import Fingerprint

logger = logging.getLogger(__name__)

DEFAULT_QUEUE_BYTES = 64 << 20  # copied blocks waiting for the writer; past it: dropped
DEFAULT_TIMEOUT_S = 1.0  # most seconds a prompt waits for the store (and a call takes)
READ_BATCH = 8  # blocks per round trip of a read: one MGET
RETRY_S = 5.0  # a store that is down is pinged this often
# Keys the events name when the store does not say its size (maxmemory 0 or not readable).
DEFAULT_CAPACITY_BLOCKS = 1 << 16
NAME_PREFIX = "bkv"


class BlockClient(Protocol):
    """What the tier needs of a store (baton/ops/kv_store.py's RedisKvStore is one). Every
    method raises OSError (ConnectionError, TimeoutError) when the store cannot be reached."""

    url: str  # the store's address, no credentials (logs, the tier id)
    timeout_s: float

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> None: ...

    def get_many(self, names: Sequence[str]) -> list[bytes | None]: ...

    def delete_prefix(self, prefix: str) -> int: ...

    def capacity_bytes(self) -> int: ...

    def ping(self) -> None: ...

    def close(self) -> None: ...


def fingerprint_digest(fingerprint: Fingerprint) -> str:
    return hashlib.blake2b(msgspec.msgpack.encode(fingerprint), digest_size=8).hexdigest()


class SharedBlocks:
    """The store as the tier sees it: names, the value format, the checks, the known keys."""

    def __init__(self, client: BlockClient, fingerprint: Fingerprint, block_bytes: int) -> None:
        self.client = client
        self.fingerprint = fingerprint
        self.block_size = fingerprint.block_size
        self.block_bytes = int(block_bytes)
        self.header = fingerprint_header(fingerprint)
        self.value_bytes = len(self.header) + RECORD.size + 4 * self.block_size + block_bytes
        self.prefix = f"{NAME_PREFIX}:{fingerprint_digest(fingerprint)}:"
        self.tier_id = f"{client.url}#{self.prefix}"  # engines with one id share their blocks
        self.capacity_bytes = 0
        self.capacity_blocks = DEFAULT_CAPACITY_BLOCKS
        self.is_up = True
        self.num_errors = 0
        self.num_integrity_failures = 0
        self.lock = threading.Lock()
        self.known: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.events = KeyLedger(self.lock)

    def name(self, key: int) -> str:
        return f"{self.prefix}{key:016x}"

    # ------------------------------------------------------------------ up / down
    def down(self, exc: Exception) -> None:
        self.num_errors += 1
        if self.is_up:
            self.is_up = False
            logger.warning("KV shared tier %s unreachable (%s): prompts recompute what it "
                           "would have served and its blocks are not published; retrying "
                           "every %.0f s", self.client.url, exc, RETRY_S)

    def try_up(self) -> bool:
        try:
            self.client.ping()
        except OSError:
            return False
        self.is_up = True
        logger.warning("KV shared tier %s reachable again", self.client.url)
        return True

    def read_capacity(self) -> None:
        try:
            self.capacity_bytes = int(self.client.capacity_bytes())
        except OSError as exc:
            self.down(exc)
            return
        if self.capacity_bytes > 0:
            self.capacity_blocks = max(1, self.capacity_bytes // self.value_bytes)

    # ------------------------------------------------------------------ the loader's side
    def run_length(self, keys: Sequence[int], start: int) -> int:
        """Blocks the store may hold from keys[start] (all, while it is up: the read tells)."""
        return len(keys) - start if self.is_up else 0

    def read(self, keys: Sequence[int], tokens: np.ndarray,
             deadline: float = float("inf")) -> np.ndarray:
        """The verified run of `keys` (tokens `[n, block_size]`) read before `deadline`:
        uint8 `[r, block_bytes]`, r <= n. OSError when the store cannot be reached."""
        out = np.empty((len(keys), self.block_bytes), dtype=np.uint8)
        n = 0
        try:
            while n < len(keys) and time.monotonic() < deadline:
                batch = [int(k) for k in keys[n:n + READ_BATCH]]
                values = self.client.get_many([self.name(k) for k in batch])
                for key, value in zip(batch, values, strict=True):
                    if not self._take(key, value, tokens[n], out[n]):
                        return out[:n]
                    n += 1
        except OSError as exc:
            self.down(exc)
        return out[:n]

    def _take(self, key: int, value: bytes | None, tokens: np.ndarray, dst: np.ndarray) -> bool:
        if value is None:  # not (or no longer) there: the store evicted it
            self._note(key, stored=False)
            return False
        theirs, start = split_header(value)
        if theirs is None or fingerprint_mismatch(self.fingerprint, theirs):
            return self._refuse(key, f"producer {theirs.describe() if theirs else '?'}")
        block, why = check_record(memoryview(value)[start:], key, tokens, self.block_bytes)
        if why == COLLISION:
            return False  # another prompt's block under a colliding 64-bit key
        if why:
            return self._refuse(key, why)
        dst[:] = block
        self._note(key, stored=True)
        return True

    def _refuse(self, key: int, why: str) -> bool:
        self.num_integrity_failures += 1
        logger.warning("KV shared tier: block %016x refused (%s): recomputing", key, why)
        self._note(key, stored=False)
        return False

    # ------------------------------------------------------------------ the writer's side
    def write(self, keys: np.ndarray, parents: np.ndarray, tokens: np.ndarray,
              data: np.ndarray) -> int:
        """Write the blocks not known to be there yet, in one round trip; how many."""
        with self.lock:
            todo = [i for i, k in enumerate(keys.tolist()) if k not in self.known]
        if not todo:
            return 0
        items = [(self.name(int(keys[i])),
                  self.header + encode_record(int(keys[i]), int(parents[i]), tokens[i], data[i]))
                 for i in todo]
        self.client.put_many(items)
        for i in todo:
            self._note(int(keys[i]), stored=True)
        return len(todo)

    def forget_all(self) -> None:
        """Know nothing of the store any more (the writer deletes its blocks next: `clear`)."""
        with self.lock:
            for key in self.known:
                self.events.note(key, stored=False)
            self.known.clear()

    def clear(self) -> None:
        """Delete this fingerprint's blocks from the store, every engine's (on the writer's
        thread; only when asked: `/reset_prefix_cache?shared=true`)."""
        try:
            num = self.client.delete_prefix(self.prefix)
            logger.info("KV shared tier %s: deleted %d blocks of %s*", self.client.url, num,
                        self.prefix)
        except OSError as exc:
            self.down(exc)

    # ------------------------------------------------------------------ KV events
    def _note(self, key: int, stored: bool) -> None:
        with self.lock:
            if stored:
                self.known[key] = None
                self.known.move_to_end(key)
                self.events.note(key, stored=True)
                while len(self.known) > self.capacity_blocks:
                    old, _ = self.known.popitem(last=False)
                    self.events.note(old, stored=False)
            elif key in self.known:
                del self.known[key]
                self.events.note(key, stored=False)

    def keys(self) -> list[int]:
        with self.lock:
            return list(self.known)


class SharedTier(TierLoader):
    """One engine's view of the shared tier: the publishing and the store's retries; the
    reader, the writer's queue and the load path are TierLoader's."""

    name = "shared"
    writer_tick_s = 1.0  # a store that is down is retried even with nothing to write

    def __init__(self, store: SharedBlocks, scheduler, runner,
                 queue_bytes: int = DEFAULT_QUEUE_BYTES) -> None:
        self.timeout_s = store.client.timeout_s
        self._seeds: dict[str, int] = {}  # request id -> its key seed (block 0's parent)
        self._last_try = time.monotonic()  # the last ping of a store that is down
        store.read_capacity()
        super().__init__(store, scheduler, runner, queue_bytes)

    def describe(self) -> str:
        store = self.store
        size = (f"maxmemory {store.capacity_bytes / 2**20:.1f} MiB (~{store.capacity_blocks} "
                "blocks)" if store.capacity_bytes else "no maxmemory known")
        return (f"shared {store.client.url} ({'up' if store.is_up else 'DOWN'}): {size}, "
                f"names {store.prefix}*")

    # ------------------------------------------------------------------ 1. publish
    def plan(self, request_id: str, token_ids, seed: int) -> bool:
        self._seeds[request_id] = int(seed)  # its blocks are published with this parent
        return super().plan(request_id, token_ids, seed)

    def remember(self, request_id: str, seed: int) -> None:
        """A request that is not planned (its prefix came from the disk tier) still
        publishes what it computes."""
        self._seeds[request_id] = int(seed)

    def forget(self, request_id: str) -> None:
        super().forget(request_id)
        self._seeds.pop(request_id, None)

    def publish(self, reqs, sched_out) -> None:
        """After a prompt step (before its booking frees anything): queue the full prompt
        blocks the step computed, copied out of the pool."""
        if not self.store.is_up:
            return
        bs = self.block_size
        seqlens_k = np.asarray(sched_out.seqlens_k)
        starts = (seqlens_k - np.asarray(sched_out.seqlens_q)) // bs
        ends = seqlens_k // bs
        for row in np.nonzero(ends > starts)[0].tolist():
            req = reqs[row]
            seed = self._seeds.get(req.request_id)
            if seed is None:
                continue  # a fork's prompt: its parent publishes the same blocks
            keys = self.scheduler.block_keys(req.request_id)
            first, end = int(starts[row]), min(int(ends[row]), len(keys))
            table = np.asarray(sched_out.block_tables[row])
            todo = [j for j in range(first, end)
                    if int(keys[j]) not in self.store.known and table[j] > 0]
            if todo:
                tokens = np.asarray((req.prompt_token_ids + req.token_ids)[:end * bs],
                                    dtype=np.int32).reshape(-1, bs)
                parents = [int(keys[j - 1]) if j else seed for j in todo]
                self._queue(keys[todo], np.asarray(parents, dtype=np.uint64), table[todo],
                            tokens[todo])

    def _write(self, keys, parents, tokens, data) -> int:
        if not self.store.is_up:
            self.num_dropped_blocks += len(keys)
            return 0
        return self.store.write(keys, parents, tokens, data)

    def _write_failed(self, exc: OSError, num_blocks: int) -> None:
        self.store.down(exc)
        self._last_try = time.monotonic()

    def _between_writes(self) -> None:
        store = self.store
        if not store.is_up and time.monotonic() - self._last_try >= RETRY_S:
            self._last_try = time.monotonic()
            if store.try_up():
                store.read_capacity()

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, float]:
        store = self.store
        return {"kv_tier_blocks_shared": float(len(store.known)),
                "kv_tier_bytes_shared": float(len(store.known) * store.value_bytes),
                "kv_tier_capacity_bytes_shared": float(store.capacity_bytes),
                **self.load_stats(),
                "kv_tier_written_blocks_shared": float(self.num_written_blocks),
                "kv_tier_dropped_blocks_shared": float(self.num_dropped_blocks),
                "kv_tier_errors_shared": float(store.num_errors),
                "kv_tier_timeouts_shared": float(self.num_timeouts),
                "kv_tier_up_shared": float(store.is_up),
                "kv_integrity_failures_shared": float(store.num_integrity_failures)}


def open_shared_tier(client: BlockClient, fingerprint: Fingerprint, block_bytes: int,
                     scheduler, runner) -> SharedTier:
    """The tier over `client`; a store that does not answer now starts the tier down (it is
    retried, never fatal)."""
    return SharedTier(SharedBlocks(client, fingerprint, block_bytes), scheduler, runner)
