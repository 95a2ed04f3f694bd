"""Which prefix-cache block keys each engine holds, as its KV events said (baton/engine/kv_events.py).

Per engine (by address) the index keeps the engine's `instance_id`, the `seq` of the last
message applied, the block size and key seed it keys with, and the set of keys it holds in
each tier: its pool (`keys`), its disk (`disk_keys`, docs/scheduler.md P10; a prompt's
blocks past the pool's run that are on disk are loaded, not computed) and the shared cluster
tier's keys it wrote or read (`shared_keys`, P11). A shared block is every engine's of the same
`shared_tier` id: the index joins their sets when it scores any one of them.
An engine's entries are dropped, and the engine must be subscribed again, when:
  - a delta's `seq` is not one past the last one (the engine's queue to us dropped a message),
  - a message names another `instance_id` than the snapshot did (a restarted engine),
  - a message is malformed or would make the engine hold more keys than it has blocks,
  - its connection dropped, or it left the registry (router/membership.py calls `drop`).
Nothing from the socket is trusted: key bytes are checked for length and count before use.

`RequestKeys` computes a prompt's block keys once per (block size, seed) among the engines
that are scored, with the engines' own function (the compiled scheduler's, torch-free).
"""

from __future__ import annotations

import logging
from collections.abc import Set
from dataclasses import dataclass, field

from baton.engine.block_keys import compute_block_keys, request_seed
from baton.protocol import KvEvents, ProtocolError, unpack_keys

logger = logging.getLogger(__name__)

# No engine is trusted with more keys than this whatever it claims its pool holds: 1M blocks is
# 16M tokens at block size 16, past any pool, and bounds the router's memory per engine (~70 MB).
MAX_KEYS_PER_ENGINE = 1 << 20


@dataclass
class EngineKeys:
    """What one engine holds, as far as its events have told."""

    instance_id: str
    seq: int
    block_size: int
    seed: int
    num_total_blocks: int
    keys: set[int] = field(default_factory=set)
    num_disk_blocks: int = 0  # the disk tier's bound (0: none)
    disk_keys: set[int] = field(default_factory=set)
    shared_tier: str = ""  # the shared tier's id ("": none)
    num_shared_blocks: int = 0
    shared_keys: set[int] = field(default_factory=set)


class KvIndex:
    def __init__(self) -> None:
        self._engines: dict[str, EngineKeys] = {}
        self.num_resyncs = 0  # entries dropped because of a gap, a restart or a bad message

    def __contains__(self, address: str) -> bool:
        return address in self._engines

    def addresses(self) -> list[str]:
        return list(self._engines)

    def get(self, address: str) -> EngineKeys | None:
        return self._engines.get(address)

    def num_keys(self, address: str) -> int:
        entry = self._engines.get(address)
        return len(entry.keys) if entry is not None else 0

    def block_size(self, address: str) -> int | None:
        """The engine's tokens per block, once its snapshot has said (router/selection.py)."""
        entry = self._engines.get(address)
        return entry.block_size if entry is not None else None

    def drop(self, address: str) -> None:
        self._engines.pop(address, None)

    def apply(self, address: str, msg: KvEvents) -> bool:
        """Apply one message from the engine at `address`. False: its entries are dropped and
        it must be subscribed again (gap, restart, or a message that breaks the rules)."""
        try:
            if msg.is_snapshot:
                self._engines[address] = _from_snapshot(msg)
                return True
            entry = self._engines.get(address)
            if entry is None:
                raise ProtocolError("a delta before any snapshot")
            if msg.instance_id != entry.instance_id:
                raise ProtocolError(f"instance {msg.instance_id!r} after {entry.instance_id!r}")
            if msg.seq != entry.seq + 1:
                raise ProtocolError(f"seq {msg.seq} after {entry.seq}")
            bound = entry.num_total_blocks
            stored = unpack_keys(msg.stored, bound)
            removed = unpack_keys(msg.removed, bound)
            entry.keys.difference_update(removed)
            entry.keys.update(stored)
            if len(entry.keys) > bound:
                raise ProtocolError(f"{len(entry.keys)} keys held with {bound} blocks")
            disk_bound = entry.num_disk_blocks
            entry.disk_keys.difference_update(unpack_keys(msg.disk_removed, disk_bound))
            entry.disk_keys.update(unpack_keys(msg.disk_stored, disk_bound))
            if len(entry.disk_keys) > disk_bound:
                raise ProtocolError(f"{len(entry.disk_keys)} disk keys with room for "
                                    f"{disk_bound}")
            shared_bound = entry.num_shared_blocks
            entry.shared_keys.difference_update(unpack_keys(msg.shared_removed, shared_bound))
            entry.shared_keys.update(unpack_keys(msg.shared_stored, shared_bound))
            if len(entry.shared_keys) > shared_bound:
                raise ProtocolError(f"{len(entry.shared_keys)} shared keys, at most "
                                    f"{shared_bound}")
            entry.seq = msg.seq
            return True
        except ProtocolError as exc:
            logger.info("KV index of %s dropped, resubscribing: %s", address, exc)
            self._engines.pop(address, None)
            self.num_resyncs += 1
            return False

    def overlap(self, address: str, request: RequestKeys) -> int:
        """Leading full blocks of the request's prompt the engine holds (0 if unknown)."""
        entry = self._engines.get(address)
        if entry is None or not entry.keys:
            return 0
        return prefix_overlap(request.keys_for(entry.block_size, entry.seed), entry.keys)

    def disk_overlap(self, address: str, request: RequestKeys) -> int:
        """Blocks of the request's prompt past the engine's pool run that its disk tier
        holds (the engine loads them instead of computing them; 0 if unknown)."""
        entry = self._engines.get(address)
        if entry is None or not entry.disk_keys:
            return 0
        keys = request.keys_for(entry.block_size, entry.seed)
        start = prefix_overlap(keys, entry.keys)
        return prefix_overlap(keys[start:], entry.disk_keys)

    def shared_overlap(self, address: str, request: RequestKeys) -> int:
        """Blocks of the request's prompt past the engine's pool and disk runs that its shared
        tier holds, as any engine of that tier has said (loaded, not computed; 0 if none)."""
        entry = self._engines.get(address)
        if entry is None or not entry.shared_tier:
            return 0
        group = [e.shared_keys for e in self._engines.values()
                 if e.shared_tier == entry.shared_tier and e.seed == entry.seed
                 and e.block_size == entry.block_size and e.shared_keys]
        if not group:
            return 0
        keys = request.keys_for(entry.block_size, entry.seed)
        start = prefix_overlap(keys, entry.keys)
        start += prefix_overlap(keys[start:], entry.disk_keys)
        num = 0
        for key in keys[start:]:
            if not any(key in held for held in group):
                break
            num += 1
        return num


def prefix_overlap(keys: list[int], held: Set[int]) -> int:
    """How many of `keys`, from the first, are in `held`."""
    num = 0
    for key in keys:
        if key not in held:  # a chain: a block past a miss cannot be a prefix hit
            break
        num += 1
    return num


def _from_snapshot(msg: KvEvents) -> EngineKeys:
    if not 0 < msg.num_total_blocks <= MAX_KEYS_PER_ENGINE:
        raise ProtocolError(f"num_total_blocks={msg.num_total_blocks} out of range")
    if msg.block_size <= 0 or not 0 <= msg.seed < 1 << 64 or not msg.instance_id:
        raise ProtocolError(f"bad snapshot header: block_size={msg.block_size}, "
                            f"seed={msg.seed}, instance_id={msg.instance_id!r}")
    if msg.removed or msg.disk_removed or msg.shared_removed:
        raise ProtocolError("a snapshot with removed keys")
    if msg.num_disk_blocks < 0 or msg.num_shared_blocks < 0:
        raise ProtocolError(f"num_disk_blocks={msg.num_disk_blocks}, num_shared_blocks="
                            f"{msg.num_shared_blocks} out of range")
    if bool(msg.shared_tier) != bool(msg.num_shared_blocks) or len(msg.shared_tier) > 512:
        raise ProtocolError(f"shared_tier={msg.shared_tier[:64]!r} with num_shared_blocks="
                            f"{msg.num_shared_blocks}")
    # A disk may hold more blocks than the router keeps keys for: past the bound, a resync.
    disk_bound = min(msg.num_disk_blocks, MAX_KEYS_PER_ENGINE)
    keys = set(unpack_keys(msg.stored, msg.num_total_blocks))
    disk_keys = set(unpack_keys(msg.disk_stored, disk_bound))
    shared_bound = min(msg.num_shared_blocks, MAX_KEYS_PER_ENGINE)
    shared_keys = set(unpack_keys(msg.shared_stored, shared_bound))
    return EngineKeys(msg.instance_id, msg.seq, msg.block_size, msg.seed,
                      msg.num_total_blocks, keys, disk_bound, disk_keys, msg.shared_tier,
                      shared_bound, shared_keys)


class RequestKeys:
    """One prompt's block keys, computed at most once per (block size, seed). An engine's
    seed is its own; a request with a `cache_salt` is keyed from that seed salted, as the
    engine keys it (baton/engine/block_keys.py), so it overlaps only its tenant's blocks; one
    with a LoRA adapter (`lora_name`, whose digest the engines publish: `lora_id`) from the
    adapter's seed, so it overlaps only that adapter's blocks, never the base's."""

    def __init__(self, token_ids: list[int], cache_salt: str = "", lora_name: str = "",
                 lora_id: str = ""):
        self.token_ids = token_ids
        self.cache_salt = cache_salt
        self.lora_name = lora_name  # engines without it are no candidates (router/engine_pool.py)
        self.lora_id = lora_id
        self._keys: dict[tuple[int, int], list[int]] = {}

    def num_blocks(self, block_size: int) -> int:
        """Blocks the whole prompt takes (the last one partial)."""
        return -(-len(self.token_ids) // block_size)

    def keys_for(self, block_size: int, seed: int) -> list[int]:
        cached = self._keys.get((block_size, seed))
        if cached is None:
            cached = compute_block_keys(self.token_ids, block_size,
                                        request_seed(seed, self.cache_salt,
                                                     self.lora_id)).tolist()
            self._keys[(block_size, seed)] = cached
        return cached
