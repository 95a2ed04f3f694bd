"""The KV tiers one engine keeps below its pool (docs/scheduler.md P10: a disk, P11: a shared
cluster store), and where the engine's loop meets them.

A prompt's blocks and the tiers, all on the engine's thread (each tier's I/O runs on its own
threads: kv_tier.py):
1. `add_request` -> `plan`: a new prompt's blocks on disk (else in the shared tier) are read
   first; it waits unschedulable (S15) until `land` has adopted them into the pool. The shared
   tier remembers its key seed either way: what the prompt computes there is published.
2. Every step: `land` before the scheduler's `schedule` (finished reads enter the pool before
   the admission), `spill` after every scheduler call that may evict (the disk keeps what the
   pool drops, before the step rewrites it), `publish` after a prompt step (the shared tier
   keeps what the step computed, before the booking frees anything).
3. A completion engine's admission: `load_now`, before `allocate_prompted` pins the run (the
   blocks found need no pull).
4. `forget` a request that ends while its reads may be in flight (abort, refused); `close`
   spills the pool's cached blocks to disk first, so a restart finds them (P10).
"""

from __future__ import annotations

import logging

from baton.engine.config import EngineConfig
from baton.engine.kv_disk import DiskTier, open_disk_tier
from baton.engine.kv_keys import KvKeys
from baton.engine.kv_shared import SharedTier, open_shared_tier

logger = logging.getLogger(__name__)


class KvTiers:
    """The disk and shared tiers of one engine (each None when off), in look-up order."""

    def __init__(self, config: EngineConfig, kv_keys: KvKeys, scheduler, runner,
                 shared_store=None) -> None:
        """`shared_store`: the shared tier's client (a `baton.engine.kv_shared.BlockClient`),
        None = no shared tier. ValueError when it is asked for without prefix caching."""
        if shared_store is not None and not config.enable_prefix_caching:
            raise ValueError("a shared KV tier (--kv-shared-tier) keeps prefix-cache blocks: "
                             "it needs prefix caching on")
        self.scheduler = scheduler
        self.block_bytes = kv_keys.block_bytes
        self.block_size = config.block_size
        # The local disk tier below the pool (P10); None = off, or its directory is unusable.
        self.disk: DiskTier | None = None
        if config.kv_disk_dir:
            self.disk = open_disk_tier(config.kv_disk_dir, config.kv_disk_bytes,
                                       kv_keys.fingerprint, self.block_bytes, scheduler, runner)
        # The shared cluster tier (P11); None = off.
        self.shared: SharedTier | None = None
        if shared_store is not None:
            self.shared = open_shared_tier(shared_store, kv_keys.fingerprint, self.block_bytes,
                                           scheduler, runner)
        if self.all:
            logger.info("KV tiers: pool %d blocks x %d bytes; %s",
                        scheduler.num_total_blocks(), self.block_bytes,
                        "; ".join(t.describe() for t in self.all))

    @property
    def all(self) -> list:
        """The tiers that are on, in the order a prompt's blocks are looked up (P10, P11)."""
        return [t for t in (self.disk, self.shared) if t is not None]

    # ------------------------------------------------------------------ a request
    def plan(self, request_id: str, token_ids: list[int], seed: int, skip: bool) -> bool:
        """A new prompt (1.): True when some tier is reading blocks of it (queue it
        unschedulable). `skip`: it skips the prefix cache (nothing is read)."""
        if self.shared is not None:
            self.shared.remember(request_id, seed)  # what it computes is published (P11)
        return not skip and any(t.plan(request_id, token_ids, seed) for t in self.all)

    def load_now(self, token_ids: list[int], seed: int) -> None:
        """A completion engine's prompt (3.): its blocks the tiers hold enter the pool now."""
        for tier in self.all:
            tier.load_now(token_ids, seed)

    def forget(self, request_id: str) -> None:
        """A request ended or was refused: a read of it in flight is not adopted."""
        for tier in self.all:
            tier.forget(request_id)

    def untrack(self, request_id: str) -> None:
        """The engine no longer holds the request: the shared tier forgets its seed."""
        if self.shared is not None:
            self.shared.forget(request_id)

    # ------------------------------------------------------------------ a step
    def land(self, has_outputs: bool) -> None:
        """Before a schedule: finished reads enter the pool. With nothing else to do (no
        running sequence, no output to send, only loading prompts waiting) wait a little for
        one, rather than spin."""
        tiers = self.all
        if not tiers:
            return
        sched = self.scheduler
        idle = (sched.num_running() == 0 and not has_outputs
                and sched.num_waiting() <= sum(t.num_pending for t in tiers))
        for tier in tiers:
            tier.land(wait_s=0.002 if idle else 0.0)

    def spill(self) -> None:
        """After a scheduler call that may have evicted: those blocks go to disk."""
        if self.disk is not None:
            self.disk.spill()

    def publish(self, reqs, sched_out) -> None:
        """After a prompt step, before its booking: its full blocks go to the shared tier."""
        if self.shared is not None:
            self.shared.publish(reqs, sched_out)

    # ------------------------------------------------------------------ reset, stats, close
    def reset(self, pool_only: bool, shared: bool) -> None:
        """After the pool's prefix cache was reset: the disk's blocks go unless `pool_only`,
        the shared store's (every engine's) only when `shared` is asked (P11)."""
        if self.disk is not None and not pool_only:
            self.disk.clear()
        if self.shared is not None and shared:
            self.shared.clear()

    def stats(self) -> dict[str, float]:
        """Hits, bytes and load time per KV tier (`baton_kv_tier_*`): the pool's and each
        tier's. A block loaded from a tier is hit in the pool afterwards: the pool's hits are
        those that were not loaded."""
        sched = self.scheduler
        tiers: dict[str, float] = {}
        for tier in self.all:
            tiers.update(tier.stats())
        loaded = (tiers.get("kv_tier_hit_tokens_disk", 0.0)
                  + tiers.get("kv_tier_hit_tokens_shared", 0.0))
        return {"kv_tier_hit_tokens_pool": max(0.0, sched.prefix_cache_stats()["hit_tokens"]
                                               - loaded),
                "kv_tier_blocks_pool": float(sched.num_cached_blocks()),
                "kv_tier_bytes_pool": float(sched.num_cached_blocks() * self.block_bytes),
                "kv_tier_capacity_bytes_pool": float(sched.num_total_blocks()
                                                     * self.block_bytes),
                "kv_tier_capacity_tokens_pool": float(sched.num_total_blocks()
                                                      * self.block_size),
                **tiers}

    def close(self) -> None:
        """The shared tier's threads stop (its blocks stay in the store, P11); the pool's
        cached blocks go to disk and the disk's writer finishes, so that a restart (or the next
        role's engine, S41) finds them there (P10)."""
        if self.shared is not None:
            self.shared.close()
            self.shared = None
        if self.disk is None:
            return
        if self.scheduler.reset_prefix_cache(spill=True):
            self.disk.spill(wait=True)
        self.disk.close()
        self.disk = None
