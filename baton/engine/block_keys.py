"""The one definition of a prefix-cache block key (P1): the seed of the chain and the chain.

`key(-1) = seed`, `key(i) = H(key(i-1), tokens of block i)` (the compiled scheduler's hash, so
the router, a completion engine checking a KV handle and the scheduler agree). The seed is
derived from everything that decides a block's bytes: two engines share a key only when they
would share the block's contents. Whatever else must keep caches apart (the KV dtype, a LoRA
adapter, a tenant's cache salt) enters here, in `key_seed`, and nowhere else.
"""

from __future__ import annotations

import hashlib

from baton.engine.scheduler import compute_block_keys

__all__ = ["compute_block_keys", "key_seed"]


def key_seed(model_fingerprint: str) -> int:
    """The uint64 seed of the block-key chain of an engine whose model and KV layout
    `model_fingerprint` names."""
    digest = hashlib.blake2b(model_fingerprint.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")
