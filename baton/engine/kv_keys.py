"""Who computed an engine's KV, and what its blocks are called: the model fingerprint, the
block-key seed, the producer `Fingerprint` the hand-off and the tiers check, and a request's
own seed (its cache salt, its LoRA adapter).

Two engines share a block key only when they would compute the same bytes for it, so every
input of those bytes enters the one seed (docs/scheduler.md P1): the model file, the KV layout
and dtype, the quantization, the compute dtype where it differs from the KV's; then, per
request, the cache salt and the adapter (`block_keys.request_seed`).
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

from baton.engine.block_keys import key_seed, request_seed
from baton.engine.config import EngineConfig
from baton.engine.kv_identity import kv_fingerprint
from baton.engine.runner_api import Runner
from baton.model.modes import check_dtype_name
from baton.protocol import MAX_CACHE_SALT_CHARS
from kv_transfer.config import PoolSpec
from kv_transfer.protocol import Fingerprint


class KvKeys:
    """An engine's KV identity; everything is fixed once its runner is built."""

    def __init__(self, config: EngineConfig, runner: Runner) -> None:
        self.config, self.runner = config, runner

    @cached_property
    def model_fingerprint(self) -> str:
        """Model and KV layout identity: published in the registry, and the seed of the
        prefix-cache key chain."""
        runner = self.runner
        # Quantized weights compute other K/V than the float ones (same layout, other bytes).
        quant = "" if runner.quantization == "none" else f"/{runner.quantization}"
        # The layout names the KV dtype; K/V computed in another dtype than they are stored
        # in are other bytes again (fp32 math rounded to bf16 != bf16 math).
        kv, compute = self.config.kv_cache_dtype, check_dtype_name(self.config.dtype)
        compute = "" if kv in ("auto", compute) else f"/compute-{compute}"
        return f"{Path(runner.model_path).name}/{runner.kv_spec.fingerprint()}{quant}{compute}"

    @cached_property
    def prefix_cache_seed(self) -> int:
        return key_seed(self.model_fingerprint)

    @cached_property
    def fingerprint(self) -> Fingerprint:
        """Who computed this pool's blocks: what the hand-off's handshake and the tiers check
        before a block is used (kv_transfer/protocol.py)."""
        return kv_fingerprint(self.runner.model_path, self.runner.quantization,
                              self.runner.kv_spec, self.prefix_cache_seed)

    @cached_property
    def block_bytes(self) -> int:
        if self.runner.kv_cache is None:  # the simulator's runner: no bytes
            return int(self.runner.kv_spec.bytes_per_block)
        return PoolSpec.of(self.runner.kv_cache).block_bytes

    # ------------------------------------------------------------------ per request
    def lora_adapters(self) -> dict[str, str]:
        """Loaded LoRA adapters: name -> id (the digest that keys their KV blocks)."""
        lora = getattr(self.runner, "lora", None)
        return lora.ids() if lora is not None else {}

    def lora_id(self, request_id: str, lora_name: str) -> str:
        """The id of adapter `lora_name` ("" for the base); ValueError naming the loaded ones
        when it is not loaded here."""
        if not lora_name:
            return ""
        ids = self.lora_adapters()
        if lora_name not in ids:
            raise ValueError(f"request {request_id!r}: LoRA adapter {lora_name!r} is not loaded "
                             f"on this engine (loaded: {sorted(ids) or 'none'})")
        return ids[lora_name]

    def request_key_seed(self, request_id: str, cache_salt: str,
                         lora_name: str = "") -> int | None:
        """The key seed of a request with `cache_salt` and LoRA adapter `lora_name`; None when
        it is the engine's own (no salt, the base model): the scheduler then uses its own.
        ValueError for a salt longer than MAX_CACHE_SALT_CHARS or an adapter not loaded here."""
        lora_id = self.lora_id(request_id, lora_name)
        if not cache_salt and not lora_id:
            return None
        if len(cache_salt) > MAX_CACHE_SALT_CHARS:
            raise ValueError(f"request {request_id!r}: cache_salt of {len(cache_salt)} "
                             f"characters; at most {MAX_CACHE_SALT_CHARS}")
        return request_seed(self.prefix_cache_seed, cache_salt, lora_id)

    def block_seed(self, seed: int | None) -> int:
        """The seed a request's blocks are keyed with: its own (`request_key_seed`), or the
        engine's where that is None."""
        return self.prefix_cache_seed if seed is None else seed
