"""KV events: an engine tells its routers which prefix-cache block keys it holds.

Cache-aware routing (router/kv_index.py) needs to know where a prompt's prefix is cached.
The life of a subscription, all on the service loop's thread:

1. A router sends `SubscribeKvEvents` on its existing connection. The first subscriber turns
   the scheduler's event log on (`set_kv_event_capacity`); with nobody subscribed it stays
   off and the engine pays nothing per step.
2. The subscriber gets a snapshot at once: every key in the index (owned and cached-free
   blocks), with this process's `instance_id`, the current `seq`, the block size and the seed.
3. After every service-loop iteration `poll` drains the log: if any key entered or left the
   index, every subscriber gets one `KvEvents` delta with `seq + 1`. Each tier has its own
   fields: `stored`/`removed` the pool's, `disk_stored`/`disk_removed` the disk tier's (P10),
   `shared_stored`/`shared_removed` the shared tier's (P11: what this engine wrote there or
   read from there), so the router can tell a block to reuse in place from one to load first. ZMQ keeps a connection's
   order, so a router that sees a gap lost a message (a full queue) and subscribes again.
4. A log that overflowed between two drains (more than `capacity` changes) becomes a fresh
   snapshot to everyone. A subscriber that cannot be reached any more is dropped; the last one
   leaving turns the log off.

Why the engine connection and not Redis pub/sub: the router already holds one DEALER per
engine, ZMQ orders that connection's messages (so `seq` detects every loss), the snapshot
answers the subscribe on the same ordered stream (no race between a snapshot and the deltas),
and the engine's keys never leave the routers that asked for them.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

import numpy as np

from baton.protocol import KvEvents

logger = logging.getLogger(__name__)


@dataclass
class KvEventSource:
    """What the publisher reads: the engine's scheduler and its key chain's parameters."""

    scheduler: object  # baton.scheduler.Scheduler (drain_kv_events, prefix_cache_keys, ...)
    block_size: int
    seed: int
    num_total_blocks: int
    disk: object = None  # baton.engine.kv_disk.DiskTier (drain_events, keys), or None
    shared: object = None  # baton.engine.kv_shared.SharedTier (the same), or None

    @property
    def num_disk_blocks(self) -> int:
        """Most keys the disk tier holds (0: no disk tier)."""
        return self.disk.store.capacity_blocks if self.disk is not None else 0

    @property
    def num_shared_blocks(self) -> int:
        """Most shared keys this engine names (0: no shared tier)."""
        return self.shared.store.capacity_blocks if self.shared is not None else 0


def _pack(keys: np.ndarray) -> bytes:
    return np.ascontiguousarray(keys, dtype="<u8").tobytes()


class KvEventPublisher:
    """The engine's side of every KV-event subscription (one per router connection)."""

    def __init__(self, source: KvEventSource, instance_id: str = "",
                 capacity: int | None = None):
        self.source = source
        self.instance_id = instance_id or uuid.uuid4().hex
        # Between two drains no more keys can change than the pool's blocks, twice (each block
        # evicted and re-keyed); a reset of a full cache is one pass. Past that: a snapshot.
        self.capacity = capacity or 4 * max(1, source.num_total_blocks)
        self.subscribers: set[bytes] = set()
        self.seq = 0
        self.num_snapshots = 0
        self.num_deltas = 0

    def subscribe(self, identity: bytes, nonce: int) -> KvEvents:
        """Add a subscriber (again, after a gap: it restarts from a snapshot); its snapshot."""
        if not self.subscribers:
            self.source.scheduler.set_kv_event_capacity(self.capacity)
        self.subscribers.add(identity)
        # Deltas are net states (a key is 'stored' if the index holds it at the drain), so the
        # next delta is right on top of this snapshot even if it repeats some of it.
        return self._snapshot(nonce)

    def unsubscribe(self, identity: bytes) -> None:
        self.subscribers.discard(identity)
        if not self.subscribers:
            self.source.scheduler.set_kv_event_capacity(0)

    def poll(self) -> KvEvents | None:
        """The message for every subscriber after this iteration, or None if nothing changed."""
        if not self.subscribers:
            return None
        ok, stored, removed = self.source.scheduler.drain_kv_events()
        disk = self.source.disk
        disk_stored, disk_removed = disk.drain_events() if disk is not None else ((), ())
        shared = self.source.shared
        shared_stored, shared_removed = shared.drain_events() if shared is not None else ((), ())
        if not ok:
            logger.debug("KV event log overflowed; sending a snapshot")
            self.seq += 1
            return self._snapshot(0)
        if not (len(stored) or len(removed) or disk_stored or disk_removed or shared_stored
                or shared_removed):
            return None
        self.seq += 1
        self.num_deltas += 1
        return KvEvents(self.instance_id, self.seq, stored=_pack(stored),
                        removed=_pack(removed), disk_stored=_pack(disk_stored),
                        disk_removed=_pack(disk_removed), shared_stored=_pack(shared_stored),
                        shared_removed=_pack(shared_removed))

    def _snapshot(self, nonce: int) -> KvEvents:
        # A subscribe does not move `seq`: the others' next delta must stay one past their last.
        self.num_snapshots += 1
        src = self.source
        disk = _pack(src.disk.keys()) if src.disk is not None else b""
        shared = _pack(src.shared.keys()) if src.shared is not None else b""
        return KvEvents(self.instance_id, self.seq, is_snapshot=True,
                        stored=_pack(src.scheduler.prefix_cache_keys()), nonce=nonce,
                        block_size=src.block_size, seed=src.seed,
                        num_total_blocks=src.num_total_blocks, disk_stored=disk,
                        num_disk_blocks=src.num_disk_blocks, shared_stored=shared,
                        num_shared_blocks=src.num_shared_blocks,
                        shared_tier=src.shared.store.tier_id if src.shared is not None else "")
