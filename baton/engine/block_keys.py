"""The one definition of a prefix-cache block key (P1): the seed of the chain and the chain.

`key(-1) = seed`, `key(i) = H(key(i-1), tokens of block i)` (the compiled scheduler's hash, so
the router, a completion engine checking a KV handle and the scheduler agree). The seed is
derived from everything that decides a block's bytes: two engines share a key only when they
would share the block's contents. Whatever else must keep caches apart (the KV dtype, a LoRA
adapter, a tenant's cache salt) enters here, in `key_seed`, and nowhere else.

The KV dtype enters through the model fingerprint (`LLMEngine.model_fingerprint`: the pool's
layout, `KVCacheSpec.fingerprint`, names its dtype, and the compute dtype follows when it
differs): the compiled scheduler is handed the engine's seed, and the router keys a prompt
with the seed each engine announces in its KV events, so neither spells the dtype again. A
LoRA adapter enters by its digest (`lora_seed`), which each engine publishes in its registry
record beside the adapter's name, so the router keys an adapter's prompt as that engine does.
"""

from __future__ import annotations

import hashlib

from baton.engine.scheduler import compute_block_keys

__all__ = ["compute_block_keys", "key_seed", "lora_seed", "request_seed", "salted_seed"]


def key_seed(model_fingerprint: str, cache_salt: str = "") -> int:
    """The uint64 seed of the block-key chain of an engine whose model and KV layout
    `model_fingerprint` names, for requests with `cache_salt` (vLLM's field: a tenant's tag;
    "" = the engine's shared cache)."""
    digest = hashlib.blake2b(model_fingerprint.encode(), digest_size=8).digest()
    return salted_seed(int.from_bytes(digest, "little"), cache_salt)


def salted_seed(engine_seed: int, cache_salt: str) -> int:
    """The seed of `cache_salt`'s requests on an engine whose own seed is `engine_seed` (what
    its KV events announce, so the router keys a salted prompt as the engine does). Two salts
    give unrelated chains: one tenant's prompts never hit, nor route by, another's blocks."""
    if not cache_salt:
        return engine_seed
    material = engine_seed.to_bytes(8, "little") + b"|cache_salt|" + cache_salt.encode()
    return int.from_bytes(hashlib.blake2b(material, digest_size=8).digest(), "little")


def lora_seed(engine_seed: int, lora_id: str) -> int:
    """The seed of the requests an engine whose own seed is `engine_seed` serves with the LoRA
    adapter `lora_id` (its digest, `baton.model.lora.LoraAdapter.adapter_id`; "" = the base
    model). An adapter computes other K/V from the first layer on: its chain is unrelated to
    the base's and to every other adapter's, so its blocks never serve, nor route, another."""
    if not lora_id:
        return engine_seed
    material = engine_seed.to_bytes(8, "little") + b"|lora|" + lora_id.encode()
    return int.from_bytes(hashlib.blake2b(material, digest_size=8).digest(), "little")


def request_seed(engine_seed: int, cache_salt: str = "", lora_id: str = "") -> int:
    """A request's seed: the engine's, then its adapter's, then its tenant's salt (what the
    engine hands the scheduler and the router keys a prompt with)."""
    return salted_seed(lora_seed(engine_seed, lora_id), cache_salt)
