"""Which engine of a role a request goes to, given the candidates' loads and caches.

A policy sees plain data only: each candidate's id, its load, its active blocks and its block
size (`Candidate`), the request's block keys (`RequestKeys`), and, for the cache-aware
policy, a view of which keys each engine holds (`CacheView`: the router's `KvIndex`, or
`KeySets` over plain sets). No sockets, no registry: a simulator calls `select` with its own
engines' state, the router (router/engine_pool.py) with the live engines'.

1. The router (or a simulator) lists the candidates of a role: live, healthy, not excluded.
2. `policy.select(role, candidates, request)` returns a `Choice`: the engine, the blocks the
   request adds to its active blocks (released when the request leaves it), and the leading
   blocks of the request it already holds.
3. The caller adds `Choice.num_active_blocks` to that engine's load until the request leaves.

least-loaded   the lowest `Candidate.load`; the first listed among equals.
overlap-minus-load (cache-aware, the router's default) NVIDIA Dynamo's KV router cost in blocks:
                   cost = overlap_weight * new_blocks + active_blocks
               new_blocks: the request's blocks the engine does not hold (what a prompt or
               normal engine must prefill, what a completion engine must pull); a block its
               disk tier holds past its pool run counts as 1 - disk_weight of a new block
               (it is loaded, not computed: docs/scheduler.md P10), one the shared tier
               holds past both as 1 - shared_weight (P11);
               active_blocks: the blocks of this router's requests in flight there. Ties go
               to the lowest load, then to the first listed. overlap_weight 1 (Dynamo's
               default) prices a cached block like one block of queued work.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Protocol

from baton.protocol import PROMPT
from router.kv_index import RequestKeys, prefix_overlap

DEFAULT_BLOCK_SIZE = 16  # an engine that has said nothing of its block size
# What a block on an engine's disk saves of computing it: bench/kv_disk_tier.py measured the
# TTFT of returning turns loaded from disk at 0.29x (exact mode) to 0.38x (int4) of recomputing
# them (README: KV tiers), so a disk block is priced at 0.3 of a block to compute.
DISK_HIT_WEIGHT = 0.7
# What a block of the shared tier (Redis) saves of computing it: bench/kv_shared_tier.py measured
# the TTFT of a prompt whose 256-token prefix another engine had published at 0.11x (median of
# 5, 0.05-0.26) of recomputing it, exact mode (README: KV tiers; a load read, checked and put
# 16 blocks into the pool in 90 ms), so a shared block is priced at 0.1 of a block to compute.
SHARED_HIT_WEIGHT = 0.9


@dataclass(frozen=True)
class Candidate:
    """One engine a request may go to, as a policy sees it."""

    engine_id: Hashable  # the router passes the engine's address
    load: float = 0.0  # requests there (registry load + this router's since): lower is better
    num_active_blocks: int = 0  # blocks of this router's requests in flight there
    block_size: int = DEFAULT_BLOCK_SIZE  # its tokens per block, when the cache view has none


@dataclass(frozen=True)
class Choice:
    """Where a request goes and what it costs there."""

    engine_id: Hashable
    num_active_blocks: int = 0  # what the request adds to the engine's active blocks
    num_overlap_blocks: int = 0  # leading blocks of the request the engine already holds
    num_disk_blocks: int = 0  # of those, the ones on its disk tier (loaded, not computed)
    num_shared_blocks: int = 0  # of those, the ones in the shared tier (loaded, not computed)


class CacheView(Protocol):
    """Which block keys each engine holds (router/kv_index.py's KvIndex is one)."""

    def block_size(self, engine_id: Hashable) -> int | None:
        """The engine's tokens per block; None when the view knows nothing of it."""

    def overlap(self, engine_id: Hashable, request: RequestKeys) -> int:
        """Leading full blocks of the request the engine holds (0 if unknown)."""

    def disk_overlap(self, engine_id: Hashable, request: RequestKeys) -> int:
        """Blocks past that run its disk tier holds (0 if unknown or none)."""

    def shared_overlap(self, engine_id: Hashable, request: RequestKeys) -> int:
        """Blocks past both runs its shared tier holds (0 if unknown or none)."""


class KeySets:
    """A CacheView over plain sets: engine id -> the block keys it holds, all engines keying
    with one block size and seed (a simulator's engines)."""

    def __init__(self, keys: Mapping[Hashable, Set[int]], block_size: int, seed: int):
        self.keys = keys
        self._block_size = block_size
        self._seed = seed

    def block_size(self, engine_id: Hashable) -> int | None:
        return self._block_size

    def overlap(self, engine_id: Hashable, request: RequestKeys) -> int:
        held = self.keys.get(engine_id)
        if not held:
            return 0
        return prefix_overlap(request.keys_for(self._block_size, self._seed), held)

    def disk_overlap(self, engine_id: Hashable, request: RequestKeys) -> int:
        return 0  # a simulator's engines have no disk tier

    def shared_overlap(self, engine_id: Hashable, request: RequestKeys) -> int:
        return 0  # nor a shared one


class SelectionPolicy:
    """Picks one of a role's candidates for a request."""

    is_cache_aware = False  # whether a choice's overlap means anything (the router's metrics)

    def select(self, role: str, candidates: Sequence[Candidate],
               request: RequestKeys) -> Choice:
        """The chosen candidate; `candidates` must not be empty."""
        raise NotImplementedError


class LeastLoaded(SelectionPolicy):
    """The lowest load; the caches are not looked at, nothing is counted in blocks."""

    def select(self, role: str, candidates: Sequence[Candidate],
               request: RequestKeys) -> Choice:
        assert candidates, "select needs at least one candidate"
        return Choice(min(candidates, key=lambda c: c.load).engine_id)


class OverlapMinusLoad(SelectionPolicy):
    """The lowest `overlap_weight * new_blocks + active_blocks`, ties to the least loaded.

    A prompt engine's active blocks are the ones it must compute (the request's blocks less
    those it holds); a normal or completion engine keeps every block of the request until the
    request ends there.
    """

    is_cache_aware = True

    def __init__(self, cache: CacheView, overlap_weight: float = 1.0,
                 disk_weight: float = DISK_HIT_WEIGHT, shared_weight: float = SHARED_HIT_WEIGHT):
        if not 0 <= overlap_weight < float("inf"):
            raise ValueError(f"overlap_weight must be >= 0 and finite, got {overlap_weight}")
        if not 0 <= disk_weight <= 1:
            raise ValueError(f"disk_weight must be in [0, 1], got {disk_weight}")
        if not 0 <= shared_weight <= 1:
            raise ValueError(f"shared_weight must be in [0, 1], got {shared_weight}")
        self.shared_weight = shared_weight
        self.cache = cache
        self.overlap_weight = overlap_weight
        self.disk_weight = disk_weight

    def select(self, role: str, candidates: Sequence[Candidate],
               request: RequestKeys) -> Choice:
        assert candidates, "select needs at least one candidate"
        best: tuple[float, float] | None = None
        choice = Choice(candidates[0].engine_id)
        for candidate in candidates:
            block_size = self.cache.block_size(candidate.engine_id) or candidate.block_size
            num_blocks = request.num_blocks(block_size)
            overlap = self.cache.overlap(candidate.engine_id, request)
            disk = self.cache.disk_overlap(candidate.engine_id, request)
            shared = self.cache.shared_overlap(candidate.engine_id, request)
            cost = (self.overlap_weight * (num_blocks - overlap - self.disk_weight * disk
                                           - self.shared_weight * shared)
                    + candidate.num_active_blocks)
            if best is None or (cost, candidate.load) < best:
                best = (cost, candidate.load)
                held = overlap + disk + shared
                active = num_blocks - held if role == PROMPT else num_blocks
                choice = Choice(candidate.engine_id, active, held, disk, shared)
        return choice
