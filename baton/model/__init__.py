"""Model runtime: decoder forward over a block-major paged KV pool, loaders, tokenizer.

Attributes load on first use (PEP 562), so `baton.model.modes` (the mode names configs check)
imports without torch; everything else here needs it.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "IncrementalDetokenizer": "baton.tokenizer",
    "KVCacheSpec": "baton.model.kv_cache",
    "LlamaModel": "baton.model.llama",
    "ModelConfig": "baton.model.config",
    "ModelLoadError": "baton.model_files",
    "Tokenizer": "baton.tokenizer",
    "allocate_kv_cache": "baton.model.kv_cache",
    "default_model_path": "baton.model_files",
    "load_model": "baton.model.loader",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'baton.model' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
