"""Model runtime: Llama-family forward over a block-major paged KV pool, loaders, tokenizer."""

from __future__ import annotations

from baton.model.config import ModelConfig
from baton.model.kv_cache import KVCacheSpec, allocate_kv_cache
from baton.model.llama import LlamaModel
from baton.model.loader import ModelLoadError, default_model_path, load_model
from baton.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = [
    "IncrementalDetokenizer",
    "KVCacheSpec",
    "LlamaModel",
    "ModelConfig",
    "ModelLoadError",
    "Tokenizer",
    "allocate_kv_cache",
    "default_model_path",
    "load_model",
]
